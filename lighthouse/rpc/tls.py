"""Transport security: one TLS configuration for the job's gRPC and HTTPS servers and clients.

A job configures TLS once, with three PEM files: this process's certificate
and key (servers present them; clients present them too, for mutual TLS)
and the CA that signed the peers' certificates. Entry points read them from
TORCHFT_TLS_CERT / TORCHFT_TLS_KEY / TORCHFT_TLS_CA (and
TORCHFT_TLS_CLIENT_AUTH=1 for mutual TLS), or from the lighthouse CLI's
``--tls-*`` flags (`tls_from_env`); everything else takes a `TLSConfig`,
None meaning plaintext.

With TLS, every address a server advertises is ``https://host:port``: the
lighthouse, the ManagerServers and the checkpoint servers. A URL's scheme
must agree with the configuration (`check_scheme`), so a job half
configured fails at start with a text saying what to set, not with a
handshake error deep in a step. The shared secret (lighthouse.rpc.auth)
still authenticates callers; TLS keeps it and the traffic from being read
or changed on the way, and mutual TLS also refuses connections from anyone
without a certificate of the job's CA before any call is read.
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
from collections.abc import Mapping

import grpc

CERT_ENV = "TORCHFT_TLS_CERT"
KEY_ENV = "TORCHFT_TLS_KEY"
CA_ENV = "TORCHFT_TLS_CA"
CLIENT_AUTH_ENV = "TORCHFT_TLS_CLIENT_AUTH"

_NAMES = {
    "cert": f"certificate file ({CERT_ENV}, --tls-cert or TLSConfig.cert)",
    "key": f"key file ({KEY_ENV}, --tls-key or TLSConfig.key)",
    "ca": f"CA file ({CA_ENV}, --tls-ca or TLSConfig.ca)",
}
FIX = (
    f"set {CA_ENV} to the CA file that signed the servers' certificates (and, where the "
    f"server requires client certificates, {CERT_ENV} and {KEY_ENV}) in the caller's environment"
)
"""What a caller refused at the TLS handshake should do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TLSConfig:
    """TLS files of this process; validated (read and parsed) at construction.

    Raises:
        ValueError: a key without a certificate or the reverse, client_auth
            without a CA, or a file that cannot be read or parsed; the text
            names the variable and flag that set it.
    """

    cert: str | None = None
    """PEM certificate (chain) this process presents: required to serve."""
    key: str | None = None
    """PEM private key of `cert`."""
    ca: str | None = None
    """PEM CA certificates that peers' certificates must chain to. None: the
    system's trusted CAs (clients), no client certificates checked (servers)."""
    client_auth: bool = False
    """Servers require a client certificate signed by `ca` (mutual TLS)."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, missing = ("cert", "key") if self.key is None else ("key", "cert")
            raise ValueError(
                f"TLS {_NAMES[given]} is set but no {_NAMES[missing]}: set both (a "
                "certificate and its private key), or neither for a client that only checks "
                "servers"
            )
        if self.client_auth and self.ca is None:
            raise ValueError(
                f"TLS client authentication ({CLIENT_AUTH_ENV}, --tls-client-auth) needs the "
                f"CA that signs client certificates: set the {_NAMES['ca']}"
            )
        if self.cert is None and self.ca is None:
            raise ValueError(
                f"an empty TLS configuration: set at least the {_NAMES['ca']} (a client) or "
                f"the {_NAMES['cert']} and {_NAMES['key']} (a server)"
            )
        for field in ("cert", "key", "ca"):
            path = getattr(self, field)
            if path is not None:
                _read(path, field)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.ca is not None:
            try:
                context.load_verify_locations(cafile=self.ca)
            except (ssl.SSLError, ValueError) as e:
                raise ValueError(
                    f"TLS {_NAMES['ca']} {self.ca!r} holds no valid PEM certificate ({e}); "
                    "point it at the CA's certificate"
                ) from None
        if self.cert is not None and self.key is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as e:
                raise ValueError(
                    f"TLS {_NAMES['cert']} {self.cert!r} and {_NAMES['key']} {self.key!r} do "
                    f"not load as a PEM certificate and its private key ({e}); check that the "
                    "key belongs to the certificate"
                ) from None

    @property
    def can_serve(self) -> bool:
        return self.cert is not None

    def require_server(self, service: str) -> None:
        """Raises ValueError if this configuration cannot serve (no certificate)."""
        if not self.can_serve:
            raise ValueError(
                f"the {service} cannot serve TLS without a certificate: set the "
                f"{_NAMES['cert']} and the {_NAMES['key']}"
            )

    # ---- gRPC ----------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        self.require_server("gRPC server")
        assert self.cert is not None and self.key is not None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "key"), _read(self.cert, "cert"))],
            root_certificates=_read(self.ca, "ca") if self.ca else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "ca") if self.ca else None,
            private_key=_read(self.key, "key") if self.key else None,
            certificate_chain=_read(self.cert, "cert") if self.cert else None,
        )

    # ---- Python ssl (HTTPS, probes) ---------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        self.require_server("checkpoint server")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)  # type: ignore[arg-type]
        if self.ca is not None:
            context.load_verify_locations(cafile=self.ca)
        if self.client_auth:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            context.load_verify_locations(cafile=self.ca)
        else:
            context.load_default_certs()
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


def _read(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(
            f"cannot read the TLS {_NAMES[field]} {path!r}: {e.strerror or e}; check the path "
            "and that this user may read it"
        ) from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the TLS {_NAMES[field]} {path!r} is not a PEM file (no -----BEGIN)")
    return data


def tls_from_env(
    environ: Mapping[str, str],
    cert: str | None = None,
    key: str | None = None,
    ca: str | None = None,
    client_auth: bool | None = None,
) -> TLSConfig | None:
    """The job's TLS configuration for an entry point, or None (plaintext).

    Arguments (the CLI's flags) win over the variables. A variable set but
    empty is an error, not "off", like an empty secret variable.

    Raises:
        ValueError: see TLSConfig; also an empty variable.
    """
    values: dict[str, str | None] = {}
    for name, env, given in (("cert", CERT_ENV, cert), ("key", KEY_ENV, key), ("ca", CA_ENV, ca)):
        value = given if given is not None else environ.get(env)
        if value == "":
            raise ValueError(f"{env} is set but empty; set it to a PEM file's path, or unset it")
        values[name] = value
    if client_auth is None:
        flag = environ.get(CLIENT_AUTH_ENV, "")
        if flag not in ("", "0", "1"):
            raise ValueError(f"{CLIENT_AUTH_ENV}={flag!r}: use 1 (mutual TLS) or 0")
        client_auth = flag == "1"
    if all(v is None for v in values.values()) and not client_auth:
        return None
    return TLSConfig(
        cert=values["cert"], key=values["key"], ca=values["ca"], client_auth=client_auth
    )


def scheme(tls: TLSConfig | None) -> str:
    """The URL scheme of a server with this configuration."""
    return "http" if tls is None else "https"


def check_scheme(url: str, tls: TLSConfig | None, what: str) -> None:
    """Raises ValueError if `url`'s scheme disagrees with `tls` (a bare host:port agrees)."""
    given = url.split("://", 1)[0].lower() if "://" in url else None
    if given is None or given == scheme(tls):
        return
    if tls is None:
        raise ValueError(
            f"{what} {url!r} is https but this process has no TLS configuration: {FIX}"
        )
    raise ValueError(
        f"{what} {url!r} is plain http but this process is configured for TLS "
        f"({CERT_ENV}/{CA_ENV}): use https://, and run that server with TLS too"
    )


def is_refusal(error: ssl.SSLError) -> bool:
    """Whether a handshake error is final (a certificate refused by either
    side, TLS spoken to a plain server), not a connection lost on the way."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return True
    reason = error.reason or ""
    return "ALERT" in reason or reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST")


def probe(host: str, port: int, tls: TLSConfig, timeout_s: float) -> str | None:
    """Why a TLS connection to host:port fails, or None if it works.

    Does the handshake with Python's ssl, then sends the HTTP/2 preface and
    waits for a first byte: under TLS 1.3 a server that requires a client
    certificate refuses it only after the client's side of the handshake is
    done, so the refusal arrives with the first read.
    """
    context = tls.client_context()
    context.set_alpn_protocols(["h2"])  # gRPC servers drop a connection without it
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=host) as conn:
                try:
                    conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    closed = not conn.recv(1)
                except (ConnectionError, ssl.SSLEOFError):
                    closed = True
    except ssl.SSLError as e:  # a certificate verification error among them
        return f"TLS handshake failed: {getattr(e, 'verify_message', None) or e.reason or e}"
    except OSError:
        return None  # not a TLS problem: the caller's own errors say the rest
    if closed:
        return (
            "TLS handshake failed: the server closed the connection right after it, "
            "as a server that requires a client certificate (mutual TLS) does"
            + ("; this process presents none" if tls.cert is None else "")
        )
    return None
