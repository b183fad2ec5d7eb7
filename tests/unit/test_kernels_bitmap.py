"""The bitmap wire encoding of a compressed bucket (kernels/bitmap.py): exact round trips, and smaller
than the offsets it replaces only where it should be."""

import pytest
import torch

from kernels import compress, decompress_accumulate
from kernels.bitmap import bitmap_nbytes, decode_bitmap, encode_bitmap
from kernels.payload import SEGMENT
from tests.unit.test_kernels_compression import layered_gradient


def round_trip(bucket: torch.Tensor, k_ratio: float, block: int = 1024):
    mine = compress(bucket, torch.zeros(bucket.numel()), k_ratio, block)
    wire = encode_bitmap(mine)
    assert wire.numel() == bitmap_nbytes(mine.layout)
    return mine, decode_bitmap(wire, mine.layout)


@pytest.mark.parametrize("n, k_ratio, block", [
    (100_003, 0.25, 1024),          # a ragged last byte, block and segment
    (3 * SEGMENT, 0.06, 128),       # whole segments
    (SEGMENT + 5, 0.5, 4096),
    (50_000, 0.01, 1024),           # sparse: still exact, only larger than the offsets
])
def test_decoding_gives_back_the_payload_byte_for_byte(n, k_ratio, block):
    mine, decoded = round_trip(layered_gradient(n, seed=n), k_ratio, block)
    assert mine.sent() > 0
    assert torch.equal(decoded.payload, mine.payload)


def test_an_overflowing_selection_round_trips_with_its_clamped_segment_starts():
    g = torch.ones(3 * SEGMENT)
    g[::2] = -1.0  # every magnitude ties: all are selected, only `capacity` entries fit
    mine, decoded = round_trip(g, 0.05)
    selected, _ = mine.counts()
    assert selected == g.numel() and mine.sent() == mine.capacity
    assert torch.equal(decoded.payload, mine.payload)
    dense, again = torch.zeros(g.numel()), torch.zeros(g.numel())
    decompress_accumulate(dense, mine)
    decompress_accumulate(again, decoded)
    assert torch.equal(dense, again) and dense.count_nonzero() == mine.capacity


@pytest.mark.parametrize("n", [0, 7, 50_000])
def test_empty_and_all_zero_buckets(n):
    mine, decoded = round_trip(torch.zeros(n), 0.05)
    assert mine.counts() == (0, 0) and torch.equal(decoded.payload, mine.payload)


def test_the_bitmap_is_smaller_only_above_about_one_entry_in_sixteen():
    n = 1_000_000
    layouts = {k: compress(layered_gradient(n, seed=1), torch.zeros(n), k).layout for k in (0.03, 0.25)}
    assert bitmap_nbytes(layouts[0.03]) > layouts[0.03].nbytes
    assert bitmap_nbytes(layouts[0.25]) < 0.55 * layouts[0.25].nbytes  # 1/8 + 1 byte an entry, not 3


def test_a_wire_of_the_wrong_size_is_refused():
    mine = compress(torch.randn(10_000), torch.zeros(10_000), 0.2)
    with pytest.raises(ValueError, match=f"{bitmap_nbytes(mine.layout)} bytes"):
        decode_bitmap(torch.zeros(bitmap_nbytes(mine.layout) - 16, dtype=torch.uint8), mine.layout)


def test_decoding_into_a_row_of_the_gathered_payloads():
    mine = compress(layered_gradient(40_000, seed=5), torch.zeros(40_000), 0.3)
    rows = torch.zeros(2, mine.layout.nbytes, dtype=torch.uint8)
    decoded = decode_bitmap(encode_bitmap(mine), mine.layout, out=rows[1])
    assert decoded.payload.data_ptr() == rows[1].data_ptr()
    assert torch.equal(rows[1], mine.payload) and not rows[0].any()
