"""The group's server: the rooms group rank 0 hosts for its replica group.

A role of its own beside the rank's rooms in manager/: one ManagerServer
per group gathers its ranks' calls, speaks for the group to the lighthouse
and collects the group's commit votes. The rank reaches it through
`client` (in process on rank 0, over gRPC elsewhere).

- `server`: the ManagerServer: the quorum and vote gatherings, on its loop.
- `gathering`: one gathering of the group's ranks (a quorum request or a vote).
- `quorum_gate`: which rank calls a quorum round lets in, and when it is complete.
- `admission`: pure: the rule quorum_gate applies to stray or forged calls.
- `group_request`: pure: the ranks' requests merged into the group's one.
- `session`: the group's session with the lighthouse: asks, retries,
  compat, gone relay, heartbeats.
- `servicer`: ManagerService's gRPC face of the server.
- `client`: the client protocol, its gRPC client, rank 0's in-process client.
- `wire`: ManagerService messages <-> dataclasses.
- `log`: the rooms' logger adapter: each line names the group.
"""
