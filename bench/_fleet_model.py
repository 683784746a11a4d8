"""The failure model of the simulated fleet (bench.fleet_sim): seeded, and
independent of how the simulation unfolds.

Each replica group (a name, `g000042`) fails as a renewal process: times
between failures exponential or Weibull with a mean of `group_mtbf_s`; each
rack of `rack_size` consecutive group names also fails as a whole
(exponential, mean `rack_mtbf_s`). The whole schedule up to a horizon is
drawn before the simulation starts (each renewal process starts
`BURN_IN_MEANS` means before time 0, so a fleet's first minutes are not
its nodes' first minutes), from generators seeded by the seed and the
group's or rack's index only, so the same seed gives the same failure
times whatever the fleet does meanwhile (a failure that hits a group with no
live process, one restarting, is simply void).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

BURN_IN_MEANS = 3.0


@dataclass(frozen=True)
class FailureModel:
    """Options of the failure model; `None` means the fault-free fleet."""

    group_mtbf_s: float | None = 6 * 3600.0
    """Mean time between failures of one group (its processes, its node)."""
    dist: str = "weibull"
    """`exp` (memoryless) or `weibull` (shape `weibull_k`, same mean)."""
    weibull_k: float = 0.7
    """Weibull shape: under 1, failures cluster (infant mortality, flaky nodes)."""
    rack_size: int = 32
    """Consecutive group names that share a rack (a switch, a power domain)."""
    rack_mtbf_s: float | None = 30 * 24 * 3600.0
    """Mean time between failures of one rack, all of its groups at once."""

    def __post_init__(self) -> None:
        if self.dist not in ("exp", "weibull"):
            raise ValueError(f"dist must be exp or weibull, not {self.dist!r}")
        if self.weibull_k <= 0 or self.rack_size < 1:
            raise ValueError("weibull_k must be positive and rack_size at least 1")

    def _between(self, rng: random.Random, mean_s: float) -> float:
        if self.dist == "exp":
            return rng.expovariate(1 / mean_s)
        scale = mean_s / math.gamma(1 + 1 / self.weibull_k)
        return rng.weibullvariate(scale, self.weibull_k)


FAULT_FREE = FailureModel(group_mtbf_s=None, rack_mtbf_s=None)


@dataclass(frozen=True)
class Failure:
    """At virtual time `at`, the live processes of `groups` die (`kind`: group or rack)."""

    at: float
    groups: tuple[int, ...]
    kind: str


def failure_schedule(
    model: FailureModel, seed: int, n_groups: int, horizon_s: float
) -> list[Failure]:
    """Every failure before `horizon_s`, sorted by time (ties: groups first, by index)."""
    out: list[Failure] = []
    if model.group_mtbf_s is not None:
        for g in range(n_groups):
            rng = random.Random(f"{seed}/group/{g}")
            t = -BURN_IN_MEANS * model.group_mtbf_s + model._between(rng, model.group_mtbf_s)
            while t < horizon_s:
                if t >= 0:
                    out.append(Failure(t, (g,), "group"))
                t += model._between(rng, model.group_mtbf_s)
    if model.rack_mtbf_s is not None:
        for r in range(math.ceil(n_groups / model.rack_size)):
            rng = random.Random(f"{seed}/rack/{r}")
            groups = tuple(range(r * model.rack_size, min(n_groups, (r + 1) * model.rack_size)))
            t = rng.expovariate(1 / model.rack_mtbf_s)  # memoryless: no burn-in needed
            while t < horizon_s:
                out.append(Failure(t, groups, "rack"))
                t += rng.expovariate(1 / model.rack_mtbf_s)
    out.sort(key=lambda f: (f.at, f.kind != "group", f.groups))
    return out
