"""Which Quorum calls a ManagerServer lets into its round (quorum_admission.admit):
a stray or forged call is refused, or gives way to the rank's own call."""

from __future__ import annotations

import pytest

from lighthouse.rpc.errors import QuorumError
from torchft_like.manager.group.admission import admit

OWN = "http://10.0.0.5:4001/torchft_like/checkpoint/"
"""Rank 1's registered checkpoint metadata."""
OTHER = ""


@pytest.mark.parametrize(
    "name, step, metadata, known, waiting, last_max, verdict",
    [
        ("a rank's first call", 0, OWN, None, None, None, "trusted"),
        ("its own call", 11, OWN, OWN, None, 10, "trusted"),
        ("its own call after loading a later checkpoint", 5000, OWN, OWN, None, 10, "trusted"),
        ("a stray call in an empty slot waits, untrusted", 10, OTHER, OWN, None, 10,
         "untrusted"),
        ("a stray call past the last quorum", 10**12, OTHER, OWN, None, 10, "ValueError"),
        ("one step past is still possible", 11, OTHER, OWN, None, 10, "untrusted"),
        ("before the first quorum nothing bounds the step", 10**12, OTHER, OWN, None, None,
         "untrusted"),
        ("the rank's own call takes a stray one's place", 11, OWN, OWN, OTHER, 10, "displaces"),
        ("a stray call does not take the rank's place", 11, OTHER, OWN, OWN, 10,
         "QuorumError"),
        ("a second stray call for the same slot", 11, OTHER, OWN, OTHER, 10, "QuorumError"),
        ("a second call with the rank's metadata", 11, OWN, OWN, OWN, 10, "QuorumError"),
    ],
)  # fmt: skip
def test_admit(name, step, metadata, known, waiting, last_max, verdict):
    a = admit(1, step, metadata, known, waiting, last_max)
    if verdict in ("ValueError", "QuorumError"):
        assert type(a.error).__name__ == verdict
        return
    assert a.error is None
    assert a.trusted == (verdict != "untrusted")
    assert (a.displaced is not None) == (verdict == "displaces")


def test_each_refusal_says_why_and_that_the_group_goes_on():
    past = admit(1, 10**12, OTHER, OWN, None, 10).error
    assert isinstance(past, ValueError)
    assert "step 1000000000000" in str(past) and "max step 10" in str(past)
    assert "stray or forged" in str(past) and "the group trains on" in str(past)
    second = admit(1, 11, OTHER, OWN, OWN, 10).error
    assert isinstance(second, QuorumError)
    assert "already has a Quorum call waiting" in str(second)
    assert "the waiting call goes on" in str(second)
    gives_way = admit(1, 11, OWN, OWN, OTHER, 10).displaced
    assert gives_way is not None and "gives way" in str(gives_way)
