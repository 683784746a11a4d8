"""The lighthouse's HTTP status page, JSON status and Prometheus metrics.

Access: reading stays open when the job has a secret (lighthouse.rpc.auth).
The page shows replica ids, steps, heartbeat ages, heals and the
ManagerServer addresses; no secret, no weights, nothing that lets a reader
act (every address it lists refuses calls without the secret). Keeping it
open lets a browser and a Prometheus scraper read it without a token. Bind
it to 127.0.0.1 (`--http-bind`) or turn it off (empty) where even the job's
layout is not to be seen.

A lighthouse of many jobs (lighthouse.core.jobs) has a page per job,
`/job/JOB` and `/job/JOB/status.json`; `/` is the default job's, with the
list of jobs. A job with a secret of its own is listed by name only, and
its pages need its secret (`Authorization: Bearer ...`, 401 without).

Its one action, the kill button (`POST /kill`), is off unless the lighthouse
runs with `--kill-button` and a secret, and each kill needs the job's secret
typed into the form (the browser has no token to send). GET never changes state
(GET /kill is a 404); other methods and paths are refused with 405.
"""

from __future__ import annotations

import html
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs

from lighthouse.core.jobs import DEFAULT_JOB
from lighthouse.rpc import auth
from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.status.dashboard import render_page
from lighthouse.web.server import server_class

MAX_FORM_BYTES = 4096
"""Largest kill form body read; a larger one is refused unread."""
HANDLER_TIMEOUT_S = 10.0
"""Seconds a connection may stay silent before it is dropped: an idle or
slow client holds a server thread this long at most."""

logger = logging.getLogger(__name__)


class StatusServer:
    """Serves `/`, `/status.json` and `/metrics` from a daemon thread.

    Args:
        bind: `host:port` to listen on (port 0 picks one).
        status: `status(job)`, the job's status as a JSON-able dict (see
            render_page); KeyError for a job the lighthouse does not hold.
        metrics: returns the Prometheus text exposition.
        kill: the kill button, `kill(replica_id, typed_secret, peer_host, job)`
            -> (HTTP status, message); None: POST /kill is refused with 405.
        protected: `protected(job)`, the secret that guards the job's pages, or None.
    """

    def __init__(
        self,
        bind: str,
        status: Callable[[str], dict[str, Any]],
        metrics: Callable[[], bytes],
        kill: Callable[[str, str, str, str], tuple[int, str]] | None = None,
        protected: Callable[[str], str | None] = lambda job: None,
    ) -> None:
        host, port = parse_bind(bind)

        class Handler(BaseHTTPRequestHandler):
            timeout = HANDLER_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    return self._send(200, "text/plain; version=0.0.4", metrics())
                job, page = DEFAULT_JOB, path
                if path.startswith("/job/"):
                    job, _, rest = path[len("/job/") :].partition("/")
                    page = "/" + rest
                if page not in ("/", "/status.json"):
                    return self._send(
                        404, "text/plain", b"not found; try /, /status.json, /job/JOB or /metrics\n"
                    )
                why = auth.http_refusal(self.headers, protected(job), f"status page of job {job!r}")
                if why is not None:
                    return self._send(401, "text/plain", why.encode(), auth.WWW_AUTHENTICATE)
                try:
                    data = status(job)
                except KeyError:
                    return self._send(404, "text/plain", b"this lighthouse holds no such job\n")
                if page == "/":
                    self._send(200, "text/html; charset=utf-8", render_page(data).encode())
                else:
                    self._send(200, "application/json", json.dumps(data).encode())

            def _read_only(self) -> None:
                self._send(
                    405,
                    "text/plain",
                    b"the status page is read-only but for POST /kill (the kill button); use "
                    b"GET on /, /status.json or /metrics\n",
                    ("Allow", "GET"),
                    ("Connection", "close"),  # a request body, if any, stays unread
                )

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/kill" or kill is None:
                    return self._read_only()
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_FORM_BYTES:
                    self.close_connection = True
                    return self._answer(400, f"a kill form of 0 to {MAX_FORM_BYTES} bytes, please")
                form = parse_qs(self.rfile.read(length).decode("utf-8", "replace"))
                replica_id = form.get("replica_id", [""])[0]
                if not replica_id:
                    return self._answer(400, "the kill form needs a replica_id")
                job = form.get("job", [DEFAULT_JOB])[0]
                code, message = kill(
                    replica_id, form.get("secret", [""])[0], self.client_address[0], job
                )
                self._answer(code, message)

            def _answer(self, code: int, message: str) -> None:
                """A small page with the kill's outcome and a link back."""
                body = (
                    '<!doctype html><html><head><meta charset="utf-8"><title>kill</title>'
                    f'</head><body><p id="outcome">{html.escape(message)}</p>'
                    '<p><a href="/">back to the status page</a></p></body></html>'
                )
                self._send(code, "text/html; charset=utf-8", body.encode())

            do_PUT = do_DELETE = do_PATCH = _read_only  # noqa: N815

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
            target=self._server.serve_forever, name="lighthouse_status_http", daemon=True
        )
        self._thread.start()
        logger.info("lighthouse status page on %s", self.address())

    def address(self) -> str:
        return f"http://{join_host_port(self._host, self._server.server_address[1])}"

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
