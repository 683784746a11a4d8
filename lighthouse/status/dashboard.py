"""The status page's HTML, rendered from the status dict (`/status.json` serves the same).

One plain page, no JavaScript library, nothing fetched from the network: it
reloads itself every 2 s (a three-line inline script, which waits while the
operator types a secret in a kill form; a meta refresh where scripts are off).
"""

from __future__ import annotations

import html
import time
from typing import Any

from lighthouse.rpc.auth import SECRET_FILE_ENV
from lighthouse.status.chart import render_chart

GOODPUT_DEFINITION = (
    "committed replica-steps / possible replica-steps, where possible = (the most "
    "replica groups ever in one quorum) x (steps the job advanced while this lighthouse "
    "watched). A group commits a step when its step grows by exactly one between two of "
    "its quorum requests; a heal's jump and a restart count as none. 100% means every "
    "group trained every step."
)

_STYLE = (
    "body{font-family:sans-serif;margin:1.5em;color:#222}td,th{padding:2px 10px;"
    "text-align:left;vertical-align:top}th{background:#eee}table{border-collapse:collapse;"
    "margin-bottom:1em}tr:nth-child(even){background:#f7f7f7}.bad{color:#b00}.ok{color:#070}"
    ".note{color:#555;font-size:90%}h2{margin-top:1.2em;font-size:120%}"
    "form{display:inline;margin:0;white-space:nowrap}input{width:9em}"
)

_RELOAD = (
    "<script>setInterval(function(){var b=document.activeElement;"
    "var typing=[].some.call(document.querySelectorAll('input[type=password]'),"
    "function(i){return i.value||i===b});if(!typing)location.reload()},2000)</script>"
    '<noscript><meta http-equiv="refresh" content="2"></noscript>'
)


def _age(now: float, then: float) -> str:
    s = max(now - then, 0.0)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + " UTC"


def _pct(value: float | None) -> str:
    return "n/a (no step yet)" if value is None else f"{100 * value:.1f}%"


def _bytes(n: int | None) -> str:
    if n is None:
        return "not reported"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return ""  # unreachable


def _table(cls: str, head: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="note {cls}-empty">{html.escape(empty)}</p>'
    out = [f'<table class="{cls}"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for cells in rows:
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(out) + "</table>"


def _kill_cell(replica_id: str, kill: dict[str, Any], job: str) -> str:
    if not kill["enabled"] or not kill["secret_set"]:
        return '<span class="note">off</span>'
    return (
        '<form method="post" action="/kill">'
        f'<input type="hidden" name="job" value="{html.escape(job)}">'
        f'<input type="hidden" name="replica_id" value="{html.escape(replica_id)}">'
        '<input type="password" name="secret" placeholder="job secret" required '
        'autocomplete="off"> <button type="submit">kill</button></form>'
    )


def _kill_note(kill: dict[str, Any]) -> str:
    if not kill["secret_set"]:
        return (
            "Kill: off, this job has no shared secret, so nothing can tell who asks (the "
            "ManagerServers refuse Kill without one too). Start the lighthouse and every "
            f"replica group with {SECRET_FILE_ENV} set to a file holding the secret (e.g. "
            "the output of <code>openssl rand -hex 32</code>), and the lighthouse with "
            "<code>--kill-button</code>."
        )
    if not kill["enabled"]:
        return "Kill: off; start the lighthouse with <code>--kill-button</code> to enable it."
    return (
        "Kill: type the job's secret in a replica's row; the lighthouse checks it and "
        "sends Kill to that group's ManagerServer, which ends the group's processes."
    )


def _jobs(jobs: list[dict[str, Any]], job: str, now: float) -> str:
    """The list of the lighthouse's jobs, each a link to its page; none
    while the lighthouse serves the default job alone."""
    if len(jobs) <= 1:
        return ""
    rows = []
    for j in jobs:
        name = html.escape(j["job"])
        link = f'<a href="/job/{name}">{name}</a>' + (" (this page)" if j["job"] == job else "")
        if j["protected"]:
            rows.append(
                [link, '<span class="note">its own secret: its page needs it</span>'] + [""] * 4
            )
            continue
        failure = j.get("last_failure")
        left = ", ".join(html.escape(c["replica_id"]) for c in failure["left"]) if failure else ""
        rows.append(
            [
                link,
                f"{j['healthy']} of {j['members']}",
                str(j["step"]),
                "" if j["quorum_id"] is None else str(j["quorum_id"]),
                "" if j["quorum_age_s"] is None else f"{j['quorum_age_s']:.1f} s",
                f"{_age(now, failure['time'])}: {left} left" if failure else "none",
            ]
        )
    head = ["job", "healthy members", "step", "quorum id", "quorum age", "last failure"]
    return "<h2>Jobs</h2>\n" + _table("jobs", head, rows, "")


def render_page(status: dict[str, Any]) -> str:
    now = status.get("now", time.time())
    job = status.get("job", "default")
    kill = status.get("kill", {"enabled": False, "secret_set": False})
    groups = {g["name"]: g for g in status.get("groups", [])}
    replicas = []
    for r in status["replicas"]:
        health = (
            '<span class="ok">healthy</span>' if r["healthy"] else '<span class="bad">silent</span>'
        )
        replicas.append(
            [
                html.escape(r["replica_id"]),
                str(r["step"]),
                f"{r.get('step_rate', 0.0):.2f}",
                f"{r['heartbeat_age_s']:.1f} s",
                health,
                "yes" if r["in_quorum"] else "",
                "yes" if r["waiting"] else "",
                html.escape(r["address"]),
                _kill_cell(r["replica_id"], kill, job),
            ]
        )
    group_rows = [
        [
            html.escape(name),
            str(g["step"]),
            str(g["committed"]),
            f"{g['step_rate']:.2f}",
            _pct(g["goodput"]),
            _age(now, g["last_seen"]),
        ]
        for name, g in sorted(groups.items())
    ]
    history = []
    for e in status.get("history", []):
        who = []
        for c in e["joined"]:
            who.append(f"<b>+</b> {html.escape(c['replica_id'])}: {html.escape(c['why'])}")
        for c in e["left"]:
            who.append(
                f'<b class="bad">-</b> {html.escape(c["replica_id"])}: {html.escape(c["why"])}'
            )
        history.append(
            [
                _clock(e["time"]),
                "" if e["quorum_id"] is None else str(e["quorum_id"]),
                str(len(e["members"])) if e["quorum_id"] is not None else "",
                "<br>".join(who) or '<span class="note">same members</span>',
                html.escape(e["note"]),
            ]
        )
    heals = [
        [
            _clock(h["time"]),
            html.escape(h["replica_id"]),
            ", ".join(html.escape(s) for s in h["sources"]) or "?",
            str(h["step"]),
            "not reported" if h["seconds"] is None else f"{h['seconds']:.2f} s",
            _bytes(h["bytes"]),
        ]
        for h in status.get("heals", [])
    ]
    spares = [
        [
            html.escape(sp["spare_id"]),
            html.escape(sp["wanted"]) or "any",
            f"{sp['waiting_s']:.1f} s",
        ]
        for sp in status.get("spares", [])
    ]
    chart = render_chart({n: [tuple(p) for p in g["points"]] for n, g in groups.items()}, now)
    goodput = status.get("goodput", {})
    quorum_id = status["quorum_id"]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>torchft_like lighthouse</title>
<style>{_STYLE}</style>{_RELOAD}</head><body>
<h1>Lighthouse{"" if job == "default" else f": job {html.escape(job)}"}</h1>
{_jobs(status.get("jobs", []), job, now)}
<p>Quorum id: <b id="quorum-id">{quorum_id}</b> &middot; members:
{len(status["quorum_members"])} &middot; min_replicas: {status["min_replicas"]}
&middot; goodput: <b id="goodput">{_pct(goodput.get("value"))}</b></p>
<p>Status: {html.escape(status["summary"])}</p>
<h2>Replicas</h2>
{
        _table(
            "replicas",
            [
                "replica id",
                "step",
                "steps/s",
                "heartbeat age",
                "health",
                "in quorum",
                "waiting",
                "address",
                "kill",
            ],
            replicas,
            "no replica has been heard from yet",
        )
    }
<p class="note">{_kill_note(kill)}</p>
<h2>Spares</h2>
{
        _table(
            "spares",
            ["spare", "wants", "waiting"],
            spares,
            "no spare waiting (start one with --spare: it takes the place of the next group "
            "that dies)",
        )
    }
<h2>Committed steps over time</h2>
{chart}
{
        _table(
            "groups",
            ["group", "step", "steps committed", "steps/s", "goodput", "last seen"],
            group_rows,
            "no group has asked for a quorum yet",
        )
    }
<p class="note">steps/s: committed steps per second over the last
{status.get("rate_window_s", 30):.0f} s. Goodput: {html.escape(GOODPUT_DEFINITION)}</p>
<h2>Heals</h2>
{
        _table(
            "heals",
            ["time", "replica", "from", "step", "duration", "bytes"],
            heals,
            "no heal yet",
        )
    }
<p class="note">From: the replica group rank 0 copies from (rank r may use another
up-to-date replica). Duration and bytes come from the healing group, one step later;
pytorch/torchft groups do not report them.</p>
<h2>Quorum history</h2>
{
        _table(
            "history",
            ["time", "quorum id", "members", "joined / left", "reason"],
            history,
            "no quorum yet",
        )
    }
</body></html>
"""
