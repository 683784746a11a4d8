"""What a lighthouse keeps across its own restart: `torchft-lighthouse --state-file PATH`.

The job's high-water mark (the highest step of any issued quorum's member),
the last quorum's id and its members. The mark keeps a restarted lighthouse
from letting groups at step 0 start the job over (quorum.fresh_start_refusal);
the members let it issue its first quorum the moment they are all back,
instead of waiting half a heartbeat timeout for stragglers it cannot know of.

Each job has its own file: the default job the file named (`PATH`, as a
single-job lighthouse always had), every other job `PATH.jobs/JOB.json`
(StateFiles). A job forgotten for being idle takes its file with it.

One small JSON file per job, replaced atomically (write a temporary file, rename), so
a crash leaves the old one or the new one, never half of one. A quorum with
new members or a new id is written (and fsynced) before any caller hears of
it: a restarted lighthouse that reissued an id under which the groups already
rendezvoused would collide in their stores. A mark that only grew (every step)
is written at most every `min_interval_s`, without fsync; it may lag by a
step or two after a crash, which only the guard reads, and that is at 0.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from lighthouse.core.jobs import DEFAULT_JOB, job_id_refusal
from lighthouse.core.quorum import JobMark, Quorum

logger = logging.getLogger(__name__)

VERSION = 1


def encode(mark: JobMark) -> str:
    return json.dumps(
        {
            "version": VERSION,
            "high_water_step": mark.high_water_step,
            "quorum_id": mark.quorum_id,
            "members": list(mark.members),
            "saved_at": mark.saved_at,
        }
    )


def decode(text: str, path: str) -> JobMark:
    """Raises ValueError naming `path`, what is wrong and what to do."""
    fix = "fix or remove it (removing it forgets the job's high-water mark)"
    try:
        raw = json.loads(text)
        if raw.get("version") != VERSION:
            raise ValueError(f"version {raw.get('version')!r}, this lighthouse reads {VERSION}")
        mark = JobMark(
            high_water_step=int(raw["high_water_step"]),
            quorum_id=int(raw["quorum_id"]),
            members=tuple(str(m) for m in raw["members"]),
            saved_at=float(raw.get("saved_at", 0.0)),
        )
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"state file {path} is not a lighthouse state file ({e}); {fix}") from None
    if mark.high_water_step < 0 or mark.quorum_id < 0:
        raise ValueError(f"state file {path} holds a negative step or quorum id; {fix}")
    return mark


def load(path: str) -> JobMark | None:
    """The file's mark; None when it does not exist yet (a new job).

    Raises:
        ValueError: the file is unreadable or not ours (named, with the fix).
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"cannot read state file {path}: {e}") from None
    return decode(text, path)


def write_atomic(path: str, text: str, durable: bool) -> None:
    """Replaces `path` by `text` all at once; with `durable`, on disk before it returns."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".lighthouse-state-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class StateFile:
    """Keeps one lighthouse's JobMark in `path` (see the module docstring).

    Args:
        path: the file; its folder must exist and be writable.
        min_interval_s: shortest gap between writes of a mark that only grew.

    Raises:
        ValueError: the file exists but is not a state file, or the folder
            is not writable (checked at start, not at the first quorum).
    """

    def __init__(self, path: str, min_interval_s: float = 0.1) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self.restored = load(path)
        self._saved = self.restored or JobMark()
        self._pending: JobMark | None = None
        self._written_at = float("-inf")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.access(folder, os.W_OK):
            raise ValueError(
                f"state file {path}: its folder {folder} does not exist or is not writable"
            )

    def issued(self, now: float, quorum: Quorum, high_water_step: int) -> None:
        """Records an issued quorum. Call it before the quorum is delivered."""
        mark = JobMark(high_water_step, quorum.quorum_id, quorum.replica_ids(), quorum.created)
        moved = (mark.quorum_id, mark.members) != (self._saved.quorum_id, self._saved.members)
        if moved:
            self._write(now, mark, durable=True)
        elif mark.high_water_step != self._saved.high_water_step:
            self._pending = mark
            self.flush(now)

    def flush(self, now: float, force: bool = False) -> None:
        """Writes a pending mark once `min_interval_s` has passed (or now, `force`)."""
        if self._pending is not None and (force or now - self._written_at >= self.min_interval_s):
            self._write(now, self._pending, durable=force)

    def _write(self, now: float, mark: JobMark, durable: bool) -> None:
        self._pending = None
        try:
            write_atomic(self.path, encode(mark), durable)
        except OSError as e:
            # Training goes on. A file left holding an older quorum could make
            # a restarted lighthouse reissue its id: remove it (the mark is
            # lost until the next write succeeds).
            logger.error("could not write the state file %s: %s", self.path, e)
            if durable:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
                self._saved = JobMark()
            return
        self._saved, self._written_at = mark, now


def job_path(path: str, job: str) -> str:
    """The state file of `job` in the lighthouse's `--state-file PATH`."""
    return path if job == DEFAULT_JOB else os.path.join(path + ".jobs", job + ".json")


class StateFiles:
    """The state files of every job of one lighthouse (see the module docstring).

    Raises:
        ValueError: the folder of `path` is not writable.
    """

    def __init__(self, path: str, min_interval_s: float = 0.1) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        folder = os.path.dirname(os.path.abspath(path))
        if not os.access(folder, os.W_OK):
            raise ValueError(
                f"state file {path}: its folder {folder} does not exist or is not writable"
            )

    def saved_jobs(self) -> list[str]:
        """The jobs with a state file, the default job first if it has one;
        a file whose name is no job id is left alone, with a warning."""
        jobs = [DEFAULT_JOB] if os.path.exists(self.path) else []
        try:
            names = sorted(os.listdir(self.path + ".jobs"))
        except FileNotFoundError:
            return jobs
        except OSError as e:
            raise ValueError(
                f"cannot list the jobs' state files in {self.path}.jobs: {e}"
            ) from None
        for name in names:
            job = name[: -len(".json")] if name.endswith(".json") else ""
            if job and job != DEFAULT_JOB and job_id_refusal(job) is None:
                jobs.append(job)
            elif not name.startswith(".lighthouse-state-"):
                logger.warning(
                    "state files: %s.jobs/%s is no job's file; left alone", self.path, name
                )
        return jobs

    def for_job(self, job: str) -> StateFile:
        """`job`'s file, restored if it exists. Raises ValueError (StateFile)."""
        path = job_path(self.path, job)
        if job != DEFAULT_JOB:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot make the jobs' state folder {path}: {e}") from None
        return StateFile(path, self.min_interval_s)

    def forget(self, job: str) -> None:
        """Removes a forgotten job's file (never the default job's)."""
        if job != DEFAULT_JOB:
            try:
                os.unlink(job_path(self.path, job))
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.error("could not remove the state file of forgotten job %s: %s", job, e)


def log_start(state: StateFile | None, allow_fresh_start: bool) -> None:
    """The lighthouse's start-up lines about what it keeps and what it allows."""
    if state is None:
        logger.info(
            "no --state-file: a restart of this lighthouse forgets the job's high-water mark"
        )
    elif state.restored is None:
        logger.info("state file %s: none yet (a new job); it will keep the mark", state.path)
    else:
        r = state.restored
        logger.info(
            "state file %s: high-water mark step %d, last quorum %d of %d members",
            state.path,
            r.high_water_step,
            r.quorum_id,
            len(r.members),
        )
    if allow_fresh_start:
        logger.warning("--allow-fresh-start: groups all at step 0 may start the job over")
