"""Test certificates made with the openssl CLI: a CA, and a node certificate it
signs, valid for 127.0.0.1 and localhost as a server and as a client."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_NODE_EXT = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certs(directory: Path, name: str = "job") -> Certs:
    """A CA named `name` and a node certificate (and key) it signed, in `directory`."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl CLI is needed to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = f"{name}-ca.pem", f"{name}-ca.key"
    cert, key, csr = f"{name}-node.pem", f"{name}-node.key", f"{name}-node.csr"
    _openssl("req", "-x509", *_EC, "-keyout", ca_key, "-out", ca, "-days", "2",
             "-subj", f"/CN={name} test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
    _openssl("req", *_EC, "-keyout", key, "-out", csr, "-subj", "/CN=localhost", cwd=directory)
    (directory / f"{name}-node.ext").write_text(_NODE_EXT)
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", f"{name}-node.ext", cwd=directory)  # fmt: skip
    return Certs(ca=directory / ca, cert=directory / cert, key=directory / key)
