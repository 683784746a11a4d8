"""A heal source parsed once from its metadata, and the one rule for one
source or several (torchft_like.checkpointing.heal_source). Pure: no sockets."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from torchft_like.checkpointing.heal_source import (
    KEY,
    OWN_PATH,
    TORCHFT_PATH,
    BadMetadata,
    HealSource,
    heal_fetch,
    stripe_cap,
)

OURS = "http://a:1" + OWN_PATH
TORCHFT = "http://t:9" + TORCHFT_PATH


# fmt: off
@pytest.mark.parametrize("metadata, where, torchft, base_url", [
    ("http://vm:1234/torchft_like/checkpoint/", ("http", "vm", 1234), False, "http://vm:1234"),
    ("http://vm:1234/checkpoint/", ("http", "vm", 1234), True, "http://vm:1234"),
    ("http://[::1]:1234/checkpoint/", ("http", "::1", 1234), True, "http://[::1]:1234"),
    ("https://[::2]:7/torchft_like/checkpoint/", ("https", "::2", 7), False, "https://[::2]:7"),
    ("http://127.0.0.1:1234", ("http", "127.0.0.1", 1234), False, "http://127.0.0.1:1234"),
    ("https://127.0.0.1:1234/", ("https", "127.0.0.1", 1234), False, "https://127.0.0.1:1234"),
    ("HTTP://Node-3:80/checkpoint/", ("http", "node-3", 80), True, "http://node-3:80"),
])
# fmt: on
def test_metadata_is_parsed_into_what_each_layer_reads(metadata, where, torchft, base_url):
    source = HealSource.parse(3, metadata)
    assert (source.replica_rank, source.metadata) == (3, metadata)  # the wire form, kept
    assert (source.scheme, source.host, source.port) == where
    assert source.torchft is torchft
    assert source.base_url == base_url
    path = "/checkpoint/5/full" if torchft else "/checkpoint/5"  # torchft's scheme, or ours
    assert source.state_path(5) == path
    assert source.state_url(5) == base_url + path
    kind = "torchft replica rank" if torchft else "replica rank"
    assert source.label == f"{kind} 3 at {metadata}"


# fmt: off
@pytest.mark.parametrize("metadata, why", [
    ("", "has no scheme"),
    ("127.0.0.1:80", "has no scheme"),
    ("vm:1234/checkpoint/", "has scheme 'vm'"),
    ("ftp://h:1/checkpoint/", "has scheme 'ftp'"),
    ("http://:1/checkpoint/", "names no host"),
    ("http://h/checkpoint/", "names no port"),
    ("http://h:0/checkpoint/", "has port 0"),
    ("http://h:x/checkpoint/", "does not parse: Port could not be cast"),
    ("http://h:70000/checkpoint/", "does not parse: Port out of range"),
    ("http://[::1/checkpoint/", "does not parse: Invalid IPv6 URL"),
    ("http://h:1/checkpoint", "has path '/checkpoint'"),
    ("http://h:1/other/", "has path '/other/'"),
    ("http://h:1/checkpoint/5/full", "has path '/checkpoint/5/full'"),
    ("http://h:1/checkpoint/?x=1", "carries a user, a query or a fragment"),
    ("http://h:1/checkpoint/#f", "carries a user, a query or a fragment"),
    ("http://u@h:1/checkpoint/", "carries a user, a query or a fragment"),
])
# fmt: on
def test_bad_metadata_is_a_value_error_naming_it_what_is_wrong_and_what_is_taken(metadata, why):
    with pytest.raises(BadMetadata) as e:
        HealSource.parse(2, metadata)
    assert isinstance(e.value, ValueError)
    message = str(e.value)
    assert message.startswith(f"checkpoint metadata {metadata!r} of replica rank 2 {why}")
    assert f"http(s)://host:port{OWN_PATH} (torchft_like)" in message
    assert f"http(s)://host:port{TORCHFT_PATH} (torchft)" in message


@pytest.mark.parametrize("metadata", [TORCHFT, "http://h:1" + OWN_PATH])
def test_a_torchft_peer_gets_the_url_its_own_receiver_builds(metadata):
    """torchft's receiver appends `{step}/full` to any metadata; ours asks a
    torchft peer for exactly that, and our server answers it under our path."""
    source = HealSource.parse(0, metadata)
    torchfts_url = f"{metadata}5/{KEY}"
    if source.torchft:
        assert source.state_url(5) == torchfts_url
    else:
        assert torchfts_url == source.base_url + OWN_PATH + f"5/{KEY}"


def test_a_source_is_a_frozen_value():
    source = HealSource.parse(0, OURS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.port = 2  # type: ignore[misc]
    assert source == HealSource.parse(0, OURS)


def test_the_rule_imports_nothing_that_does_io():
    """Pure: no torch, no sockets, so a unit test or a type check needs none."""
    import torchft_like.checkpointing.heal_source as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported == {"__future__", "collections.abc", "dataclasses", "urllib.parse"}


def sources(*metadata: str) -> list[HealSource]:
    return [HealSource.parse(rank, m) for rank, m in enumerate(metadata)]


# fmt: off
@pytest.mark.parametrize("name, given, striped, ranks", [
    ("one source", [OURS], False, [0]),
    ("several distinct", [OURS, "http://b:2/", "http://c:3" + OWN_PATH], True, [0, 1, 2]),
    ("the same server twice is one", [OURS, OURS], False, [0]),
    ("duplicates collapse to the first rank", [OURS, OURS, "http://b:2/"], True, [0, 2]),
    ("a torchft peer first: it alone", [TORCHFT, OURS, "http://b:2/"], False, [0]),
    ("a torchft peer later: the first alone", [OURS, TORCHFT], False, [0]),
    ("only torchft peers: the first", [TORCHFT, "http://u:8/checkpoint/"], False, [0]),
])
# fmt: on
def test_one_source_or_several(name, given, striped, ranks):
    fetch = heal_fetch(sources(*given))
    assert fetch.striped is striped, name
    assert [s.replica_rank for s in fetch.sources] == ranks, name
    assert fetch.first.replica_rank == 0


def test_a_fetch_from_no_source_is_refused():
    with pytest.raises(ValueError, match="at least one source"):
        heal_fetch([])


# fmt: off
@pytest.mark.parametrize("can_stripe, heal_sources, expected", [
    (True, None, None),  # every up-to-date peer
    (True, 3, 3),
    (True, 1, 1),  # one peer, as torchft
    (False, None, 1),  # a push transport (PGTransport): one source, which sends to its own
    (False, 3, 1),
])
# fmt: on
def test_the_plans_stripe_cap(can_stripe, heal_sources, expected):
    assert stripe_cap(can_stripe, heal_sources) == expected
