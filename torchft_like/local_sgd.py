"""LocalSGD and (streaming) DiLoCo: replica groups train alone for a number of
inner steps and meet at an outer sync, the unit of commit.

Both wrap the inner optimizer with step hooks inside a context manager, as
torchft does:

    with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=100):
        for batch in data:
            inner_opt.zero_grad(); loss(model, batch).backward(); inner_opt.step()

Fault tolerance: only a sync talks to the other groups (quorum, allreduce,
commit vote), so a group that dies between syncs loses only its own inner
steps. A sync that fails to commit is applied nowhere: DiLoCo puts back the
parameters of the last committed sync (kept in a backup), LocalSGD keeps its
local ones. The outer state (the backup, the outer optimizer, and the
Manager's step, which picks the fragment to sync) is registered with the
Manager, so a restarted group copies it from a live one at its first sync
(where, the quorum being synchronous, it counts with the copy: its source's
pseudo-gradient weighs twice that once, as in torchft). DiLoCo needs
`use_async_quorum=False`: the heal must land before the pseudo-gradient is
taken.

CUDA streams: like torchft, each DiLoCo fragment on CUDA gets a side stream
that waits for the pseudo-gradient (taken on the training stream) and carries
the allreduce and bucket copies. Better: the training stream, not the host,
waits for the averaging's end (but for a sync serving a healing peer); the
backup goes to the device non_blocking from pinned memory, and a host read or
write of the backup first waits for the stream's last use of it. LocalSGD
averages on the training stream, as torchft's. None of it runs on CPU.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from torchft_like._cuda_streams import mark, on, side_stream

logger = logging.getLogger(__name__)

USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"
"""Set to "True" to send DiLoCo's pseudo-gradients in buckets (torchft's switch)."""


def _is_dtensor(t: Any) -> bool:
    """Without importing torch.distributed.tensor (slow): no DTensor exists
    unless something imported it already."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of `t`, of its local shard if it is a DTensor, with no grad."""
    local = t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]
    copy = local.detach().clone()
    copy.grad = None
    return copy


def _copy_into_param(param: torch.Tensor, local: torch.Tensor) -> None:
    """Writes a local tensor into a parameter, as its shard if it is a DTensor."""
    with torch.no_grad():
        if _is_dtensor(param):
            param.to_local().copy_(local)  # type: ignore[attr-defined]
        else:
            param.data.copy_(local)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


_Hooks = TypeVar("_Hooks", bound="_InnerStepHooks")


class _InnerStepHooks:
    """The optimizer hooks both algorithms install for the `with` block."""

    _manager: Any
    _local_optimizer: optim.Optimizer

    def __enter__(self: _Hooks) -> _Hooks:
        self._install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._remove()

    def _install(self) -> None:
        self._hooks: list[RemovableHandle] = [
            self._local_optimizer.register_step_pre_hook(self._step_pre_hook),
            self._local_optimizer.register_step_post_hook(self._step_post_hook),
        ]

    def _remove(self) -> None:
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        self._hooks = []

    def _step_pre_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        # A healing peer may be reading our parameters: hold it off while
        # the optimizer writes them.
        self._manager.disallow_state_dict_read()

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        raise NotImplementedError  # each algorithm's own


class LocalSGD(_InnerStepHooks):
    """Averages the model's parameters over the replica groups every
    `sync_every` optimizer steps (https://arxiv.org/abs/1805.09767).

    The sync (after the `sync_every`-th `optimizer.step()` in the `with`
    block) starts a quorum, averages every parameter through the Manager and
    writes the average back only if the group commits; otherwise the local
    parameters stay and the next sync tries again. Each group keeps its own
    optimizer state.

    Args:
        manager: the Manager of this rank.
        model: the parameters to average.
        optimizer: the local optimizer; its step() is hooked.
        sync_every: optimizer steps between syncs (at least 1).
    """

    def __init__(
        self, manager: Any, model: nn.Module, optimizer: optim.Optimizer, sync_every: int
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every ({sync_every}) must be at least 1")
        self._manager = manager
        self._model = model
        self._local_optimizer = optimizer
        self._sync_every = sync_every
        self._local_step = 0
        self._hooks = []

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.allow_state_dict_read()
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Averages the parameters over the groups now; applied if committed."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        averaged = self._average()
        if self._manager.should_commit():
            for param, avg in zip(self._model.parameters(), averaged):
                _copy_into_param(param, avg)

    def _average(self) -> list[torch.Tensor]:
        copies = [extract_local_tensor(p) for p in self._model.parameters()]
        works = [self._manager.allreduce(c) for c in copies]
        for work in works:
            work.wait()
        return copies


class _StreamingDiLoCoFragment:
    """One fragment of the model: its backup of the global parameters, its
    pseudo-gradient in flight, and its outer step."""

    def __init__(
        self,
        manager: Any,
        model_fragment: nn.Module,
        fragment_id: int,
        fragment_sync_offset: int,
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer,
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if fragment_sync_offset > sync_every:
            raise ValueError(
                f"fragment_sync_offset ({fragment_sync_offset}) must be at most sync_every "
                f"({sync_every}): each fragment syncs once every sync_every steps"
            )
        self._fragment_id = fragment_id
        self._manager = manager
        self._model_fragment = model_fragment
        self._fragment_sync_offset = fragment_sync_offset
        self._local_optimizer = inner_optimizer
        self._outer_optimizer = outer_optimizer
        self._sync_every = sync_every
        self._fragment_sync_delay = fragment_sync_delay
        self._fragment_update_alpha = fragment_update_alpha
        self.should_quantize = should_quantize
        self.use_bucketization = (
            use_bucketization or os.environ.get(USE_BUCKETIZATION_ENV, "False") == "True"
        )
        self.bucket_cap_mb: float = 1024.0 if bucket_cap_mb is None else float(bucket_cap_mb)
        """Largest bucket of pseudo-gradients sent in one allreduce, in MiB."""

        self._grads: dict[str, torch.Tensor] = {}
        self._allreduce_work: list[Any] = []
        self._local_parameters: dict[str, torch.Tensor] = {}
        self.original_parameters: dict[str, torch.Tensor] = {}
        """The global parameters of the last committed sync (the backup)."""
        device = backup_device or torch.device("cpu")
        pin = pin_memory and device.type == "cpu" and torch.accelerator.is_available()
        for name, p in model_fragment.named_parameters():
            local = _local(p.data)
            backup = torch.empty(local.shape, dtype=local.dtype, device=device)
            self.original_parameters[name] = backup.pin_memory() if pin else backup
        self._stream: Any = side_stream(model_fragment)  # None unless on CUDA
        self._stop_event: Any = None  # on the side stream: the averaging is done
        self._backup_event: Any = None  # see _backup_used

    # ---- outer state ---------------------------------------------------------

    def register_state_dict_fn(self) -> None:
        """Lets a healing group copy this fragment's outer state (the backup
        and the outer optimizer) from a live one."""

        def load(state: dict[str, Any]) -> None:
            self._backup_settled()
            for name, value in state["original_parameters"].items():
                if name in self.original_parameters:
                    self.original_parameters[name].copy_(value)
            self._outer_optimizer.load_state_dict(state["outer_optimizer"])

        def save() -> dict[str, Any]:
            self._backup_settled()
            return {
                "original_parameters": {
                    name: extract_local_tensor(t) for name, t in self.original_parameters.items()
                },
                "outer_optimizer": self._outer_optimizer.state_dict(),
            }

        self._manager.register_state_dict_fn(
            f"StreamingDiLoCoFragment_{self._fragment_id}", load, save
        )

    def save_parameters(self) -> None:
        """Backs up the fragment's current parameters as the global ones."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                self.original_parameters[name].copy_(_local(p.data), non_blocking=True)
        self._backup_used()

    def _backup_used(self) -> None:
        """Marks the stream's last non_blocking copy from or into the backup."""
        if self._stream is not None:
            self._backup_event = mark(torch.cuda.current_stream(self._stream.device))

    def _backup_settled(self) -> None:
        """The host waits for those copies before it reads or writes a pinned
        backup itself (a heal's state dict, a load)."""
        event, self._backup_event = self._backup_event, None
        if event is not None:
            event.synchronize()

    def restore_parameters(self) -> None:
        """Puts the backed-up global parameters back into the fragment."""
        for name, p in self._model_fragment.named_parameters():
            _copy_into_param(p, self.original_parameters[name])

    def _save_local_parameters(self) -> None:
        self._local_parameters = {
            name: extract_local_tensor(p.data)
            for name, p in self._model_fragment.named_parameters()
        }

    def _clear_local_parameters(self) -> None:
        self._local_parameters = {}

    def _merge_parameters(self) -> None:
        """Moves the new global parameters `alpha` of the way back towards
        the local ones trained while the sync was in flight."""
        alpha = self._fragment_update_alpha
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                _local(p.data).lerp_(self._local_parameters[name], alpha)

    # ---- pseudo-gradients ----------------------------------------------------

    def _save_grads(self) -> None:
        """Pseudo-gradient = global parameters - local parameters (on the training stream)."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = _local(p.data)
                backup = self.original_parameters[name]
                # From a pinned backup the copy is queued, not waited for.
                self._grads[name] = backup.to(local.device, non_blocking=True) - local
        self._backup_used()

    def _set_grads(self) -> None:
        """Hands the averaged pseudo-gradients to the outer optimizer as grads."""
        for name, p in self._model_fragment.named_parameters():
            grad = self._grads.pop(name)
            if _is_dtensor(p):
                from torch.distributed.tensor import DTensor

                dt: Any = p
                p.grad = DTensor.from_local(
                    grad, dt.device_mesh, dt.placements, shape=p.shape, stride=p.stride()
                )
            else:
                p.grad = grad

    def _average_grads(self) -> None:
        if self.use_bucketization:
            self._allreduce_bucketized()
        else:
            self._allreduce_per_param()

    def _allreduce_per_param(self) -> None:
        for name, _ in self._model_fragment.named_parameters():
            self._allreduce_work.append(
                self._manager.allreduce(self._grads[name], should_quantize=self.should_quantize)
            )

    def _allreduce_bucketized(self) -> None:
        """Fewer, larger collectives: pseudo-gradients packed into flat
        buckets of at most `bucket_cap_mb` (a larger tensor goes alone)."""
        grads = list(self._grads.values())
        cap = max(1, int(self.bucket_cap_mb * 1024 * 1024))
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads + [None]:  # None flushes the last bucket
            if g is not None and (not bucket or size + g.numel() * g.element_size() <= cap):
                bucket.append(g)
                size += g.numel() * g.element_size()
                continue
            if bucket:
                self._allreduce_bucket(bucket)
            bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)

    def _allreduce_bucket(self, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = self._manager.allreduce(flat, should_quantize=self.should_quantize)

        def unpack(fut: torch.futures.Future[Any]) -> None:
            fut.wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

        # The copy back is itself the thing perform_sync waits on.
        self._allreduce_work.append(work.get_future().then(unpack))

    # ---- the sync --------------------------------------------------------------

    def prepare_sync(self) -> None:
        """Takes the pseudo-gradients now and starts averaging them; the
        inner steps go on while they travel (`fragment_sync_delay`)."""
        assert not self._allreduce_work, "a sync of this fragment is already in flight"
        self._save_grads()
        if self._stream is not None:  # it starts after the pseudo-gradients were taken
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with on(self._stream):
            self._average_grads()

    def _wait_averaged(self, host: bool = False) -> None:
        """Waits for the averaging in flight, which perform_sync still finishes.
        On CUDA the training stream waits for the side stream; `host`: the host too."""
        with on(self._stream):
            for work in self._allreduce_work:
                work.wait()
        if self._stream is not None:
            self._stop_event = mark(self._stream)
            torch.cuda.current_stream(self._stream.device).wait_event(self._stop_event)
            if host:
                self._stop_event.synchronize()

    def wait(self) -> None:
        """Waits for the averaging started by prepare_sync."""
        self._wait_averaged()
        self._allreduce_work = []

    def perform_sync(self) -> bool:
        """Finishes the sync: back to the global parameters, and if every
        group commits, one outer step with the averaged pseudo-gradient, a
        new backup, and the merge with the local parameters. Not committed:
        the fragment stays at its backup (the sync is applied nowhere).

        Returns:
            Whether the sync was committed.
        """
        assert self._allreduce_work, "perform_sync without prepare_sync"
        self.wait()
        if self._fragment_update_alpha > 0:
            self._save_local_parameters()
        self.restore_parameters()
        committed = self._manager.should_commit()
        if committed:
            self._set_grads()
            self._outer_optimizer.step()
            self.save_parameters()
            if self._fragment_update_alpha > 0:
                self._merge_parameters()
        self._grads = {}
        self._outer_optimizer.zero_grad()
        self._clear_local_parameters()
        return committed


class DiLoCo(_InnerStepHooks):
    """DiLoCo (https://arxiv.org/abs/2311.08105) and streaming DiLoCo
    (https://arxiv.org/abs/2501.18512), fault tolerant.

    Each group runs `sync_every` inner steps alone; then the pseudo-gradient
    (global parameters - local ones) is averaged over the groups and the
    outer optimizer (typically SGD with Nesterov momentum) steps the global
    parameters with it. Streaming: the model comes in fragments, synced in
    turn, one every `sync_every / len(model_fragments)` inner steps, so the
    traffic is spread out; a fragment's pseudo-gradient is sent
    `fragment_sync_delay` inner steps before it is needed, overlapping the
    communication with those steps.

    With the Manager's init_sync (its default), the first sync is at step 0
    and copies the primary group's whole state to the others, so their first
    `sync_every` inner steps count for nothing; start every group from the
    same weights with init_sync=False to keep them.

    A group that serves its state to a healing one waits for the averaging
    of that sync before its next inner step (the transfer reads the live
    parameters, and the healing group joins the averaging once it has
    them), so with fragment_sync_delay > 0 that one sync is not overlapped.

    Args:
        manager: the Manager of this rank, built with use_async_quorum=False.
        model_fragments: the modules synced in turn (one for plain DiLoCo).
        inner_optimizer: the local optimizer over the whole model; its
            step() is hooked.
        outer_optimizer: the outer optimizer, or one per fragment (use one
            per fragment when streaming: a shared one would also step the
            other fragments with whatever grads they hold).
        sync_every: inner steps between two syncs of the same fragment.
        backup_device: where the global parameters are kept (CPU by default).
        pin_memory: pin a CPU backup when an accelerator is present.
        use_bucketization, bucket_cap_mb: send the pseudo-gradients in
            flat buckets of at most this many MiB instead of one
            collective per parameter.
        should_quantize: send the pseudo-gradients as blockwise int8
            (torchft_like.collectives.allreduce_quantized), about a
            quarter of the bytes.
        fragment_sync_delay: inner steps between sending a fragment's
            pseudo-gradient and applying it (the paper's tau).
        fragment_update_alpha: after an outer step, how far to move back
            towards the local parameters (0: take the global ones, the
            paper's default; 1: keep the local ones).

    Raises:
        ValueError: a bad combination, said in the message.
    """

    def __init__(
        self,
        manager: Any,
        model_fragments: list[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | list[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        n = len(model_fragments)
        if n < 1:
            raise ValueError("model_fragments is empty: pass [model] for plain DiLoCo")
        if isinstance(outer_optimizer, list) and len(outer_optimizer) != n:
            raise ValueError(
                f"{len(outer_optimizer)} outer optimizers for {n} model fragments: "
                "pass one per fragment, or a single one"
            )
        if manager.config.use_async_quorum:
            raise ValueError(
                "DiLoCo needs a Manager built with use_async_quorum=False, so that a "
                "healing group has the live outer state before it takes its pseudo-gradient"
            )
        if sync_every < n:
            raise ValueError(
                f"sync_every ({sync_every}) is less than the {n} fragments: only one "
                "fragment syncs at a time"
            )
        if sync_every % n:
            raise ValueError(
                f"sync_every ({sync_every}) must be a multiple of the number of fragments ({n})"
            )
        self._sync_every = sync_every // n
        """Inner steps between two fragment syncs."""
        if not 0 <= fragment_sync_delay < self._sync_every:
            raise ValueError(
                f"fragment_sync_delay ({fragment_sync_delay}) must be at least 0 and less "
                f"than sync_every / fragments ({self._sync_every}): a fragment's sync must "
                "finish before the next one starts"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha ({fragment_update_alpha}) must be between 0 and 1"
            )
        self._manager = manager
        self._local_optimizer = inner_optimizer
        self._fragment_sync_delay = fragment_sync_delay
        self._local_step = 0
        self._hooks = []
        self._fragments = [
            _StreamingDiLoCoFragment(
                manager,
                fragment,
                i,
                math.floor(sync_every / n * (i + 1)),
                inner_optimizer,
                outer_optimizer[i] if isinstance(outer_optimizer, list) else outer_optimizer,
                sync_every,
                backup_device,
                pin_memory,
                use_bucketization,
                bucket_cap_mb,
                should_quantize,
                fragment_sync_delay,
                fragment_update_alpha,
            )
            for i, fragment in enumerate(model_fragments)
        ]
        self._save_parameters()
        for fragment in self._fragments:
            fragment.register_state_dict_fn()

    def _save_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.save_parameters()

    def _restore_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.restore_parameters()

    def _wait(self) -> None:
        for fragment in self._fragments:
            fragment.wait()

    def _current_fragment(self) -> int:
        """The fragment due, from the Manager's step (the number of committed
        syncs), which every group shares and a healing group copies: groups
        that picked by a count of their own could send different fragments
        and never match."""
        return self._manager.current_step() % len(self._fragments)

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.allow_state_dict_read()
        self._local_step += 1
        if self._local_step == self._sync_every - self._fragment_sync_delay:
            # The quorum (and a heal, which may change the Manager's step)
            # comes before the fragment is chosen.
            self._manager.start_quorum()
            fragment = self._current_fragment()
            logger.debug("sending fragment %d at inner step %d", fragment, self._local_step)
            self._fragments[fragment].prepare_sync()
            if self._fragment_sync_delay and self._manager.is_serving_state():
                # A healing peer is reading our live parameters, and joins
                # this averaging only once it has them all: wait for it here
                # rather than let the next inner steps write them under it.
                logger.info("serving a healing group: fragment %d's sync not overlapped", fragment)
                self._fragments[fragment]._wait_averaged(host=True)
        if self._local_step == self._sync_every:
            fragment = self._current_fragment()
            committed = self._fragments[fragment].perform_sync()
            logger.debug(
                "fragment %d sync %s at step %d",
                fragment,
                "committed" if committed else "not committed",
                self._manager.current_step(),
            )
            self._local_step = 0
