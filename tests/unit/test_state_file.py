"""The lighthouse's state file: what it keeps, when it writes, and that a bad
file is refused at start with its path and the fix."""

from __future__ import annotations

import os

import pytest

from lighthouse.core.quorum import JobMark, Quorum, QuorumMember
from lighthouse.shell.state_file import (
    StateFile,
    StateFiles,
    decode,
    encode,
    job_path,
    load,
    write_atomic,
)


def quorum(qid: int, *ids: str) -> Quorum:
    return Quorum(qid, tuple(QuorumMember(r) for r in ids), 5.0)


def test_a_mark_survives_encoding():
    mark = JobMark(high_water_step=40, quorum_id=123, members=("a", "b"), saved_at=5.0)
    assert decode(encode(mark), "f") == mark
    assert mark.quorum() == quorum(123, "a", "b")
    assert JobMark().quorum() is None


@pytest.mark.parametrize(
    "text, part",
    [
        ("not json", "is not a lighthouse state file"),
        ('{"version": 9, "high_water_step": 1, "quorum_id": 1, "members": []}', "version 9"),
        ('{"version": 1, "quorum_id": 1, "members": []}', "high_water_step"),
        ('{"version": 1, "high_water_step": -1, "quorum_id": 1, "members": []}', "negative"),
        ("[]", "is not a lighthouse state file"),
    ],
)
def test_a_bad_file_is_refused_naming_it_and_the_fix(text, part):
    with pytest.raises(ValueError, match=part) as e:
        decode(text, "/var/lib/lh.json")
    assert "/var/lib/lh.json" in str(e.value) and "remove it" in str(e.value)


def test_a_missing_file_is_a_new_job(tmp_path):
    assert load(str(tmp_path / "none.json")) is None
    assert StateFile(str(tmp_path / "none.json")).restored is None


def test_an_unwritable_folder_is_refused_at_start(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: every folder is writable")
        with pytest.raises(ValueError, match="is not writable"):
            StateFile(str(folder / "state.json"))
    finally:
        folder.chmod(0o700)


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "state.json")
    write_atomic(path, "one", durable=True)
    write_atomic(path, "two", durable=False)
    assert open(path).read() == "two"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_new_quorum_is_written_at_once_a_grown_mark_at_most_every_interval(tmp_path):
    path = str(tmp_path / "state.json")
    state = StateFile(path, min_interval_s=0.1)
    state.issued(10.0, quorum(1, "a", "b"), 5)
    assert load(path) == JobMark(5, 1, ("a", "b"), 5.0)
    state.issued(10.05, quorum(1, "a", "b"), 6)  # same quorum, mark grew: too soon
    assert load(path) == JobMark(5, 1, ("a", "b"), 5.0)
    state.flush(10.12)  # the tick
    assert load(path) == JobMark(6, 1, ("a", "b"), 5.0)
    state.issued(10.13, quorum(2, "a"), 7)  # new members: at once, however soon
    assert load(path) == JobMark(7, 2, ("a",), 5.0)
    state.issued(10.14, quorum(2, "a"), 8)
    state.flush(10.15, force=True)  # shutdown
    assert load(path) == JobMark(8, 2, ("a",), 5.0)
    assert StateFile(path).restored == JobMark(8, 2, ("a",), 5.0)


def test_a_failed_write_of_a_new_quorum_removes_the_stale_file(tmp_path, caplog, monkeypatch):
    path = tmp_path / "state.json"
    state = StateFile(str(path))
    state.issued(1.0, quorum(1, "a"), 5)
    assert path.exists()

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("lighthouse.shell.state_file.write_atomic", disk_full)
    state.issued(2.0, quorum(2, "a"), 6)  # training goes on: no raise
    # The old quorum's id must not come back after a restart: rather no file.
    assert "could not write the state file" in caplog.text and "No space left" in caplog.text
    assert not path.exists()


# ---- every job's file ------------------------------------------------------------


def test_each_job_has_its_file_and_a_forgotten_job_takes_its_own(tmp_path):
    path = str(tmp_path / "lh.json")
    files = StateFiles(path, min_interval_s=0)
    assert files.saved_jobs() == []
    for job in ("default", "a", "b"):
        files.for_job(job).issued(1.0, quorum(7, "r0"), 3)
    assert job_path(path, "default") == path
    assert job_path(path, "a") == str(tmp_path / "lh.json.jobs" / "a.json")
    assert files.saved_jobs() == ["default", "a", "b"]
    assert StateFiles(path).for_job("b").restored == JobMark(3, 7, ("r0",), 5.0)
    files.forget("a")
    files.forget("default")  # never: it is a single-job lighthouse's file
    files.forget("nope")
    assert files.saved_jobs() == ["default", "b"]


def test_a_file_in_the_jobs_folder_that_names_no_job_is_left_alone(tmp_path, caplog):
    folder = tmp_path / "lh.json.jobs"
    folder.mkdir()
    for name in ("x y.json", "notes.txt", "default.json", "ok.json"):
        (folder / name).write_text("{}")
    assert StateFiles(str(tmp_path / "lh.json")).saved_jobs() == ["ok"]
    assert sum("is no job's file" in r.getMessage() for r in caplog.records) == 3
