"""The project's RPC layer, shared by the lighthouse and the training library.

Torch-free. What both server runtimes (grpcio's, and ours in `lean` over
`h2`) share sits at this level:

- `errors`: the error family and its one table to and from gRPC statuses;
- `auth`: the shared secret; `tls`: transport security (TLSConfig);
- `address`: bind addresses and URLs;
- `serve`: starting a server on either runtime; `decode_guard`: the answer
  to undecodable requests; `channel`: client channels;
- `proto`: the generated stubs of both services.
"""
