"""The project's threaded HTTP servers: a bounded backlog, and a peer that
hangs up is a DEBUG line, not an ERROR with a traceback.

A client that disconnects mid-request (a closed browser tab, a scraper's
timeout, a port scan, a receiver that gave up) is ordinary on a network;
http.server's default prints a traceback to stderr for each one, so 500 of
them made 500 tracebacks. Errors that are not hang-ups keep their traceback.
"""

from __future__ import annotations

import logging
import socket
import sys
from http.server import ThreadingHTTPServer
from typing import Any

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
