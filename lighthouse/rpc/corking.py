"""Answers gathered for one send per connection.

The turn that issues a quorum answers every waiting call at once; several
of those calls may share a connection (a proxy, or groups that share one
channel), and a send per answer costs a syscall each. Within `corked()`
the lean server's connections gather what they write and send it once at
the end, in the same turn of the loop. grpcio's server ignores it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

_open: list[Callable[[], None]] | None = None
"""The flushes of the connections that wrote within `corked()`, or None outside."""


def cork(flush: Callable[[], None]) -> bool:
    """Whether a connection's write may wait for `flush` at the end of `corked()`."""
    if _open is None:
        return False
    _open.append(flush)
    return True


@contextmanager
def corked() -> Iterator[None]:
    global _open
    if _open is not None:  # nested: the outer one flushes
        yield
        return
    flushes: list[Callable[[], None]] = []
    _open = flushes
    try:
        yield
    finally:
        _open = None
        for flush in flushes:
            flush()
