"""The status page of a real lighthouse (history, heals, rates, the kill button)
and the Prometheus metrics of real Managers, scraped over HTTP."""

from __future__ import annotations

import html
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from html.parser import HTMLParser

import pytest

from lighthouse import LighthouseClient, LighthouseServer
from tests.procs import wait_for_line
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)
S = "dashboard-test-secret-0123456789"


class Replicas:
    """Replica ids with a client each; `round` makes them ask for one quorum together."""

    def __init__(self, server: LighthouseServer) -> None:
        self.server = server
        self.clients: dict[str, LighthouseClient] = {}

    def client(self, rid: str) -> LighthouseClient:
        if rid not in self.clients:
            self.clients[rid] = LighthouseClient(self.server.address(), connect_timeout=T)
        return self.clients[rid]

    def round(self, steps: dict[str, int], data: dict[str, dict] | None = None) -> None:
        """Asks in the order given, each once the one before waits at the
        lighthouse: a fast quorum (every previous member asked) leaves out
        who has not asked yet, so a newcomer must ask first."""
        for rid in steps:  # heard from, so a quorum waits for every one of them
            self.client(rid).heartbeat(rid)

        def ask(rid: str):
            address = f"http://{rid.split(':')[0]}:1"
            extra = (data or {}).get(rid)
            return self.client(rid).quorum(rid, T, address=address, step=steps[rid], data=extra)

        def waits(rid: str, asked: Future) -> bool:
            replicas = self.server.status()["replicas"]
            return asked.done() or any(r["waiting"] for r in replicas if r["replica_id"] == rid)

        with ThreadPoolExecutor(len(steps)) as pool:
            futures = []
            for rid in steps:
                futures.append(pool.submit(ask, rid))
                wait_until(partial(waits, rid, futures[-1]), 10, f"{rid} to wait at the lighthouse")
            quorums = [f.result() for f in futures]
        assert len({q.quorum_id for q in quorums}) == 1

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@pytest.fixture
def lighthouse():
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000, http_bind="127.0.0.1:0"
    )
    replicas = Replicas(server)
    yield server, replicas
    replicas.close()
    server.shutdown()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_the_page_shows_who_joined_and_left_why_the_heals_and_the_progress(lighthouse):
    server, replicas = lighthouse
    for step in range(4):
        replicas.round({"a:1": step, "b:1": step})
    replicas.client("b:1").leave("b:1")
    replicas.round({"a:1": 4})
    replicas.round({"b:2": 0, "a:1": 5})  # b restarted: it heals from a
    heal = {"heal": {"step": 5, "seconds": 0.25, "bytes": 4096, "sources": ["http://a:1"]}}
    replicas.round({"a:1": 6, "b:2": 6}, data={"b:2": heal})

    status = json.loads(get(server.http_address() + "/status.json"))
    history = status["history"]
    assert [len(e["members"]) for e in history] == [2, 1, 2]
    restart, leave, first = history
    assert {c["replica_id"]: c["why"] for c in first["joined"]} == {"a:1": "new", "b:1": "new"}
    assert leave["left"] == [{"replica_id": "b:1", "why": "left on purpose (Leave)"}]
    assert restart["joined"] == [
        {"replica_id": "b:2", "why": "new process of group 'b' (restarted)"}
    ]
    (healed,) = status["heals"]
    assert (healed["replica_id"], healed["sources"], healed["step"]) == ("b:2", ["a:1"], 5)
    assert (healed["seconds"], healed["bytes"]) == (0.25, 4096)
    assert healed["quorum_id"] == restart["quorum_id"]
    groups = {g["name"]: g for g in status["groups"]}
    assert groups["a"]["committed"] == 6 and groups["b"]["committed"] == 3
    assert status["goodput"]["value"] == pytest.approx(9 / 12)
    assert all(r["step_rate"] > 0 for r in status["replicas"])

    metrics = get(server.http_address() + "/metrics")
    assert 'torchft_lighthouse_goodput{job="default"} 0.75' in metrics
    page = get(server.http_address() + "/")
    for text in ("left on purpose (Leave)", "(restarted)", "4.1 KB", "0.25 s", "75.0%",
                 '<polyline class="series" data-group="a"'):  # fmt: skip
        assert text in page


def post_kill(http: str, replica_id: str, secret: str | None) -> tuple[int, str]:
    form = {"replica_id": replica_id, **({"secret": secret} if secret is not None else {})}
    request = urllib.request.Request(
        http + "/kill", data=urllib.parse.urlencode(form).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, html.unescape(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, html.unescape(e.read().decode())


@pytest.mark.parametrize(
    "secret, kill_button, typed, code, text",
    [
        (None, True, "anything", 403, "this job has no shared secret"),
        (None, False, "", 403, "TORCHFT_SECRET_FILE"),
        (S, False, S, 403, "start the lighthouse with --kill-button"),
        (S, True, None, 403, "not the job's secret"),
        (S, True, S[:-1] + "x", 403, "not the job's secret"),
        (S, True, S, 404, "no replica 'nobody:1'"),
    ],
)
def test_the_kill_button_refuses_without_the_flag_the_secret_or_a_known_replica(
    secret, kill_button, typed, code, text
):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind="127.0.0.1:0",
                              secret=secret, kill_button=kill_button)  # fmt: skip
    try:
        got, body = post_kill(server.http_address(), "nobody:1", typed)
        assert got == code and text in body
        # GET never kills; it is no endpoint at all.
        with pytest.raises(urllib.error.HTTPError) as e:
            get(server.http_address() + "/kill?replica_id=nobody:1&secret=" + (typed or ""))
        assert e.value.code == 404
    finally:
        server.shutdown()


GROUP = """
import sys, time
from datetime import timedelta
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.client import LocalManagerClient
from torchft_like.manager.group.server import ManagerServer
server = ManagerServer(replica_id="victim:1", lighthouse_addr=sys.argv[1], hostname="127.0.0.1",
                       bind="127.0.0.1:0", store_addr="127.0.0.1:1", world_size=1,
                       secret=sys.argv[2])
LocalManagerClient(server).quorum(QuorumRequest(group_rank=0, step=0), timedelta(seconds=20))
print("joined", flush=True)
time.sleep(60)  # until the kill button ends it
"""


def test_the_kill_button_with_the_secret_ends_a_real_group(children):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind="127.0.0.1:0",
                              secret=S, kill_button=True)  # fmt: skip
    try:
        proc = children.spawn([sys.executable, "-c", GROUP, server.address(), S])
        wait_for_line(proc, r"^joined", timeout=30)
        page = get(server.http_address() + "/")
        assert 'name="replica_id" value="victim:1"' in page
        code, body = post_kill(server.http_address(), "victim:1", S)
        assert code == 200 and "Kill sent to victim:1" in body
        assert proc.wait(timeout=10) == 1
    finally:
        server.shutdown()


# ---- the Managers' metrics -------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample in a text exposition."""
    samples = {}
    for line in get(url).splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def value(samples: dict[str, float], name: str, group: str) -> float:
    pattern = re.compile(rf'^{name}\{{.*replica_group="{group}".*\}}$')
    found = [v for k, v in samples.items() if pattern.match(k)]
    assert len(found) == 1, f"{name} of {group}: {found} in {sorted(samples)[:5]}..."
    return found[0]


@pytest.fixture(scope="module")
def demo_job():
    """Two real groups; group 1 restarts and heals once. Shared with the DOM test."""
    from tools.demo_job import DemoJob

    job = DemoJob(num_groups=2, step_sleep_s=0.02)
    try:
        job.wait_steps(5)
        job.restart_group(1)
        job.wait_steps(12)
        # The restart heals at whatever step the other reached meanwhile (on a
        # loaded machine, well past 5): wait for 3 commits of its own too.
        metrics = job.groups[1].manager.metrics_address()
        wait_until(
            lambda: value(scrape(metrics), "torchft_manager_committed_steps_total", "group1") >= 3,
            30,
            "the restarted group to commit 3 steps",
        )
        yield job
    finally:
        job.stop()


@pytest.mark.timeout(90)
def test_every_manager_serves_its_metrics_and_the_page_gets_its_heal(demo_job):
    healed = demo_job.groups[1].manager
    address = healed.metrics_address()
    assert address is not None and address.startswith("http://127.0.0.1:")
    samples = scrape(address)
    summary = {k: v for k, v in samples.items() if "_bucket" not in k}
    print("group1's metrics:", summary)  # shown when an assertion below fails
    # Once on restart; again only if a step failed to commit on a loaded machine.
    heals = value(samples, "torchft_manager_heals_total", "group1")
    heal_bytes = value(samples, "torchft_manager_heal_bytes_total", "group1")
    assert heals >= 1 and heal_bytes / heals > 10_000 and heal_bytes % heals == 0
    assert value(samples, "torchft_manager_heal_seconds_count", "group1") == heals
    # Restarted near step 5, healed, then trained on to step 12 at least.
    assert value(samples, "torchft_manager_committed_steps_total", "group1") >= 3
    assert value(samples, "torchft_manager_step", "group1") >= 12
    assert value(samples, "torchft_manager_step_seconds_count", "group1") >= 3
    assert value(samples, "torchft_manager_quorum_seconds_count", "group1") >= 3
    assert value(samples, "torchft_manager_commit_failures_total", "group1") >= 0
    assert value(samples, "torchft_manager_participants", "group1") in (1, 2)
    assert value(samples, "torchft_manager_quorum_id", "group1") > 0
    other = scrape(demo_job.groups[0].manager.metrics_address())
    assert value(other, "torchft_manager_heals_total", "group0") == 0

    def heals_reported() -> list[dict]:
        return [h for h in demo_job.lighthouse.status()["heals"] if h["bytes"]]

    # The heal's numbers reached the lighthouse through the next quorum request.
    wait_until(heals_reported, 10, "the heal's bytes at the lighthouse")
    reported = heals_reported()
    assert reported[0]["replica_id"].startswith("group1:")
    assert reported[0]["bytes"] == heal_bytes / heals


# ---- in a real browser -----------------------------------------------------------


class Dom(HTMLParser):
    """The rendered page as Chromium serialized it: each table's rows (cell
    texts) by the table's class, and the chart's lines."""

    VOID = {"meta", "br", "input", "link", "img", "hr"}
    """HTML elements without an end tag (Chromium closes SVG ones)."""

    def __init__(self, markup: str) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str | None]]] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.chart_lines: list[str] = []
        self.ids: dict[str, str] = {}
        self._id_text: str | None = None
        self.feed(markup)

    def _inside(self, tag: str) -> dict[str, str | None] | None:
        return next((a for t, a in reversed(self.stack) if t == tag), None)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and (table := self._inside("table")) is not None:
            self.tables.setdefault(table.get("class") or "", []).append([])
        if tag == "td" and (table := self._inside("table")) is not None:
            self.tables[table.get("class") or ""][-1].append("")
        if tag == "polyline" and (svg := self._inside("svg")) and svg.get("id") == "steps-chart":
            self.chart_lines.append(a.get("data-group") or "")
        if a.get("id"):
            self._id_text = a["id"]
            self.ids[a["id"] or ""] = ""
        if tag not in self.VOID:
            self.stack.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            if self.stack.pop()[0] == tag:
                break
        if self._id_text and not any(a.get("id") == self._id_text for _, a in self.stack):
            self._id_text = None

    def handle_data(self, data: str) -> None:
        if self._inside("td") is not None and (table := self._inside("table")) is not None:
            self.tables[table.get("class") or ""][-1][-1] += data
        if self._id_text:
            self.ids[self._id_text] += data


@pytest.mark.timeout(90)
def test_a_headless_browser_renders_history_chart_and_replica_rows(demo_job):
    from tools.chromium import INSTALL, dump_dom, find_chromium

    if find_chromium() is None:
        pytest.skip(f"no Chromium to render the page in; install it with `{INSTALL}`")
    dom = Dom(dump_dom(demo_job.page_url(), timeout_s=60))
    replicas = [row for row in dom.tables["replicas"] if row]
    assert sorted(row[0].split(":")[0] for row in replicas) == ["group0", "group1"]
    assert all(row[4] == "healthy" and row[5] == "yes" for row in replicas)
    history = [row for row in dom.tables["history"] if row]
    assert len(history) >= 3  # group0 new, group1 new, group1 left, group1 restarted
    joined_left = " ".join(row[3] for row in history)
    assert "new process of group 'group1' (restarted)" in joined_left
    heals = [row for row in dom.tables["heals"] if row]
    assert any(row[1].startswith("group1:") and row[5].endswith("KB") for row in heals)
    assert sorted(dom.chart_lines) == ["group0", "group1"]
    assert dom.ids["goodput"].endswith("%")
    assert dom.ids["quorum-id"].isdigit()


def test_the_lighthouse_cli_refuses_a_kill_button_without_a_secret(monkeypatch, capsys):
    from lighthouse import cli

    for name in ("TORCHFT_SECRET", "TORCHFT_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    argv = ["--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "", "--kill-button"]
    assert cli.main(argv) == 2
    assert (
        "--kill-button needs the job's secret: set TORCHFT_SECRET_FILE" in capsys.readouterr().err
    )
