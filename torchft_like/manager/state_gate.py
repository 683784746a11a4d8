"""A gate that holds back reads of the user state while the trainer writes it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StateReadGate:
    """Readers (serving our state to a healing peer) wait while the trainer
    has disallowed reads, e.g. while LocalSGD/DiLoCo write averaged weights
    in place; the trainer's disallow waits for reads already running.

    Both waits are bounded by `timeout_s`, so a trainer that forgets to
    allow again fails the next heal with a message instead of hanging.
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._allowed = True
        self._readers = 0

    @property
    def allowed(self) -> bool:
        return self._allowed

    def disallow(self) -> None:
        """Blocks new reads and waits for running ones; idempotent."""
        with self._cond:
            self._allowed = False
            if not self._cond.wait_for(lambda: self._readers == 0, self._timeout_s):
                self._allowed = True
                raise TimeoutError(
                    f"{self._readers} state dict reads still running after "
                    f"{self._timeout_s:g} s; reads stay allowed, call disallow_state_dict_read "
                    "again once they finish"
                )

    def allow(self) -> None:
        """Lets reads run again; idempotent."""
        with self._cond:
            self._allowed = True
            self._cond.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        """Holds a read, after waiting for reads to be allowed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._allowed, self._timeout_s):
                raise TimeoutError(
                    f"state dict reads were disallowed for {self._timeout_s:g} s (the Manager's "
                    "timeout): call allow_state_dict_read after writing the state"
                )
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()
