"""A small read-only HTTP server of Prometheus metrics (GET /metrics), for
the replica groups' Managers (torchft_like.manager.metrics); the lighthouse serves
its own on its status page."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.web.server import server_class

logger = logging.getLogger(__name__)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format."""


class MetricsServer:
    """Serves `render()` at GET /metrics from a daemon thread.

    Read-only and open, like the status page: counts and timings, no state.

    Raises:
        OSError: the address cannot be bound; the text says what to change.
    """

    def __init__(self, bind: str, render: Callable[[], bytes], what: str = "metrics") -> None:
        host, port = parse_bind(bind)

        class Handler(BaseHTTPRequestHandler):
            timeout = 10.0

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    body, code, kind = b"not found; try /metrics\n", 404, "text/plain"
                else:
                    body, code, kind = render(), 200, CONTENT_TYPE
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug(what + ": " + format, *args)

        try:
            self._server = server_class(host)((host, port), Handler)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot serve {what} on {bind}: {e.strerror}; choose another port"
            ) from e
        self._server.service = what
        self._host = advertised_host(host)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="lighthouse_metrics_http", daemon=True
        )
        self._thread.start()

    def address(self) -> str:
        """`http://host:port/metrics`."""
        return f"http://{join_host_port(self._host, self._server.server_address[1])}/metrics"

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
