"""The project's RPC error family and its one table to and from gRPC status codes.

The server that decides raises one of these with the reason in words;
`abort` sends it with the status code of the table, and `from_rpc_error`
turns the status back into the same class on the caller's side with the
reason intact, through any number of hops (rank -> ManagerServer ->
lighthouse and back).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NoReturn

import grpc

if TYPE_CHECKING:
    from lighthouse.rpc.call import Call

logger = logging.getLogger(__name__)


class QuorumError(RuntimeError):
    """A quorum (or a commit vote, or a call serving one) could not be obtained."""


TORCHFT_TIMEOUT_TEXT = 'status: Cancelled, message: "Timeout expired"'
"""What pytorch/torchft's timeouts say (its Rust gRPC text). Code written for
torchft matches on it, so ours carry it too, after our own reason."""


class QuorumTimeoutError(QuorumError, TimeoutError):
    """Nothing was decided before the deadline; the text says who was missing
    and why, then torchft's timeout text (once, however many hops it crossed)."""

    def __init__(self, reason: str = "") -> None:
        if TORCHFT_TIMEOUT_TEXT not in reason:
            reason = f"{reason} ({TORCHFT_TIMEOUT_TEXT})"
        super().__init__(reason)


class LighthouseUnavailableError(QuorumError, ConnectionError):
    """The lighthouse (or a ManagerServer) could not be reached."""


class NotServedError(QuorumError, LookupError):
    """The server does not hold what was asked for (yet)."""


class DuplicateGroupError(QuorumError):
    """Another live replica already trains under this replica group's name.

    Not retried: waiting does not help while the other one lives, and
    training on would train one data shard twice. Stop one of them."""


class IncompatibleGroupError(QuorumError):
    """This replica group cannot share an allreduce with the job's other
    groups (another torchft rendezvous, lighthouse.core.compat); the text names
    both versions and what to do.

    Not retried: the other groups keep training without it."""


class FreshStartRefusedError(QuorumTimeoutError):
    """No quorum came in time because every waiting group is at step 0 but
    the job already committed steps (lighthouse.core.quorum.fresh_start_refusal):
    no live group holds the job's state. The text names the mark and the ways
    on. The lighthouse answers a held call with it after a few seconds; our
    client logs it and asks again until its own deadline."""


class JobLimitError(QuorumError):
    """The lighthouse holds as many jobs, or a job as many replicas, as it
    may (--max-jobs, --max-members-per-job); the text says which and what to do."""


MAX_DETAILS_CHARS = 4000
"""Longest status text sent: it travels in trailing metadata, which gRPC caps
at 16 KiB, and a reason quoting huge ids (bad input) would break the answer."""

_STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    # The most specific first: the first class an error is an instance of wins.
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (FreshStartRefusedError, grpc.StatusCode.OUT_OF_RANGE),
    (QuorumTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LighthouseUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (NotServedError, grpc.StatusCode.NOT_FOUND),
    (DuplicateGroupError, grpc.StatusCode.ALREADY_EXISTS),
    (IncompatibleGroupError, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (JobLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QuorumError, grpc.StatusCode.ABORTED),
)
"""The one exception <-> status table, read in both directions."""


def status_of(error: Exception) -> grpc.StatusCode | None:
    """The status code `error` travels as, or None for an error outside the family."""
    for kind, code in _STATUS_OF:
        if isinstance(error, kind):
            return code
    return None


def error_of(code: grpc.StatusCode | None, text: str) -> Exception:
    """The exception a caller raises for a status: the class the table names,
    else QuorumError with the code's name (UNAUTHENTICATED, UNIMPLEMENTED...)."""
    for kind, known in _STATUS_OF:
        if code == known:
            return kind(text)
    return QuorumError(f"{text} ({code.name if code else 'unknown status'})")


def from_rpc_error(e: grpc.RpcError, peer: str, method: str) -> Exception:
    """The exception for a failed call of `method` on `peer`, keeping the server's text."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return error_of(code, f"{method} at {peer} failed: {details}")


def status_text(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and text a call ends with for `error`. An error outside
    the family is a bug of ours: logged with its traceback, answered INTERNAL."""
    code = status_of(error)
    if code is None:
        logger.error("unexpected error serving a call", exc_info=error)
        code = grpc.StatusCode.INTERNAL
        text = f"internal error: {type(error).__name__}: {error}"
    else:
        text = str(error)
    if len(text) > MAX_DETAILS_CHARS:
        text = text[:MAX_DETAILS_CHARS] + " ... (cut)"
    return code, text


async def abort(call: Call, error: Exception) -> NoReturn:
    """Ends the call with `error`'s status and text (status_text)."""
    await call.abort(*status_text(error))
    raise AssertionError("call.abort returned")  # it raises; this satisfies NoReturn
