"""The group rooms' logger adapter: every line starts with the group's id.

A job's log interleaves its groups' servers, so each line says whose it is,
`[{replica_id}] ...`, or `[{replica_id} step=N] ...` for a line about one
step (`step=N` given to the call), as the Manager's own lines do; the rooms
then never format the prefix by hand.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class GroupLog(logging.LoggerAdapter):
    """`logger`'s lines prefixed with the group's `replica_id` (also each
    record's `replica_id` attribute)."""

    def __init__(self, logger: logging.Logger, replica_id: str) -> None:
        super().__init__(logger, {"replica_id": replica_id})
        self._replica_id = replica_id

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        step = kwargs.pop("step", None)
        where = self._replica_id if step is None else f"{self._replica_id} step={step}"
        if "%" in str(msg):  # a format string (it has arguments): so is the prefix now
            where = where.replace("%", "%%")
        return super().process(f"[{where}] {msg}", kwargs)
