"""How a recovering replica receives the live state of a healthy peer."""

from torchft_like.checkpointing.http_transport import HTTPTransport
from torchft_like.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport"]
