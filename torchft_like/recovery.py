"""The module path torchft's `_torchft.QuorumResult` is mapped from by the
conformance shim (shared/conformance/shim_like); kept so that path resolves.

A rank's heal plan is torchft_like.manager.heal_plan; each group rank's
share of a quorum is lighthouse.core.views.
"""

from lighthouse.core.views import QuorumResult

__all__ = ["QuorumResult"]
