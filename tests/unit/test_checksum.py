"""Which received tensor segments a receiver must refuse, and the checksum functions."""

from __future__ import annotations

import zlib

import pytest

from torchft_like.checkpointing import checksum

TWO_STREAMS = [[(0, 0, 10), (1, 0, 5)], [(1, 5, 5)]]


@pytest.mark.parametrize(
    "sent, received, bad",
    [
        ([[7, 8], [9]], {(0, 0): 7, (0, 1): 8, (1, 1): 9}, []),
        ([[7, 8], [9]], {(0, 0): 7, (0, 1): 6, (1, 1): 9}, [((1, 0, 5), 6, 8)]),
        ([[7, 8], [9]], {(0, 0): 7, (0, 1): 8}, [((1, 5, 5), 0, 9)]),
        ([[1, 8], [2]], {(0, 0): 7, (0, 1): 8, (1, 1): 9}, [((0, 0, 10), 7, 1), ((1, 5, 5), 9, 2)]),
    ],
    ids=["all match", "one differs", "a stream that never arrived", "two differ in order"],
)
def test_mismatches_names_each_segment_whose_checksum_differs(sent, received, bad):
    assert checksum.mismatches(TWO_STREAMS, sent, received) == bad


def test_a_trailer_with_the_wrong_number_of_checksums_is_a_value_error():
    with pytest.raises(ValueError, match="stream 1 has 1 segments but 2 checksums"):
        checksum.mismatches(TWO_STREAMS, [[7, 8], [9, 9]], {})


@pytest.mark.parametrize("name", sorted(checksum.ALGORITHMS))
def test_a_checksum_fed_in_slices_equals_the_checksum_of_the_whole(name):
    update = checksum.updater(name)
    data = memoryview(bytes(range(256)) * 1000)
    crc = 0
    for lo in range(0, len(data), 4096):
        crc = update(data[lo : lo + 4096], crc)

    assert crc == update(data, 0)


def test_the_sender_uses_crc32c_when_the_package_is_installed():
    assert checksum.DEFAULT == "crc32c"
    assert checksum.updater("crc32")(memoryview(b"abc"), 0) == zlib.crc32(b"abc")


def test_an_unknown_checksum_is_refused_naming_the_ones_known():
    with pytest.raises(ValueError, match=r"checksum 'md5' is not available here \(have \["):
        checksum.updater("md5")
