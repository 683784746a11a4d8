"""Answers gathered for one send per connection.

The turn that issues a quorum answers every waiting call at once; several
of those calls may share a connection (a proxy, or groups that share one
channel), and a send per answer costs a syscall each. Within `corked()`
the lean server's connections gather what they write and send it once at
the end, in the same turn of the loop. grpcio's server ignores it.

Per thread: a process may run servers on several loops, one thread each
(BackgroundLoop), and a connection's bytes must leave from its own loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()
"""`flushes`: the flushes of this thread's connections that wrote within
`corked()`, or None outside."""


def cork(flush: Callable[[], None]) -> bool:
    """Whether a connection's write may wait for `flush` at the end of `corked()`."""
    flushes: list[Callable[[], None]] | None = getattr(_local, "flushes", None)
    if flushes is None:
        return False
    flushes.append(flush)
    return True


@contextmanager
def corked() -> Iterator[None]:
    if getattr(_local, "flushes", None) is not None:  # nested: the outer one flushes
        yield
        return
    flushes: list[Callable[[], None]] = []
    _local.flushes = flushes
    try:
        yield
    finally:
        _local.flushes = None
        for flush in flushes:
            flush()
