"""The thread that times a process group's collectives (in_flight's rule).

One per process group, started on its first collective, asleep while none
is in flight; it wakes when the oldest is due, or every RELEASE_S to let
the finished ones go, and hands an overdue one to its owner, who aborts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torchft_like.process_group.in_flight import InFlight, Issued


class Watchdog:
    """Times the collectives `add`ed; calls `on_overdue(issued)` off the
    caller's thread for the first one past its deadline, then forgets them
    all (the owner aborts the communicator they ran on)."""

    def __init__(self, name: str, on_overdue: Callable[[Issued], None]) -> None:
        self._name = name
        self._on_overdue = on_overdue
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._in_flight = InFlight()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, issued: Issued) -> None:
        with self._lock:
            self._closed = False
            if self._in_flight.add(issued):
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._wake.notify_all()

    def clear(self) -> None:
        """Forgets every collective (their communicator is gone)."""
        with self._lock:
            self._in_flight.clear()
            self._wake.notify_all()

    def busy(self) -> bool:
        """Whether a collective added is not seen completed yet (a look, now)."""
        with self._lock:
            look = self._in_flight.look(time.monotonic())
        return look.overdue is not None or look.next_look is not None

    def wait_idle(self, until: Callable[[], bool]) -> None:
        """Returns once every collective added completed, or `until()` holds
        (the owner's error); polls, 0.5 to 5 ms apart: a device's completion
        has no host wake-up."""
        delay = 0.0005
        while not until() and self.busy():
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def __len__(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def close(self) -> None:
        """Ends the thread (a later `add` starts one again)."""
        with self._lock:
            self._closed = True
            self._in_flight.clear()
            self._wake.notify_all()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._closed or self._thread is not me:
                    return
                look = self._in_flight.look(time.monotonic())
                if look.overdue is None:
                    timeout = None if look.next_look is None else look.next_look - time.monotonic()
                    self._wake.wait(timeout)
                    continue
                self._in_flight.clear()
            self._on_overdue(look.overdue)
