"""The lighthouse's HTTP status page, JSON status and Prometheus metrics.

Access: the page is read-only and stays open when the job has a secret
(lighthouse.rpc.auth). It shows replica ids, steps, heartbeat ages and the
ManagerServer addresses; no secret, no weights, nothing that lets a reader
act (every address it lists refuses calls without the secret). Keeping it
open lets a browser and a Prometheus scraper read it without a token. Bind
it to 127.0.0.1 (`--http-bind`) or turn it off (empty) where even the job's
layout is not to be seen. It has no action that changes state (no kill
button): any method but GET is refused with 405, so one cannot be reached
by accident; one added later must be off unless a flag enables it, and
require the secret (`auth.http_refusal`).
"""

from __future__ import annotations

import html
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.rpc.http_server import server_class

HANDLER_TIMEOUT_S = 10.0
"""Seconds a connection may stay silent before it is dropped: an idle or
slow client holds a server thread this long at most."""

logger = logging.getLogger(__name__)

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="1">
<title>torchft_like lighthouse</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 10px;text-align:left}}
.bad{{color:#b00}}.ok{{color:#070}}</style></head><body>
<h1>Lighthouse</h1>
<p>Quorum id: <b>{quorum_id}</b> &middot; members: {num_members}
&middot; min_replicas: {min_replicas}</p>
<p>Status: {summary}</p>
<table><tr><th>replica id</th><th>step</th><th>address</th><th>heartbeat age</th>
<th>health</th><th>in quorum</th><th>waiting</th></tr>
{rows}
</table></body></html>
"""


def render_page(status: dict[str, Any]) -> str:
    rows = []
    for r in status["replicas"]:
        health = (
            '<span class="ok">healthy</span>' if r["healthy"] else '<span class="bad">silent</span>'
        )
        cells = [
            html.escape(r["replica_id"]),
            str(r["step"]),
            html.escape(r["address"]),
            f"{r['heartbeat_age_s']:.1f} s",
            health,
            "yes" if r["in_quorum"] else "",
            "yes" if r["waiting"] else "",
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return _PAGE.format(
        quorum_id=status["quorum_id"],
        num_members=len(status["quorum_members"]),
        min_replicas=status["min_replicas"],
        summary=html.escape(status["summary"]),
        rows="\n".join(rows),
    )


class StatusServer:
    """Serves `/`, `/status.json` and `/metrics` from a daemon thread.

    Args:
        bind: `host:port` to listen on (port 0 picks one).
        status: returns the status as a JSON-able dict (see render_page).
        metrics: returns the Prometheus text exposition.
    """

    def __init__(
        self, bind: str, status: Callable[[], dict[str, Any]], metrics: Callable[[], bytes]
    ) -> None:
        host, port = parse_bind(bind)

        class Handler(BaseHTTPRequestHandler):
            timeout = HANDLER_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self._send(200, "text/html; charset=utf-8", render_page(status()).encode())
                elif path == "/status.json":
                    self._send(200, "application/json", json.dumps(status()).encode())
                elif path == "/metrics":
                    self._send(200, "text/plain; version=0.0.4", metrics())
                else:
                    self._send(404, "text/plain", b"not found; try /, /status.json or /metrics\n")

            def _read_only(self) -> None:
                self._send(
                    405,
                    "text/plain",
                    b"the status page is read-only; use GET on /, /status.json or /metrics\n",
                    ("Allow", "GET"),
                )

            do_POST = do_PUT = do_DELETE = do_PATCH = _read_only  # noqa: N815

            def _send(
                self, code: int, content_type: str, body: bytes, *headers: tuple[str, str]
            ) -> None:
                self.send_response(code)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("status page: " + format, *args)

        try:
            self._server = server_class(host)((host, port), Handler)
        except OSError as e:
            raise OSError(
                f"cannot serve the status page on {bind}: {e.strerror}; choose another "
                "--http-bind port (0 picks a free one)"
            ) from e
        self._server.service = "status page"
        self._host = advertised_host(host)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="lighthouse-http", daemon=True
        )
        self._thread.start()
        logger.info("lighthouse status page on %s", self.address())

    def address(self) -> str:
        return f"http://{join_host_port(self._host, self._server.server_address[1])}"

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
