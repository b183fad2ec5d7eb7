"""The top-k hook's wire encoding (kernels/wire.py): exact round trips, and the size Elias–Fano promises."""

import math

import pytest
import torch

from kernels import compress, decompress_accumulate
from kernels.compression import payload_layout
from kernels.payload import SEGMENT
from kernels.wire import WireLayout, decode_wires, encode_wire, wire_nbytes
from tests.unit.test_kernels_compression import layered_gradient


def round_trip(bucket: torch.Tensor, k_ratio: float, block: int = 1024):
    mine = compress(bucket, torch.zeros(bucket.numel()), k_ratio, block)
    wire = encode_wire(mine)
    assert wire.numel() == wire_nbytes(mine.layout)
    return mine, mine.with_payload(decode_wires(wire.unsqueeze(0), mine.layout)[0])


@pytest.mark.parametrize("n, k_ratio, block", [
    (100_003, 0.25, 1024),          # a ragged last byte, block and segment
    (3 * SEGMENT, 0.06, 128),       # whole segments
    (SEGMENT + 5, 0.5, 4096),       # no low bits: more entries than half the elements
    (50_000, 0.01, 1024),           # six low bits an entry
    (200_000, 0.001, 1024),         # nine
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


def test_all_rows_of_a_gather_decode_in_one_call():
    n = 60_000
    payloads = [compress(layered_gradient(n, seed=s), torch.zeros(n), 0.04) for s in range(3)]
    wires = torch.stack([encode_wire(p) for p in payloads])
    decoded = decode_wires(wires, payloads[0].layout)
    assert decoded.shape == (3, payloads[0].layout.nbytes)
    for row, payload in zip(decoded, payloads):
        assert torch.equal(row, payload.payload)


@pytest.mark.parametrize("k_ratio", [0.003, 0.01, 0.03, 0.1, 0.25])
def test_a_place_costs_at_most_two_bits_more_than_log2_of_the_spacing(k_ratio):
    n = 4_000_000
    layout = payload_layout(n, k_ratio)
    shape = WireLayout.of(layout)
    place_bits = 8 * (shape.values - shape.low)
    assert place_bits <= layout.capacity * (2 + math.log2(n / layout.capacity)) + 256
    # ...so the wire is smaller than the payload's 2-byte offsets, and than a bitmap of the bucket below 25 %
    assert wire_nbytes(layout) < layout.nbytes
    if k_ratio < 0.25:
        assert place_bits < n


def test_a_place_past_the_bucket_is_dropped_and_the_rest_decodes_exactly():
    """A corrupted wire: one more unary bit, at the end, names a place past the bucket's end."""
    mine = compress(layered_gradient(20_000, seed=4), torch.zeros(20_000), 0.05)
    assert mine.sent() < mine.capacity
    wire = encode_wire(mine)
    shape = WireLayout.of(mine.layout)
    last = shape.high_bits - 1
    wire[shape.high + last // 8] |= 1 << (last % 8)
    assert torch.equal(decode_wires(wire.unsqueeze(0), mine.layout)[0], mine.payload)


def test_a_row_with_more_entries_than_capacity_keeps_the_other_rows_whole():
    """A corrupted row whose unary code is all ones: its bits past capacity are dropped, and no
    other rank's row moves."""
    rows = [compress(layered_gradient(30_000, seed=s), torch.zeros(30_000), 0.02) for s in range(3)]
    wires = torch.stack([encode_wire(r) for r in rows])
    shape = WireLayout.of(rows[0].layout)
    wires[0, shape.high:shape.values] = 255
    decoded = decode_wires(wires, rows[0].layout)
    assert torch.equal(decoded[1], rows[1].payload) and torch.equal(decoded[2], rows[2].payload)
    garbled = rows[0].with_payload(decoded[0])
    assert bool((garbled.element_indices() < garbled.numel).all())


def test_a_wire_of_the_wrong_size_is_refused():
    mine = compress(torch.randn(10_000), torch.zeros(10_000), 0.2)
    with pytest.raises(ValueError, match=f"{wire_nbytes(mine.layout)} bytes a row"):
        decode_wires(torch.zeros(2, wire_nbytes(mine.layout) - 16, dtype=torch.uint8), mine.layout)
