"""HTTP/2 (RFC 9113) as our own gRPC runtime speaks it; nothing of gRPC here.

The ladder, bottom up:

- `frames`: frame types, flags, error codes, checks, HPACK literals;
- `limits`: what a peer may make the server hold or do, and frame rates;
- `shares`: the process's pools, shared fairly between peer hosts;
- `flow`: a connection's streams and flow control, both ways;
- `control_frames`: SETTINGS, WINDOW_UPDATE, PING, RST_STREAM, PRIORITY, keepalive;
- `corking`: answers gathered for one send per connection;
- `header_lists`: a request's header list decoded (each repeated block once) and checked;
- `server_connection`: the server side of one connection (the part an
  attacker reaches); `connections`: how many are kept, from whom, for how
  long; `tls_accept`: TLS connections counted from accept;
- `client_connection`: the client side of one connection.

gRPC over it is lighthouse.rpc.lean.
"""
