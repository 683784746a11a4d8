"""HTTP/2 (RFC 9113) as our own gRPC runtime speaks it; nothing of gRPC here.

The ladder, bottom up:

- `frames`: frame types, flags, error codes, checks, HPACK literals;
- `limits`: what a peer may make the server hold or do, and its accounting;
- `flow`: a connection's streams and flow control, both ways;
- `corking`: answers gathered for one send per connection;
- `header_lists`: a request's header list decoded (each repeated block once) and checked;
- `server_connection`: the server side of one connection (the part an
  attacker reaches); `connections`: how many are kept, and for how long idle;
- `client_connection`: the client side of one connection.

gRPC over it is lighthouse.rpc.lean.
"""
