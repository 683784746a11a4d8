"""The interface by which a healing replica receives the live state of a peer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointTransport(ABC, Generic[T]):
    """Moves a state dict from up-to-date replicas to recovering ones.

    A source calls `send_checkpoint` after the quorum, while its weights are
    stable (forward and backward do not write them), and `disallow_checkpoint`
    before its optimizer step; a receiver calls `recv_checkpoint` with the
    source's `metadata()`, which it gets through the source's ManagerServer.
    """

    @abstractmethod
    def metadata(self) -> str:
        """How peers reach this transport (for HTTP, its URL)."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Makes `state_dict` of `step` available to `dst_ranks`."""

    def disallow_checkpoint(self) -> None:
        """Stops serving; returns once no transfer reads the state any more, so
        the optimizer may write the weights."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the state of `step` from the source at `metadata`.

        Raises:
            RuntimeError: the source did not serve that step within `timeout`.
        """

    def shutdown(self, wait: bool = True) -> None:
        """Releases sockets and threads; idempotent."""
