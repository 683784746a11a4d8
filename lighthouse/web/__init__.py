"""The project's HTTP/1 servers (threaded, torch-free).

- `server`: the base of every one: a bounded backlog, quiet hang-ups;
- `metrics`: a read-only Prometheus `/metrics` server, for the Managers.

The lighthouse's status page (lighthouse.status.server) and the
checkpoint server (torchft_like.checkpointing) build on `server`.
"""
