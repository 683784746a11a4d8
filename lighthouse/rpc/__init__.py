"""The project's RPC layer, shared by the lighthouse and the training library.

Torch-free. `proto` holds the generated stubs of both services; `errors` the
error family and its one table to and from gRPC status codes; `auth` the
shared secret; `tls` transport security (TLSConfig); `address` bind
addresses and URLs; `channel` client channels;
`serve` server start-up; `loop` the background event loop and deadlines;
`decode_guard` the answer to undecodable requests.
"""
