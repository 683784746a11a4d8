"""The project's threaded HTTP servers: a bounded backlog, and a peer that
hangs up is a DEBUG line, not an ERROR with a traceback.

A client that disconnects mid-request (a closed browser tab, a scraper's
timeout, a port scan, a receiver that gave up) is ordinary on a network;
http.server's default prints a traceback to stderr for each one, so 500 of
them made 500 tracebacks. Errors that are not hang-ups keep their traceback.

With an `ssl_context` the server speaks HTTPS: each connection's TLS
handshake runs on its handler thread (never on the accepting one, which a
slow or silent peer would stall), bounded by the handler's `timeout`. A
failed handshake (a peer without the job's CA or client certificate, a
plain HTTP request) is logged once per peer at WARNING, then at DEBUG.
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
from http.server import ThreadingHTTPServer
from typing import Any

from lighthouse.rpc.auth import RefusalLog

logger = logging.getLogger(__name__)

BACKLOG = 128
"""Listen backlog. http.server's default of 5 made 500 connections opened at
once wait for SYN retries (84 s for the status page to get through them)."""

HANGUPS = (ConnectionError, TimeoutError)
"""A peer that reset, closed early or went silent past the handler timeout
(ConnectionResetError, BrokenPipeError and ConnectionAbortedError are
ConnectionErrors; socket.timeout is TimeoutError)."""


class QuietHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with daemon threads, `BACKLOG` and quiet hang-ups.

    Handlers should set a `timeout` (seconds a socket operation may wait),
    so an idle connection holds its thread for a bounded time only.
    """

    daemon_threads = True
    request_queue_size = BACKLOG
    service = "http server"
    """Names the server in log lines."""
    ssl_context: ssl.SSLContext | None = None
    """Set (before serving) to serve HTTPS; None: plain HTTP."""
    _tls_refusals: RefusalLog | None = None

    def serve_forever(self, poll_interval: float = 5.0) -> None:
        """Serves until `shutdown`, which wakes it: no poll each `poll_interval`
        (a thread wake-up costs ~0.1 ms of CPU here, beside a training step)."""
        super().serve_forever(poll_interval)

    def shutdown(self) -> None:
        try:  # a listening socket shut down reads as ready: select returns now
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        super().shutdown()

    def get_request(self) -> tuple[Any, Any]:
        conn, address = super().get_request()
        if self.ssl_context is None:
            return conn, address
        try:
            wrapped = self.ssl_context.wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        except OSError:
            conn.close()
            raise
        return wrapped, address

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(getattr(self.RequestHandlerClass, "timeout", None) or 10.0)
            try:
                request.do_handshake()
            except ssl.SSLError as e:
                if self._tls_refusals is None:
                    self._tls_refusals = RefusalLog()
                why = f"TLS handshake failed: {e.reason or e}"
                self._tls_refusals.refused(str(client_address[0]), "a TLS connection", why)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, HANGUPS):
            logger.debug("%s: %s hung up: %r", self.service, client_address, error)
            return
        logger.error("%s: request from %s failed", self.service, client_address, exc_info=error)


class QuietHTTPServer6(QuietHTTPServer):
    address_family = socket.AF_INET6


def server_class(host: str) -> type[QuietHTTPServer]:
    """The class that can listen on `host`: IPv6 for a v6 address or "" (all)."""
    return QuietHTTPServer6 if ":" in host or host == "" else QuietHTTPServer
