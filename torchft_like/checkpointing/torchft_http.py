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
receiver tells the two kinds of peer apart by that path (`heal_source`).

Fetching is safe: both pickles of the body (the record list and the state)
are read only by torch's weights_only unpickler, which builds tensors,
numbers, strings and containers and refuses every other global, and the
tensor bytes are read raw into tensors (`_load_streaming`), so a peer cannot
make us run code. A state that needs
more (a class of the user's, say) is refused with `UnsafeStateError`; the
fix is on the sending side, or an explicit `torch.serialization.
add_safe_globals` here for a class one trusts.

Integrity, plainly: the format has no checksum. Checked are that every record
arrives whole (a body cut short is refused, and the fetch retried), that the
record list and pickle are well formed, that every storage has the size the
pickle names and that nothing follows the last record. Not checked is the
tensor data itself: a bit flipped on the way that TCP's own checksum misses
is applied. Transfers between torchft_like peers use our own format, which
checksums every byte.
"""

from __future__ import annotations

import http.client
import io
import pickle
import re
import time
from typing import Any

import torch

from torchft_like.checkpointing import state_format
from torchft_like.checkpointing.heal_source import KEY, HealSource
from torchft_like.checkpointing.http_fetch import SLICE, DeadlinePassed, NotReady, Refused

try:
    from torch.distributed._serialization import _streaming_save
except ImportError:  # torch < 2.7 or no torch.distributed: torchft sends torch.save's zip
    _streaming_save = None  # type: ignore[assignment]

ZIP_MAGIC = b"PK\x03\x04"
_BUFFER = 64 << 10
"""Bytes read ahead for the unpickler's small reads; larger records are
read straight into their memory."""


class UnsafeStateError(ValueError):
    """A torchft peer's state that only an unrestricted unpickler could load."""


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
            return torch.load(
                io.BytesIO(reader.read_rest()), map_location=location, weights_only=True
            )
        state = _load_streaming(reader, location)
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


def _load_streaming(reader: _ExactReader, location: str | None) -> Any:
    """torch's streaming format, read weights_only into memory we own.

    The body is a pickled list of records (name, is it a storage, length),
    then each record's bytes. torch's own reader keeps each storage in the
    immutable bytes object it was read into, and the loaded tensors share
    that memory; here each storage is read straight into a fresh tensor's
    memory (one pass, writable), its length checked against what the pickle
    of the state says, and then torch's loader builds the state with its
    weights_only unpickler.
    """
    from torch import _weights_only_unpickler

    if _streaming_save is None:  # the module below registers the record type as safe
        raise ValueError("torch streaming format, which this torch cannot read (needs 2.7+)")
    entries = _weights_only_unpickler.load(reader)
    if not isinstance(entries, list):
        raise ValueError(f"its record list is a {type(entries).__name__}")
    records = _Records()
    for entry in entries:
        key, is_storage, length = entry.key, entry.is_storage, entry.length
        if not (isinstance(key, str) and isinstance(length, int) and length >= 0):
            raise ValueError(f"bad record entry {entry!r}")
        if is_storage:
            tensor = torch.empty(length, dtype=torch.uint8)
            reader.read_exactly_into(state_format.memview(tensor))
            records.records[key] = tensor.untyped_storage()
        else:
            records.records[key] = bytes(reader.read(length))
    return torch.serialization._load(records, location, _weights_only_unpickler, encoding="utf-8")


class _Records:
    """The records of one streaming body, in the interface torch's loader
    reads a checkpoint's zip file through."""

    def __init__(self) -> None:
        self.records: dict[str, bytes | torch.UntypedStorage] = {}

    def has_record(self, key: str) -> bool:
        return key in self.records

    def get_record(self, key: str) -> bytes:
        record = self.records[key]
        if not isinstance(record, bytes):
            raise ValueError(f"record {key!r} is a storage, not the bytes the loader wants")
        return record

    def get_storage_from_record(self, key: str, nbytes: int, _type: Any) -> torch.Tensor:
        storage = self.records.get(key)
        if not isinstance(storage, torch.UntypedStorage):
            raise ValueError(f"the pickle names storage {key!r}, which the body does not hold")
        if storage.nbytes() != nbytes:
            raise ValueError(
                f"storage {key!r} has {storage.nbytes()} bytes, the pickle says {nbytes}"
            )
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def serialization_id(self) -> str:
        return "torchft"


class _ExactReader:
    """A buffered reader that returns exactly the bytes asked for or raises
    ConnectionError (torch's loader would take a short read for a short
    record). Buffered because the unpickler reads a few bytes at a time."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._read1 = getattr(raw, "read1", raw.read)
        self._buf = b""
        self._pos = 0
        self.received = 0

    def _fill(self, want: int) -> int:
        """Buffers at least `want` bytes unless the body ends; returns how many are."""
        while (have := len(self._buf) - self._pos) < want:
            data = self._read1(max(_BUFFER, want - have))
            if not data:
                break
            self.received += len(data)
            self._buf = self._buf[self._pos :] + bytes(data)
            self._pos = 0
        return len(self._buf) - self._pos

    def _take(self, n: int) -> bytes:
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    def _short(self, missing: int) -> ConnectionError:
        return ConnectionError(
            f"the body ended early: {self.received} bytes in, a record wanted {missing} more"
        )

    def peek(self, n: int) -> bytes:
        self._fill(n)
        return self._buf[self._pos : self._pos + n]

    def read(self, n: int = -1) -> bytes | bytearray:
        """Exactly `n` bytes: the unpickler's reads and the small records."""
        if n is None or n < 0:
            return self.read_rest()
        if n <= _BUFFER:
            if self._fill(n) < n:
                raise self._short(n - (len(self._buf) - self._pos))
            return self._take(n)
        out = bytearray(n)
        with memoryview(out) as view:
            self.read_exactly_into(view)
        return out

    def read_exactly_into(self, view: memoryview) -> None:
        n = len(view)
        got = len(head := self._take(n))
        view[:got] = head
        while got < n:
            k = self._raw.readinto(view[got : min(n, got + SLICE)])
            if not k:
                raise self._short(n - got)
            self.received += k
            got += k

    def read_rest(self) -> bytearray:
        out = bytearray(self._take(len(self._buf)))
        while data := self._raw.read(SLICE):
            self.received += len(data)
            out += data
        return out

    def readline(self) -> bytes:
        while (cut := self._buf.find(b"\n", self._pos)) < 0:
            have = len(self._buf) - self._pos
            if self._fill(have + 1) == have:  # the body ended without a newline
                return self._take(have)
        return self._take(cut + 1 - self._pos)


class _DeadlineReader:
    """An HTTP response whose every read is bounded by the fetch's deadline."""

    def __init__(self, conn: http.client.HTTPConnection, response: Any, deadline: float) -> None:
        self._conn, self._response, self._deadline = conn, response, deadline
        self.received = 0

    def _bound(self) -> None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlinePassed("the deadline passed during the transfer")
        if self._conn.sock is not None:
            self._conn.sock.settimeout(remaining)

    def read(self, n: int) -> bytes:
        self._bound()
        data = bytes(self._response.read(n))
        self.received += len(data)
        return data

    def read1(self, n: int) -> bytes:
        self._bound()
        data = bytes(self._response.read1(n))
        self.received += len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        self._bound()
        k = int(self._response.readinto(view))
        self.received += k
        return k


def fetch(source: HealSource, step: int, deadline: float) -> tuple[Any, int]:
    """One attempt to fetch `step` from the torchft peer `source`; returns
    the state and the number of body bytes.

    Raises:
        NotReady: the peer answered a server error (torchft answers 500 when
            its state lock times out): worth retrying.
        Refused: any other refusal (another step is served: 400).
        UnsafeStateError, ValueError: the body cannot be loaded safely.
        OSError, http.client.HTTPException: the connection failed.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlinePassed("the deadline passed before the request")
    conn = http.client.HTTPConnection(source.host, source.port, timeout=remaining)
    try:
        # torchft checks no secret: ours is not sent
        conn.request("GET", source.state_path(step))
        response = conn.getresponse()
        if response.status != 200:
            body = response.read(4096).decode("utf-8", "replace")
            plain = response.getheader("Content-Type", "").startswith("text/plain")
            message = body.strip() if plain and body.strip() else response.reason
            if response.status >= 500:
                raise NotReady(f"answered HTTP {response.status}: {message}")
            raise Refused(response.status, message)
        reader = _DeadlineReader(conn, response, deadline)
        state = decode(reader, f"step {step} from {source.label} (key {KEY!r})")
        return state, reader.received
    finally:
        conn.close()
