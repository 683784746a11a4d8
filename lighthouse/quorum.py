"""`Quorum` and `QuorumMember` where torchft's users and the conformance
shim import them from; they live in lighthouse.core.quorum."""

from lighthouse.core.quorum import LighthouseConfig, Quorum, QuorumMember

__all__ = ["LighthouseConfig", "Quorum", "QuorumMember"]
