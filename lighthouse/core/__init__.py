"""The lighthouse's pure core: no clock, socket, thread or asyncio here.

The shell (lighthouse.shell) passes `now` in and acts on what comes out,
so every rule is tested as a plain function. One line per room:

- `membership`: the state machine the server runs, events in, effects out;
- `effects`: those effects, as values;
- `quorum`: the quorum rule, its config and what a restart keeps (JobMark);
- `members`: a member and an issued quorum, as the wire carries them;
- `views`: each group rank's share of a quorum (rank, store, heal source);
- `member_data`: the keys and JSON of a member's `data`;
- `heals`: heal events, from what groups report;
- `history`: quorum changes and refusals, and why a member was absent;
- `quorum_log`: what is said of a quorum not yet issued;
- `gone`: who of the last quorum is gone, and who must hear it;
- `lateness`: who went unheard, without scanning everyone;
- `pacing`: the heartbeat period the lighthouse advises;
- `spares`: which hot spare trains as which group;
- `compat`: which groups of a mixed-version job can share an allreduce;
- `jobs/`: many jobs on one lighthouse: ids, each job's rule and secret, bounds.
"""
