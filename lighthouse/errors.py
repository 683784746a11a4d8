"""The lighthouse's error family, shared by its server and its clients."""


class QuorumError(RuntimeError):
    """A quorum could not be obtained."""


class QuorumTimeoutError(QuorumError, TimeoutError):
    """No quorum containing the caller was issued before the deadline."""


class LighthouseUnavailableError(QuorumError, ConnectionError):
    """The lighthouse (or a manager server) could not be reached."""
