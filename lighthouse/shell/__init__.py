"""The lighthouse's I/O shell around the pure core (lighthouse.core).

- `server`: LighthouseServer, its gRPC servicer and the tick loop;
- `coordinator`: the clock, the waiting calls, the streams' outboxes; turns
  each call into a membership event and acts on the effects;
- `parked`: the waiting calls (Quorum, hot spares) and their shared deadline timers;
- `state_file`: the job's mark kept across a lighthouse restart;
- `metrics`: the lighthouse's Prometheus metrics.
"""
