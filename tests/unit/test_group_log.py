"""The group rooms' log lines name the group as the hand-made prefixes did."""

from __future__ import annotations

import logging

import pytest

from torchft_like.manager.group.log import GroupLog


@pytest.mark.parametrize(
    "replica_id, call, want",
    [
        ("g:1", lambda log: log.info("listening on %s", "x"), "[g:1] listening on x"),
        ("g:1", lambda log: log.info("no arguments"), "[g:1] no arguments"),
        ("g:1", lambda log: log.info("voted no: %s", [1], step=7), "[g:1 step=7] voted no: [1]"),
        ("50%:1", lambda log: log.warning("at %d", 3), "[50%:1] at 3"),
        ("50%:1", lambda log: log.warning("plain"), "[50%:1] plain"),
        ("50%:1", lambda log: log.log(logging.ERROR, "%s", "t", step=2), "[50%:1 step=2] t"),
    ],
)
def test_a_line_starts_with_the_group_and_its_step_if_given(replica_id, call, want, caplog):
    caplog.set_level(logging.INFO, logger="test_group_log")
    call(GroupLog(logging.getLogger("test_group_log"), replica_id))
    [record] = caplog.records
    assert record.getMessage() == want
    assert record.replica_id == replica_id
    assert record.pathname == __file__  # the call site, not the adapter
