"""The child process of ProcessGroupBabyGloo: gloo where it can be killed.

Run by path (`python -P _baby_child.py FD`), never as `-m`: it imports
torch and the standard library only, not the torchft_like package, so it
starts in the time of `import torch` and can wait as a warm standby. FD is
its end of a Unix socket to the parent (multiprocessing.connection framing):

    parent -> child   ("configure", host, port, prefix, rank, world_size, timeout_s, hostname,
                       backend ("gloo" | "nccl"), CUDA device index | None)
                      ("map", buf_id, nbytes) followed by the buffer's memfd (SCM_RIGHTS)
                      ("map_cuda", buf_id, CUDA tensor)       (by CUDA IPC, nccl only)
                      ("op", op_id, [(backend method, args), ...], ready CUDA event | None)
    child -> parent   None | "error text"          (the answer to configure)
                      ("done", op_id, None | "error text", done CUDA event | None)

Tensors travel as ("T", buf_id, dtype, shape): a view of a shared buffer
the parent staged them in ("C": of a CUDA buffer); option objects as
("O", class name, fields). With NCCL the child's stream waits for the
parent's `ready` event before the collectives, and it answers as soon as
they are queued, with an event that completes after them: no host waits.
The child exits when the parent's end closes (the parent died or killed
it), without waiting for a collective stuck in gloo.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist


def _backend(msg: tuple[Any, ...]) -> Any:
    _, host, port, prefix, rank, world_size, timeout_s, hostname, kind, device = msg
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    prefixed = dist.PrefixStore(prefix, store)
    if kind == "nccl":
        import torch.multiprocessing  # noqa: F401 (CUDA IPC pickling of events)

        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        backend.eager_connect_single_device(torch.device("cuda", device))
        return backend
    if hostname is None:
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def _decode(x: Any, buffers: dict[int, torch.Tensor], cuda: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(i, buffers, cuda) for i in x]
    if isinstance(x, tuple) and x and x[0] in ("T", "C"):
        kind, buf_id, dtype_name, shape = x
        if kind == "C":
            buffers = cuda
        dtype = getattr(torch, dtype_name)
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return buffers[buf_id][:nbytes].view(dtype).view(shape)
    if isinstance(x, tuple) and x and x[0] == "O":
        _, name, fields = x
        opts = getattr(c10d, name)()
        for field, value in fields.items():
            if field == "reduceOp":
                value = dist.ReduceOp.RedOpType(value)
            setattr(opts, field, value)
        return opts
    return x


class _Replies:
    """Sends each op's result once all its works are done (any thread)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, op_id: int, error: str | None, done: Any = None) -> None:
        with self._lock:
            try:
                self._conn.send(("done", op_id, error, done))
            except OSError:
                os._exit(0)  # the parent is gone

    def when_done(self, op_id: int, works: list[Any]) -> None:
        if not works:
            self.send(op_id, None)
            return
        remaining = [len(works)]
        failed: list[str] = []
        lock = threading.Lock()

        def one_done(error: str | None) -> None:
            with lock:
                if error is not None and not failed:
                    failed.append(error)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.send(op_id, failed[0] if failed else None)

        def settled(fut: torch.futures.Future[Any]) -> None:
            try:
                fut.value()
            except Exception as e:
                one_done(str(e))
            else:
                one_done(None)

        def wait(work: Any) -> None:  # gloo's send/recv work has no future
            try:
                work.wait()
            except Exception as e:
                one_done(str(e))
            else:
                one_done(None)

        for work in works:
            try:
                fut = work.get_future()
            except RuntimeError:
                threading.Thread(
                    target=wait, args=(work,), name="torchft_baby_p2p", daemon=True
                ).start()
            else:
                fut.add_done_callback(settled)


def _queued(works: list[Any]) -> Any:
    """An event (shareable with the parent) that completes after `works`,
    recorded without waiting for them: the stream waits, the host does not."""
    for work in works:
        work.wait()  # NCCL: the current stream waits for the collective
    done = torch.cuda.Event(interprocess=True)
    done.record()
    return done


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        configure = conn.recv()
        backend = _backend(configure)
    except (EOFError, OSError):
        os._exit(0)
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")
        os._exit(1)
    conn.send(None)
    replies = _Replies(conn)
    buffers: dict[int, torch.Tensor] = {}
    cuda: dict[int, torch.Tensor] = {}
    nccl = configure[8] == "nccl"
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "map":
            _, buf_id, nbytes = msg
            fd = recv_handle(conn)
            buffers[buf_id] = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8
            )
            os.close(fd)
        elif msg[0] == "map_cuda":
            cuda[msg[1]] = msg[2]
        elif msg[0] == "unmap":
            buffers.pop(msg[1], None)
        elif msg[0] == "op":
            _, op_id, calls, ready = msg
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            works = []
            try:
                for method, args in calls:  # in order: gloo matches them by order
                    works.append(getattr(backend, method)(*_decode(args, buffers, cuda)))
            except Exception as e:
                replies.send(op_id, f"{type(e).__name__}: {e}")
                continue
            if nccl:
                replies.send(op_id, None, _queued(works))
            else:
                replies.when_done(op_id, works)


if __name__ == "__main__":
    main()
