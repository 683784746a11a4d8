"""A small live job in this process, for the status page's screenshot and DOM test.

A real lighthouse (with its status page) and replica groups of one rank each,
as threads: each a real Manager, gloo process group and HTTP checkpoint
transport training a tiny MLP. `restart_group` stops a group and starts a
new process of it, which heals from the others: the page then shows a
departure, a rejoin and a heal with its duration and bytes.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from torchft_like import Manager, Optimizer, ProcessGroupGloo

TIMEOUT = timedelta(seconds=10)


class _Group:
    """One replica group of one rank, training in a thread until stopped."""

    def __init__(
        self, index: int, lighthouse_addr: str, step_sleep_s: float, secret: str | None
    ) -> None:
        self.index = index
        self._secret = secret
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.manager: Manager | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(lighthouse_addr, step_sleep_s), daemon=True,
            name=f"demo-group{index}",
        )  # fmt: skip
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError(f"demo group {index} did not start within 30 s")
        if self.error is not None:
            raise RuntimeError(f"demo group {index} failed to start") from self.error

    def _run(self, lighthouse_addr: str, step_sleep_s: float) -> None:
        try:
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            torch.manual_seed(self.index)
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
            inner = torch.optim.AdamW(model.parameters(), lr=0.01)
            manager = Manager(
                pg=ProcessGroupGloo(timeout=TIMEOUT),
                load_state_dict=lambda sd: (
                    model.load_state_dict(sd["m"]),
                    inner.load_state_dict(sd["o"]),
                ),
                state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
                min_replica_size=1,
                timeout=TIMEOUT,
                quorum_timeout=timedelta(seconds=30),
                connect_timeout=TIMEOUT,
                rank=0,
                world_size=1,
                store_addr="127.0.0.1",
                store_port=store.port,
                lighthouse_addr=lighthouse_addr,
                replica_id=f"group{self.index}",
                hostname="127.0.0.1",
                exit_with_parent=False,
                metrics_port=0,
                secret=self._secret,
            )
            self.manager = manager
        except BaseException as e:
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        optimizer = Optimizer(manager, inner)
        data = torch.Generator().manual_seed(7)
        try:
            while not self.stop.is_set():
                optimizer.zero_grad()
                model(torch.randn(16, 32, generator=data)).sum().backward()
                for p in model.parameters():
                    manager.allreduce(p.grad)
                optimizer.step()
                time.sleep(step_sleep_s)
        except BaseException as e:
            self.error = e
        finally:
            manager.shutdown()

    def shutdown(self) -> None:
        self.stop.set()
        self._thread.join(30)


class DemoJob:
    """A lighthouse on 127.0.0.1 (port 0, status page on port 0) and
    `num_groups` replica groups training. `stop()` ends everything."""

    def __init__(
        self,
        num_groups: int = 2,
        step_sleep_s: float = 0.05,
        secret: str | None = None,
        kill_button: bool = False,
    ) -> None:
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=500,
            heartbeat_timeout_ms=1000,
            http_bind="127.0.0.1:0",
            secret=secret,
            kill_button=kill_button,
        )
        self._step_sleep_s = step_sleep_s
        self._secret = secret
        self.groups: list[_Group] = []
        try:
            for i in range(num_groups):
                self.groups.append(self._start(i))
        except BaseException:
            self.stop()
            raise

    def page_url(self) -> str:
        address = self.lighthouse.http_address()
        assert address is not None
        return address + "/"

    def wait_steps(self, steps: int, timeout_s: float = 30) -> None:
        """Waits until every group's lighthouse-visible step reaches `steps`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.lighthouse.status()
            live = [g for g in status["groups"] if time.time() - g["last_seen"] < 2]
            if len(live) >= len(self.groups) and all(g["step"] >= steps for g in live):
                return
            for group in self.groups:
                if group.error is not None:
                    raise RuntimeError(f"demo group {group.index} failed") from group.error
            time.sleep(0.05)
        raise TimeoutError(f"the demo groups did not reach step {steps} within {timeout_s} s")

    def restart_group(self, index: int) -> None:
        """Stops group `index` and starts a new process of it, which heals."""
        self.groups[index].shutdown()
        self.groups[index] = self._start(index)

    def _start(self, index: int) -> _Group:
        return _Group(index, self.lighthouse.address(), self._step_sleep_s, self._secret)

    def stop(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.lighthouse.shutdown()
