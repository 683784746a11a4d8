"""Access control by a shared secret: loading it, and checking it on gRPC and HTTP.

When a job sets a secret, every gRPC call (lighthouse, ManagerServer) and
every checkpoint download must carry it, as ``authorization: Bearer <secret>``
(gRPC metadata or HTTP header); so must any state-changing status-page
action, should one be added (there is none: the page is read-only). Calls
without it are refused: gRPC UNAUTHENTICATED, HTTP 401, with a text that
says what to set.

The secret comes from TORCHFT_SECRET_FILE (a file holding it) or
TORCHFT_SECRET, or on the lighthouse CLI from ``--secret-file``; never from a
command-line value, which every user of the machine can read in ``ps``.
Only entry points read the environment (`secret_from_env`); everything else
takes the secret as an argument, None meaning access control is off.

Protected: the lighthouse's and the ManagerServers' gRPC services (every
RPC, also ones added later: the interceptor knows no method names) and the
checkpoint HTTP servers (all paths). Not protected: the lighthouse's status
page, which is read-only (see lighthouse.status.server); torch's TCPStore and the
gloo connections of the process groups, which torch opens and we cannot
guard; and a pytorch/torchft lighthouse, which ignores the secret.

What this does not do: without TLS (lighthouse.rpc.tls) the secret and all
traffic (weights included) cross the network in clear, so anyone who can
watch the network can read the secret and replay it. Alone it keeps out
callers who cannot, e.g. another job or a stray script on a shared cluster,
and turns a misconfigured peer into a clear error instead of a silent
member; with TLS the secret travels encrypted and still authenticates callers.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc import aio

from lighthouse.core.jobs import DEFAULT_JOB
from lighthouse.rpc.address import is_loopback

logger = logging.getLogger(__name__)

SECRET_ENV = "TORCHFT_SECRET"
SECRET_FILE_ENV = "TORCHFT_SECRET_FILE"
METADATA_KEY = "authorization"
"""gRPC metadata key (lower case, as gRPC requires) and HTTP header of the secret."""
JOB_METADATA_KEY = "torchft-job"
"""gRPC metadata that names a lighthouse call's job (lighthouse.core.jobs);
a call without it is in the default job."""
_SCHEME = "Bearer "


# ---- loading ---------------------------------------------------------------


def validate_secret(secret: str, source: str) -> str:
    """Returns `secret` if it can travel in a header; `source` names where it came from.

    Raises:
        ValueError: empty, or holding characters other than printable ASCII
            without spaces (a header value cannot carry them).
    """
    if not secret:
        raise ValueError(
            f"the secret in {source} is empty; put the secret in it (e.g. the output of "
            "`openssl rand -hex 32`), or give no secret at all (no --secret-file, "
            f"{SECRET_FILE_ENV} or {SECRET_ENV}) to run without access control"
        )
    if not all(0x21 <= ord(c) <= 0x7E for c in secret):
        raise ValueError(
            f"the secret in {source} holds a space, a control or a non-ASCII character; "
            "use printable ASCII only, e.g. the output of `openssl rand -hex 32`"
        )
    return secret


def read_secret_file(path: str) -> str:
    """Reads the secret from `path`; surrounding whitespace (a final newline) is dropped.

    Raises:
        ValueError: the file cannot be read, or holds no valid secret.
    """
    try:
        with open(path, encoding="ascii", errors="strict") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(
            f"cannot read the secret file {path!r}: {why}; check the path and that this "
            "user may read it"
        ) from None
    return validate_secret(text.strip(), f"file {path!r}")


def secret_from_env(environ: Mapping[str, str], secret_file: str | None = None) -> str | None:
    """The job's secret for an entry point, or None when access control is off.

    Precedence: `secret_file` (a CLI flag) > TORCHFT_SECRET_FILE > TORCHFT_SECRET.
    A variable that is set but empty is an error, not "off": it is what a
    failed `$(cat ...)` leaves, and silently running unprotected would hide it.

    Raises:
        ValueError: both variables set, an empty variable, or a bad file.
    """
    if secret_file is not None:
        return read_secret_file(secret_file)
    path, value = environ.get(SECRET_FILE_ENV), environ.get(SECRET_ENV)
    if path is not None and value is not None:
        raise ValueError(f"both {SECRET_FILE_ENV} and {SECRET_ENV} are set; set only one")
    if path is not None:
        if not path:
            raise ValueError(f"{SECRET_FILE_ENV} is set but empty; set it to the secret's path")
        return read_secret_file(path)
    if value is not None:
        return validate_secret(value, SECRET_ENV)
    return None


def load_secret(secret_file: str | None = None) -> str | None:
    """`secret_from_env` on this process's environment (for entry points)."""
    return secret_from_env(os.environ, secret_file)


def exposure_warning(secret: str | None, bind_host: str, service: str) -> str | None:
    """The warning a server logs at start when it runs without a secret off
    loopback, or None. We warn rather than refuse to start: a job without a
    secret must keep working with pytorch/torchft peers and existing launch
    scripts, and the one destructive call (Kill) is refused anyway."""
    if secret is not None or is_loopback(bind_host):
        return None
    where = "all interfaces" if bind_host in ("", "::", "0.0.0.0", "[::]") else repr(bind_host)
    return (
        f"SECURITY: the {service} listens on {where} without a shared secret: anyone who "
        "can reach it can join or stall quorums with forged calls (Kill is refused "
        f"without a secret). Set {SECRET_FILE_ENV} (a file holding e.g. `openssl rand "
        "-hex 32`) in every process of the job, or bind to 127.0.0.1 on a single host"
    )


# ---- checking (pure) ---------------------------------------------------------


def refusal(presented: str | None, secret: str | None, service: str) -> str | None:
    """Why a call carrying the header value `presented` is refused, or None if allowed.

    `service` names the server in the text ("lighthouse", "checkpoint server").
    The comparison takes the same time wherever the values differ
    (hmac.compare_digest), so timing does not reveal the secret.
    """
    if secret is None:
        return None
    given = presented[len(_SCHEME) :] if presented and presented.startswith(_SCHEME) else None
    if given is not None and hmac.compare_digest(given.encode(), secret.encode()):
        return None
    carried = "carried none" if given is None else "carried a wrong one"
    return (
        f"unauthenticated: this {service} requires the job's shared secret and the request "
        f"{carried}; set {SECRET_FILE_ENV} (a file holding the secret) or {SECRET_ENV} in the "
        f"caller's environment to the secret the {service} was started with"
    )


class Secrets:
    """The secret each call must carry, by the job it names: a job's own
    (`by_job`), else `default` (None: open). A lighthouse with one secret
    has it as `default` and no job of its own; a ManagerServer is one job's."""

    __slots__ = ("default", "by_job")

    def __init__(self, default: str | None, by_job: Mapping[str, str] | None = None) -> None:
        self.default = default
        self.by_job = dict(by_job or {})

    @classmethod
    def of(cls, secret: str | Secrets | None) -> Secrets | None:
        """`secret` as Secrets; None when no call needs one."""
        if isinstance(secret, Secrets):
            return secret if secret.default is not None or secret.by_job else None
        return None if secret is None else cls(secret)

    def validate(self, service: str) -> None:
        """Raises ValueError for a secret that cannot travel in a header."""
        if self.default is not None:
            validate_secret(self.default, f"the {service}'s `secret` argument")
        for job, secret in self.by_job.items():
            validate_secret(secret, f"job {job!r}'s secret")

    def refusal(self, presented: str | None, job: str | None, service: str) -> str | None:
        """`refusal` for a call naming `job` (None: the default job)."""
        own = self.by_job.get(job) if job is not None else None
        if own is not None:
            return refusal(presented, own, f"{service}'s job {job!r}")
        return refusal(presented, self.default, service)


def header_value(secret: str) -> str:
    return _SCHEME + secret


def metadata(secret: str | None, job: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that carries `secret` and names `job`: none for
    neither (None, or the default job: what every older client sends)."""
    pairs: tuple[tuple[str, str], ...] = ()
    if secret is not None:
        pairs = ((METADATA_KEY, header_value(secret)),)
    if job is not None and job != DEFAULT_JOB:
        pairs += ((JOB_METADATA_KEY, job),)
    return pairs


def http_headers(secret: str | None) -> dict[str, str]:
    """Headers an HTTP request carries to pass `http_refusal`: empty without a secret."""
    return {} if secret is None else {"Authorization": header_value(secret)}


def http_refusal(headers: Any, secret: str | None, service: str) -> str | None:
    """`refusal` for an HTTP request's headers (http.server's `self.headers`).

    The caller answers 401 with the text as body and `WWW_AUTHENTICATE`.
    """
    return refusal(headers.get("Authorization"), secret, service)


WWW_AUTHENTICATE = ("WWW-Authenticate", 'Bearer realm="torchft"')


class RefusalLog:
    """Logs a refused call at WARNING the first time per (peer host, what),
    then at DEBUG, so a misconfigured peer shows up in the server's log once
    and a flood of refusals cannot flood it. Thread-safe; bounded memory."""

    _MAX_KEYS = 1024

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def refused(self, peer_host: str, what: str, why: str) -> None:
        """`why` is the `refusal` text; its first clause is logged."""
        key = (peer_host, what)
        with self._lock:
            first = key not in self._seen and len(self._seen) < self._MAX_KEYS
            if first:
                self._seen.add(key)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "refused %s from %s: %s (repeats from there are logged at DEBUG)",
            what,
            peer_host,
            why.split(";", 1)[0],
        )


# ---- gRPC server ---------------------------------------------------------------


class SecretServerInterceptor(aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not carry the secret.

    It answers with a handler of the same kind (unary or streaming) as the
    method's, so it covers RPCs added later without knowing them.
    """

    def __init__(self, secrets: Secrets, service: str) -> None:
        self._secrets = secrets
        self._service = service
        self._log = RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        presented = job = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA_KEY:
                presented = value.decode(errors="replace") if isinstance(value, bytes) else value
            elif key == JOB_METADATA_KEY:
                job = value.decode(errors="replace") if isinstance(value, bytes) else value
        handler = await continuation(handler_call_details)
        why = self._secrets.refusal(presented, job, self._service)
        if why is None or handler is None:
            return handler
        return self._denying_handler(handler, handler_call_details.method, why)

    def _denying_handler(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str, why: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        async def deny(_request: Any, context: aio.ServicerContext[Any, Any]) -> None:
            self._log.refused(context.peer().rsplit(":", 1)[0], method, why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        return _same_kind(handler, deny)


def _same_kind(
    handler: grpc.RpcMethodHandler[Any, Any], behavior: Any
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler running `behavior`, of the same kind (unary or streaming) as `handler`."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def server_interceptors(secret: str | Secrets | None, service: str) -> list[aio.ServerInterceptor]:
    """Interceptors for `aio.server(interceptors=...)`: none when no call needs a secret.

    Raises:
        ValueError: a secret is empty or cannot travel in a header.
    """
    secrets = Secrets.of(secret)
    if secrets is None:
        return []
    secrets.validate(service)
    return [SecretServerInterceptor(secrets, service)]


# ---- gRPC clients --------------------------------------------------------------


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


def _with(metadata: Any, pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    return (*tuple(metadata or ()), *pairs)


class _SyncSecretInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the secret and the job to the metadata of every call on a blocking channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self._pairs = pairs

    def _details(self, d: Any) -> _CallDetails:
        return _CallDetails(
            d.method,
            d.timeout,
            _with(d.metadata, self._pairs),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioSecret:
    """Adds the secret and the job to the metadata of every call on an asyncio channel.

    One subclass per call kind: aio files an interceptor under the first
    kind it implements only, so one class for all four would miss three.
    """

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self._pairs = pairs

    def _details(self, d: aio.ClientCallDetails) -> aio.ClientCallDetails:
        metadata = aio.Metadata.from_tuple(_with(d.metadata, self._pairs))
        return d._replace(metadata=metadata)  # type: ignore[attr-defined,no-any-return]


class _AioUnaryUnary(_AioSecret, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioSecret, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioSecret, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioSecret, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def intercept_channel(
    channel: grpc.Channel, secret: str | None, job: str | None = None
) -> grpc.Channel:
    """A blocking channel whose every call carries the secret and names the
    job (`channel` itself when there is nothing to add: `metadata`)."""
    pairs = metadata(secret, job)
    if not pairs:
        return channel
    return grpc.intercept_channel(channel, _SyncSecretInterceptor(pairs))


def aio_client_interceptors(
    secret: str | None, job: str | None = None
) -> list[aio.ClientInterceptor]:
    """Interceptors for `aio.insecure_channel(interceptors=...)`: none when
    there is nothing to add (`metadata`)."""
    pairs = metadata(secret, job)
    if not pairs:
        return []
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    return [kind(pairs) for kind in kinds]
