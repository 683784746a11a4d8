"""The one exception <-> gRPC status table, read both ways, keeps class and reason."""

import grpc
import pytest

from lighthouse.rpc.errors import (
    DuplicateGroupError,
    FreshStartRefusedError,
    IncompatibleGroupError,
    LighthouseUnavailableError,
    NotServedError,
    QuorumError,
    QuorumTimeoutError,
    error_of,
    status_of,
)


@pytest.mark.parametrize(
    "error, code",
    [
        (ValueError("step (-1) must not be negative"), grpc.StatusCode.INVALID_ARGUMENT),
        (QuorumTimeoutError("waiting for replicas: 1 joined"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (LighthouseUnavailableError("could not connect"), grpc.StatusCode.UNAVAILABLE),
        (NotServedError("rank 1 has not asked"), grpc.StatusCode.NOT_FOUND),
        (DuplicateGroupError("group 'g' is already live"), grpc.StatusCode.ALREADY_EXISTS),
        (
            IncompatibleGroupError("replica r speaks another rendezvous"),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (FreshStartRefusedError("refusing to train from step 0"), grpc.StatusCode.OUT_OF_RANGE),
        (PermissionError("Kill needs the job's secret"), grpc.StatusCode.PERMISSION_DENIED),
        (QuorumError("replica r left"), grpc.StatusCode.ABORTED),
    ],
)
def test_each_error_travels_as_its_status_and_comes_back_as_itself(error, code):
    assert status_of(error) == code
    back = error_of(code, str(error))
    assert type(back) is type(error)
    assert str(back) == str(error)


def test_a_timeout_is_still_a_timeout_and_a_quorum_error():
    assert isinstance(error_of(grpc.StatusCode.DEADLINE_EXCEEDED, "x"), TimeoutError)
    assert isinstance(error_of(grpc.StatusCode.DEADLINE_EXCEEDED, "x"), QuorumError)


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED, None]
)
def test_a_status_outside_the_table_is_a_quorum_error_naming_the_code(code):
    error = error_of(code, "Heartbeat at lighthouse h failed: no")
    assert type(error) is QuorumError
    assert (code.name if code else "unknown status") in str(error)


def test_errors_outside_the_family_have_no_status():
    assert status_of(KeyError("x")) is None


def test_a_timeout_carries_torchfts_text_once_across_hops():
    # Code written for torchft matches its timeout text; ours keep it after
    # our own reason, and a timeout relayed through a server does not repeat it.
    first = QuorumTimeoutError("waiting for replicas: 1 joined")
    relayed = error_of(grpc.StatusCode.DEADLINE_EXCEEDED, f"Quorum at m failed: {first}")
    for error in (first, relayed):
        assert str(error).count('status: Cancelled, message: "Timeout expired"') == 1
    assert str(relayed).startswith("Quorum at m failed: waiting for replicas: 1 joined")
