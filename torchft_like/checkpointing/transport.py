"""The interface by which a recovering replica receives the live state of a peer."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import ClassVar, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CheckpointTransport(ABC, Generic[T]):
    """Moves the live state of up-to-date replicas to recovering ones.

    No checkpoint touches disk: a replica that comes back copies the weights
    and optimizer state a healthy peer holds right now, during the step in
    which the quorum lets it rejoin. Per step, the manager of a source calls
    `send_checkpoint` after the quorum (forward and backward do not write
    the weights, so they are stable until the optimizer step), then
    `disallow_checkpoint` before its optimizer step. A recovering replica
    gets the source's `metadata()` through the source's ManagerServer and
    calls `recv_checkpoint` with it, for the step the quorum names.
    """

    can_stripe: ClassVar[bool] = False
    """Serves ranges of its state to receivers that ask (pull), so a healer
    may fetch from several sources at once (`recv_checkpoint_striped`). A
    transport that pushes (sends to `dst_ranks`) cannot: its healers each
    receive from one source, and a source sends only to its own."""
    reports_begun: ClassVar[bool] = False
    """`recv_checkpoint` takes `on_begun`, called once the source has begun
    serving (and so will serve to the end); the Manager then lets the
    healer's collectives run while the state still arrives."""

    # Both are read with `capable`, from the class: a user's wrapper that
    # forwards attributes to a transport (`__getattr__`) would otherwise
    # claim its transport's capabilities without the methods that have them.

    @abstractmethod
    def metadata(self) -> str:
        """How peers reach this transport; for HTTP its URL ``http://host:port``.

        It is stable for the transport's lifetime, so a manager sends it
        with every quorum request.
        """

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Makes `state_dict`, the live state at `step`, available to `dst_ranks`.

        An implementation may serve the caller's tensors in place rather than
        copy them (a copy of the whole model per step would cost memory and
        time), so the caller must not write them until `disallow_checkpoint`
        returns.

        Args:
            dst_ranks: replica ranks that will fetch it (informational for
                pull-based transports).
            step: the step `state_dict` belongs to; requests for any other
                step are refused, so a receiver never gets stale weights.
            state_dict: the state to send.
            timeout: how long a transfer of it may take.

        Raises:
            TypeError: `state_dict` holds a value the transport cannot carry.
        """

    @abstractmethod
    def disallow_checkpoint(self) -> None:
        """Stops serving the staged state and waits until no transfer reads it.

        Called before the optimizer step: once it returns the weights may be
        written. Waiting is bounded by the transport's timeout; a transfer
        still running then is cut off, so its receiver fails rather than
        gets half-written weights.
        """

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the state of `step` from the source reachable at `metadata`.

        The source may not have staged `step` yet when this is called (the
        two replicas leave the quorum at slightly different times), so the
        receiver retries until `timeout`. A source that serves another step
        can never serve this one (it stages the step of its quorum), so that
        refusal fails at once.

        Args:
            src_rank: the source's replica rank (for messages and routing).
            metadata: the source's `metadata()`.
            step: the step wanted; the source's quorum max_step.
            timeout: bound on the whole fetch, retries included.

        Returns:
            The state dict as the source staged it.

        Raises:
            RuntimeError: the source did not serve `step` within `timeout`
                (unreachable, not serving), or refused it for good (another
                step); the message names the source and the last answer.
            ValueError: the source answered something that is not a valid
                state stream.
        """

    def recv_checkpoint_striped(
        self,
        sources: Sequence[tuple[int, str]],
        step: int,
        timeout: timedelta,
        *,
        on_begun: Callable[[], None] | None = None,
    ) -> T:
        """Fetches the state of `step` from the (replica rank, metadata) of
        `sources`, in stripes from all at once or from the first alone, as
        `heal_source.heal_fetch` says; only where `can_stripe`. `on_begun`
        (where `reports_begun`): as `recv_checkpoint`'s, for a fetch from one.

        Raises:
            NotImplementedError: this transport cannot stripe.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot stripe (can_stripe is False)")

    def shutdown(self, wait: bool = True) -> None:
        """Releases sockets and threads; idempotent.

        Args:
            wait: block until background threads have stopped.
        """


def capable(transport: object, capability: str) -> bool:
    """Whether `transport`'s own class declares `capability` (`can_stripe`,
    `reports_begun`); False for any other object, a delegating wrapper
    included, which then gets the torchft-shaped calls."""
    return bool(getattr(type(transport), capability, False))
