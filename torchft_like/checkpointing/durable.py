"""Durable checkpoints: periodic asynchronous torch.distributed.checkpoint
(DCP) saves of the whole healed state, and the resume after a whole-job
restart.

Healing needs no disk; this is for when every group dies at once (power cut,
preemption of the whole job). What is saved is what healing copies: the
user state, the Manager's progress and the data position (every registered
state dict). One writer per piece of state across the job: only the replica
group with participating rank 0 of the step writes, each of its group ranks
its own part, since ranks of a group may hold different state.

CUDA state: each tensor's device is saved with it, and a restore puts it
back on the GPU (this rank's own, see `staging.target_device`) where it
was saved from a GPU, on the CPU otherwise, so a restored optimizer state
is on the device its optimizer steps on. Saving copies CUDA tensors into
pinned host memory without blocking, then waits once per device: the
training thread pays one device round trip, not one per tensor.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchft_like.checkpointing import durable_layout as layout
from torchft_like.checkpointing import staging

logger = logging.getLogger(__name__)


class _Checkpointed(Protocol):
    """What the checkpointer needs of the Manager."""

    def current_step(self) -> int: ...

    def participating_rank(self) -> int | None: ...

    def full_state_dict(self) -> dict[str, Any]: ...

    def load_full_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class _Ref:
    """Stands for the tensor saved under key `t{index}`, taken from `device`
    (checkpoints written before devices were recorded read as "cpu")."""

    index: int
    device: str = "cpu"


def _split(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The structure of `obj` with each tensor replaced by a _Ref, tensors
    copied to CPU into `tensors`. DCP alone would turn integer dict keys
    (an optimizer's per-parameter state) into strings; the structure, saved
    pickled as one item, keeps every key and type as it was. CUDA tensors
    are copied into pinned memory without blocking; the copies have all
    finished when this returns."""
    devices: set[torch.device] = set()
    structure = _split_into(obj, tensors, devices)
    for device in devices:
        with staging.on_device(device):
            torch.cuda.current_stream(device).synchronize()
    return structure


def _split_into(obj: Any, tensors: dict[str, torch.Tensor], devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensor = obj.detach()
        if tensor.is_cuda and type(tensor) is torch.Tensor:  # a DTensor keeps the plain copy
            with staging.on_device(tensor.device):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
            tensors[key] = host
            return _Ref(len(tensors) - 1, str(tensor.device))
        tensors[key] = tensor.to("cpu", copy=True)
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _split_into(v, tensors, devices) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_split_into(v, tensors, devices) for v in obj)
    return obj


def _join(obj: Any, tensors: dict[str, Any], device: torch.device | None = None) -> Any:
    if isinstance(obj, _Ref):
        tensor = tensors[f"t{obj.index}"]
        target = staging.target_device(obj.device, device)
        if target.type == "cpu":
            return tensor
        with staging.on_device(target):
            return tensor.to(target)
    if isinstance(obj, dict):
        return {k: _join(v, tensors, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_join(v, tensors, device) for v in obj)
    return obj


def save_state(state: dict[str, Any], path: Path) -> None:
    """Writes `state` with DCP into `path` (a new directory), synchronously."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _split(state, tensors)
    _write({"structure": pickle.dumps(structure), **tensors}, path)


def _write(flat: dict[str, Any], path: Path) -> None:
    # Our ranks have no default process group: each writes on its own.
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def load_state(path: Path, device: torch.device | None = None) -> dict[str, Any]:
    """Reads a state written by `save_state`: tensors saved from a GPU onto
    `device` (None: this process's GPU; the CPU without CUDA), the others
    on the CPU."""
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    template: dict[str, Any] = {}
    for key, item in meta.items():
        if isinstance(item, TensorStorageMetadata):
            template[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            template[key] = None
    dcp.load(template, storage_reader=reader, no_dist=True)
    # Our own files: the structure is the state's own pickled skeleton (ints,
    # strings, lists), as trusted as the tensors DCP unpickles beside it.
    result: dict[str, Any] = _join(pickle.loads(template["structure"]), template, device)
    return result


class DurableCheckpointer:
    """Saves the Manager's whole state every `every_steps` committed steps,
    in the background, and resumes from the newest complete checkpoint.

    Call `maybe_save()` after each `optimizer.step()`, `load_newest()` once
    before the loop, and `close()` at the end. The state is copied to CPU in
    the calling thread (the optimizer may change it next step); DCP writes it
    in a background thread into a temporary directory, writes the COMPLETE
    marker and renames it into place, then removes all but the newest `keep`
    checkpoints of this rank.

    Args:
        manager: the Manager whose state (every registered state dict and its
            own progress) is saved.
        directory: where checkpoints live; shared by every group (one disk or
            a shared file system), so a restarted job finds them.
        every_steps: save at committed steps that are multiples of this.
        keep: complete checkpoints kept per rank (at least 1).
        group_rank, group_world_size: this rank and its group's size.
        device: where `load_newest` puts tensors saved from a GPU (the
            device this rank's model lives on); None: the current CUDA
            device when CUDA is initialized in the thread building the
            checkpointer, else cuda:(LOCAL_RANK % GPUs); the CPU without CUDA.
    """

    def __init__(
        self,
        manager: _Checkpointed,
        directory: str | os.PathLike[str],
        every_steps: int,
        keep: int = 2,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps ({every_steps}) must be at least 1")
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be at least 1: the newest checkpoint stays")
        self._manager = manager
        self._dir = Path(directory)
        self._every = every_steps
        self._keep = keep
        self._rank = group_rank if group_rank is not None else int(os.environ.get("RANK", 0))
        self._world = (
            group_world_size
            if group_world_size is not None
            else int(os.environ.get("WORLD_SIZE", 1))
        )
        self._device = staging.resolve_device(device)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None
        self.stage_s = 0.0
        """Seconds the training thread spent copying state in the last save."""

    # ---- resume --------------------------------------------------------------

    def _listing(self) -> dict[int, set[int]]:
        steps: dict[int, set[int]] = {}
        for entry in self._dir.iterdir():
            step = layout.parse_step(entry.name)
            if step is None or not entry.is_dir():
                continue
            parts = {p.name: os.listdir(p) for p in entry.iterdir() if p.is_dir()}
            steps[step] = layout.complete_ranks(parts)
        return steps

    def newest_step(self) -> int | None:
        """The newest step whose every rank part is complete, or None."""
        return layout.newest_complete(self._listing(), self._world)

    def load_newest(self) -> int | None:
        """Loads this rank's part of the newest complete checkpoint into the
        Manager (user state, step, data position); returns its step, or None
        when there is none (a fresh start)."""
        step = self.newest_step()
        if step is None:
            logger.info("no complete checkpoint in %s: starting fresh", self._dir)
            return None
        path = self._dir / layout.step_dir(step) / layout.rank_dir(self._rank)
        self._manager.load_full_state_dict(load_state(path, self._device))
        logger.info("resumed from %s at step %d", path, step)
        return step

    # ---- save ----------------------------------------------------------------

    def maybe_save(self) -> bool:
        """Starts a save when the step just committed is due and this group
        writes; True if it started one. Waits for a previous save still
        writing, and raises its error."""
        step = self._manager.current_step()
        if step == 0 or step % self._every or step == self.last_saved_step:
            return False
        if self._manager.participating_rank() != 0:
            return False
        self.wait()
        start = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        structure = _split(self._manager.full_state_dict(), tensors)
        self.stage_s = time.perf_counter() - start
        self.last_saved_step = step
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(step, {"structure": pickle.dumps(structure), **tensors}),
            name="torchft_checkpoint",
            daemon=True,
        )
        self._thread.start()
        return True

    def _write_in_background(self, step: int, flat: dict[str, Any]) -> None:
        try:
            tmp = self._dir / f"{layout.TMP_PREFIX}{layout.step_dir(step)}-r{self._rank}-"
            tmp = tmp.with_name(tmp.name + uuid.uuid4().hex[:8])
            start = time.perf_counter()
            _write(flat, tmp)
            (tmp / layout.COMPLETE).write_text(f"step {step} rank {self._rank}\n")
            final = self._dir / layout.step_dir(step) / layout.rank_dir(self._rank)
            final.parent.mkdir(exist_ok=True)
            if final.exists():  # another writer of this step got there first
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
            logger.info(
                "checkpoint of step %d written in %.2f s", step, time.perf_counter() - start
            )
            self._prune()
        except BaseException as e:  # surfaced by the next wait()
            logger.exception("checkpoint of step %d failed: %s", step, e)
            self._error = e

    def _prune(self) -> None:
        for step in layout.steps_to_prune(self._listing(), self._rank, self._keep):
            part = self._dir / layout.step_dir(step) / layout.rank_dir(self._rank)
            shutil.rmtree(part, ignore_errors=True)
            try:
                part.parent.rmdir()  # the last rank's removal takes the step
            except OSError:
                pass
        # Leftovers of a crash mid-write: no write takes an hour.
        mine = f"-r{self._rank}-"
        for entry in self._dir.glob(layout.TMP_PREFIX + "*"):
            try:
                stale = mine in entry.name and time.time() - entry.stat().st_mtime > 3600
            except OSError:  # removed meanwhile
                continue
            if stale:
                shutil.rmtree(entry, ignore_errors=True)

    def wait(self) -> None:
        """Blocks until the save in flight is written; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {error}") from error

    def close(self) -> None:
        """Waits for the save in flight."""
        self.wait()
