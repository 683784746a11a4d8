"""gRPC over our own HTTP/2 (lighthouse.rpc.h2): the lighthouse's hot path.

- `server`: LeanServer, serving grpcio's generated method tables;
- `server_call`: one call as its handler sees it (the Call seam), and its answers;
- `request_stream`: a streaming call's requests, iterated or delivered;
- `client_calls`: our client's calls: messages framed, statuses read;
- `client`: LeanChannel, unary and streaming calls on the caller's loop.
"""
