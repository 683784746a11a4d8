"""pytorch/torchft's HTTP checkpoint contract, served and fetched, so that
torchft groups and torchft_like groups of one job heal from each other.

The contract, as torchft's HTTPTransport keeps it:

- its metadata is ``http://{host}:{port}/checkpoint/``; a receiver appends
  ``{step}/full`` and reads one body, closed by the server;
- the body is the whole healing state, ``{"user": {key: state_dict},
  "torchft": {"step", "batches_committed"}}`` (the same tree our Manager
  sends), with every tensor on the CPU, in torch's streaming save format
  (``torch.distributed._serialization``: a pickled list of records, then
  each record's bytes; torch.save's zip where torch lacks it);
- a request for another step than the staged one gets 400, and one that
  comes before anything is staged waits for it (bounded);
- with ``num_chunks > 0`` torchft also serves ``{step}/metadata`` (a pickled
  pytree spec) and ``{step}/{i}`` (every n-th leaf). torchft's Manager uses
  0, and a server cannot tell the n its client splits by, so we serve
  ``full`` only and refuse the other keys with a message that says so.

Our own metadata is ``http://{host}:{port}/torchft_like/checkpoint/``: a
torchft receiver appends ``{step}/full`` to it like to its own, and our
receiver tells the two kinds of peer apart by that path.

Fetching is safe: the body is decoded only by torch's weights_only
unpickler, which builds tensors, numbers, strings and containers and refuses
every other global, so a peer cannot make us run code. A state that needs
more (a class of the user's, say) is refused with `UnsafeStateError`; the
fix is on the sending side, or an explicit `torch.serialization.
add_safe_globals` here for a class one trusts.

Integrity, plainly: the format has no checksum. Checked are that every record
arrives whole (a body cut short is refused, and the fetch retried), that the
record list and pickle are well formed, that tensors fit the sizes the pickle
names (torch checks) and that nothing follows the last record. Not checked is
the tensor data itself: a bit flipped on the way that TCP's own checksum
misses is applied. Transfers between torchft_like peers use our own format,
which checksums every byte.
"""

from __future__ import annotations

import http.client
import io
import pickle
import re
import time
from typing import Any
from urllib.parse import urlsplit

import torch

from torchft_like.checkpointing._http_fetch import SLICE, DeadlinePassed, NotReady, Refused

try:
    from torch.distributed._serialization import _streaming_load, _streaming_save
except ImportError:  # torch < 2.7 or no torch.distributed: torchft sends torch.save's zip
    _streaming_load = _streaming_save = None  # type: ignore[assignment]

TORCHFT_PATH = "/checkpoint/"
"""The path of a torchft HTTPTransport's metadata."""
OWN_PATH = "/torchft_like/checkpoint/"
"""The path of ours: torchft receivers append ``{step}/full`` to it."""
KEY = "full"
"""The one key of torchft's URL scheme that we serve and fetch."""
ZIP_MAGIC = b"PK\x03\x04"


class UnsafeStateError(ValueError):
    """A torchft peer's state that only an unrestricted unpickler could load."""


def is_torchft_peer(metadata: str) -> bool:
    """True when `metadata` is a torchft HTTPTransport's, by its path."""
    return urlsplit(metadata).path == TORCHFT_PATH


def state_url(metadata: str, step: int) -> str:
    """The URL of the whole state of `step`, as torchft's receiver builds it."""
    return f"{metadata}{step}/{KEY}"


def encode(state: Any, out: Any) -> None:
    """Writes `state` (its tensors on the CPU: `on_cpu`) to the writable
    file `out` in torchft's format."""
    if _streaming_save is not None:
        _streaming_save(state, out)
    else:
        torch.save(state, out)


def on_cpu(state: Any) -> Any:
    """`state` with its tensors on the CPU, as torchft sends them; the tree
    itself when they already are (no copy of the live weights)."""
    from torch.utils import _pytree

    leaves = _pytree.tree_leaves(state)
    if all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in leaves):
        return state
    return _pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), state)


def decode(stream: Any, where: str) -> Any:
    """Loads a torchft state from the file-like `stream`, weights_only;
    `where` names the source in the message of a refusal.

    Tensors land on the CPU, or where the source had them when this process
    has CUDA (torchft sends CPU tensors).

    Raises:
        UnsafeStateError: the state holds objects the weights_only unpickler
            refuses; nothing of it was run or applied.
        ConnectionError: the body ended early (worth fetching again).
        ValueError: the body is not a torch state stream.
    """
    reader = _ExactReader(stream)
    location = None if torch.cuda.is_available() else "cpu"
    try:
        if reader.peek(len(ZIP_MAGIC)) == ZIP_MAGIC:
            return torch.load(io.BytesIO(reader.read_rest()), map_location=location,
                              weights_only=True)  # fmt: skip
        if _streaming_load is None:
            raise ValueError("torch streaming format, which this torch cannot read (needs 2.7+)")
        state = _streaming_load(reader, map_location=location, weights_only=True)  # type: ignore[arg-type]
        if reader.peek(1):
            raise ValueError("bytes follow the last record")
        return state
    except pickle.UnpicklingError as e:
        if "GLOBAL" not in str(e) and "allowlist" not in str(e):  # malformed, not unsafe
            raise ValueError(f"its pickle does not load: {e}") from None
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f"the global {found[1]}" if found else "an object of a class it does not know"
        raise UnsafeStateError(
            f"refused {where}: loading it would need {what}, which torch's "
            f"weights_only unpickler does not allow, and torchft_like never unpickles "
            f"anything else. Keep the healing state to tensors, numbers, strings, lists, "
            f"tuples and dicts on the sending side, or allowlist a class you trust here with "
            f"torch.serialization.add_safe_globals. torch said: {str(e).splitlines()[0]}"
        ) from None
    except (OSError, http.client.HTTPException, ValueError):  # cut short, or ours above
        raise
    except Exception as e:  # torch's loader on a malformed body: KeyError, RuntimeError ...
        raise ValueError(f"the body is not a torch state: {type(e).__name__}: {e}") from e


class _ExactReader:
    """A reader that returns exactly the bytes asked for or raises
    ConnectionError: torch's loader takes a short read for a short record."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._pending = b""
        self.received = 0

    def _raw_read(self, n: int) -> bytes:
        data = self._raw.read(n)
        self.received += len(data)
        return bytes(data)

    def peek(self, n: int) -> bytes:
        while len(self._pending) < n:
            data = self._raw_read(n - len(self._pending))
            if not data:
                break
            self._pending += data
        return self._pending[:n]

    def read(self, n: int = -1) -> bytearray:
        if n is None or n < 0:
            return self.read_rest()
        out = bytearray(self._pending[:n])  # writable, so torch need not copy or warn
        self._pending = self._pending[len(out) :]
        while len(out) < n:
            data = self._raw_read(min(SLICE, n - len(out)))
            if not data:
                raise ConnectionError(
                    f"the body ended early: {self.received} bytes in, a record wanted "
                    f"{n - len(out)} more"
                )
            out += data
        return out

    def read_rest(self) -> bytearray:
        out = bytearray(self._pending)
        self._pending = b""
        while data := self._raw_read(SLICE):
            out += data
        return out

    def readline(self) -> bytes:
        line = bytearray()
        while True:
            if not self._pending:
                self._pending = self._raw_read(1)
                if not self._pending:
                    return bytes(line)
            cut = self._pending.find(b"\n")
            if cut >= 0:
                line += self._pending[: cut + 1]
                self._pending = self._pending[cut + 1 :]
                return bytes(line)
            line += self._pending
            self._pending = b""


class _DeadlineReader:
    """An HTTP response whose every read is bounded by the fetch's deadline."""

    def __init__(self, conn: http.client.HTTPConnection, response: Any, deadline: float) -> None:
        self._conn, self._response, self._deadline = conn, response, deadline
        self.received = 0

    def read(self, n: int) -> bytes:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlinePassed("the deadline passed during the transfer")
        if self._conn.sock is not None:
            self._conn.sock.settimeout(remaining)
        data = bytes(self._response.read(n))
        self.received += len(data)
        return data


def fetch(metadata: str, step: int, deadline: float, where: str) -> tuple[Any, int]:
    """One attempt to fetch `step` from the torchft peer at `metadata`;
    returns the state and the number of body bytes.

    Raises:
        NotReady: the peer answered a server error (torchft answers 500 when
            its state lock times out): worth retrying.
        Refused: any other refusal (another step is served: 400).
        UnsafeStateError, ValueError: the body cannot be loaded safely.
        OSError, http.client.HTTPException: the connection failed.
    """
    url = urlsplit(state_url(metadata, step))
    if url.hostname is None:
        raise ValueError(f"checkpoint metadata {metadata!r} names no host")
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlinePassed("the deadline passed before the request")
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=remaining)
    try:
        conn.request("GET", url.path)  # torchft checks no secret: ours is not sent
        response = conn.getresponse()
        if response.status != 200:
            body = response.read(4096).decode("utf-8", "replace")
            plain = response.getheader("Content-Type", "").startswith("text/plain")
            message = body.strip() if plain and body.strip() else response.reason
            if response.status >= 500:
                raise NotReady(f"answered HTTP {response.status}: {message}")
            raise Refused(response.status, message)
        reader = _DeadlineReader(conn, response, deadline)
        state = decode(reader, f"{where} (key {KEY!r})")
        return state, reader.received
    finally:
        conn.close()
