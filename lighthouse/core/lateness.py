"""Which replicas went unheard for a while, found without scanning them all.

A tick of a lighthouse with 10,000 groups that walked every replica to find
the silent ones cost ~25 ms (docs/fleet.md), every 100 ms, when nothing had
changed. `Lateness` keeps one deadline per replica in a heap instead: a tick
looks only at the deadlines that passed, so it costs O(log n) per replica
and period, and nothing when nobody is due. Pure: the clock and the last
heard times are passed in (tests/unit/test_lateness.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping


class Lateness:
    """Deadlines `after_s` past each key's last heard time.

    `heard` arms a key (once: a key already armed keeps its deadline, which
    `expired` moves on when it finds the key heard since). `expired` returns
    the keys unheard for `after_s` now; each is returned once, until it is
    heard again. A smaller `after_s` than the one a deadline was armed with
    is noticed only when that deadline passes: pass the smallest silence
    that matters.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._armed: set[str] = set()

    def heard(self, key: str, at: float, after_s: float) -> None:
        if key not in self._armed:
            self._armed.add(key)
            heapq.heappush(self._heap, (at + after_s, key))

    def expired(self, now: float, last_heard: Mapping[str, float], after_s: float) -> list[str]:
        """Keys of `last_heard` unheard for `after_s` at `now`; keys no longer
        in `last_heard` (forgotten) are dropped."""
        late = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            self._armed.discard(key)
            last = last_heard.get(key)
            if last is None:
                continue
            if last + after_s > now:  # heard since it was armed: a later deadline
                self.heard(key, last, after_s)
            else:
                late.append(key)
        return late

    def __len__(self) -> int:
        return len(self._heap)
