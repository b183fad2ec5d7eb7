"""Triton kernels for the top-k hook's Elias–Fano wire (kernels.wire); CUDA tensors only.

They give the same bytes as the torch twins in kernels/wire.py with five Triton kernels and a few
memsets and copies, instead of about fifty torch ops: the hook runs eagerly once per bucket, so
each launch is host time in every step.

encode  a program per segment of the payload (SEGMENT elements) copies its scales and its entries'
        codes, turns its entries' offsets into places, keeps each place in a scratch array and sets
        its unary bit (place >> L) + j with an atomic OR; then a program per WORDS words of the low
        stream gathers the L low bits of the places that word holds
decode  a program per WORDS words of a row's unary code counts its set bits; a second pass gives
        each program the entry number of its first set bit (the counts of the programs before it)
        and turns its set bits into entries: offset in its segment for the payload, place into a
        scratch row, low bits read from the low stream; a binary search of each row's places then
        finds where every segment's entries begin
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.payload import HEADER_BYTES, SEGMENT, CompressedBucket, PayloadLayout
from kernels.triton_kernels import _on_device

if TYPE_CHECKING:  # for annotations only: kernels.wire is what imports this module
    from kernels.wire import WireLayout

_SEGMENT = tl.constexpr(SEGMENT)
ENCODE_ENTRIES = 256
"""Entries an encoding program turns into places per pass over its segment."""
WORDS = 64
"""32-bit words of a bit stream per packing or decoding program (2,048 bits)."""
STARTS_SEGMENTS = 128
"""Segments whose first entry one program searches for."""
_NO_PLACE = 2**31 - 1
"""Scratch place of an entry not sent: after every real place, so the search for a segment's first
entry passes none."""


@triton.jit
def _encode_segment_kernel(offsets_ptr, starts_ptr, header_ptr, values_ptr, scales_ptr, places_ptr, wire_header_ptr,
                           wire_values_ptr, wire_scales_ptr, unary_ptr, segments, capacity, num_blocks, low_bits,
                           ENTRIES: tl.constexpr, BLOCKS_PER_SEGMENT: tl.constexpr):
    segment = tl.program_id(0)
    four = tl.arange(0, 4)
    tl.store(wire_header_ptr + four, tl.load(header_ptr + four), mask=(four < 4) & (segment == 0))
    block = segment * BLOCKS_PER_SEGMENT + tl.arange(0, BLOCKS_PER_SEGMENT)
    tl.store(wire_scales_ptr + block, tl.load(scales_ptr + block, mask=block < num_blocks), mask=block < num_blocks)
    sent = tl.minimum(tl.load(header_ptr), capacity)
    first = tl.minimum(tl.load(starts_ptr + segment), sent)
    after = tl.load(starts_ptr + segment + 1, mask=segment + 1 < segments, other=sent)
    last = tl.maximum(tl.minimum(after, sent), first)
    for chunk in range(first, last, ENTRIES):
        entry = chunk + tl.arange(0, ENTRIES)
        mask = entry < last
        place = segment * _SEGMENT + tl.load(offsets_ptr + entry, mask=mask, other=0).to(tl.int32)
        tl.store(places_ptr + entry, place, mask=mask)
        tl.store(wire_values_ptr + entry, tl.load(values_ptr + entry, mask=mask), mask=mask)
        unary_bit = (place >> low_bits).to(tl.int64) + entry  # past 2**31 for dense buckets near MAX_NUMEL
        tl.atomic_or(unary_ptr + (unary_bit >> 5), (1 << (unary_bit & 31)).to(tl.int32), mask=mask, sem="relaxed")


@triton.jit
def _pack_low_bits_kernel(places_ptr, header_ptr, low_ptr, low_words, capacity, low_bits, WORDS: tl.constexpr):
    sent = tl.minimum(tl.load(header_ptr), capacity)
    word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    bit_in_word = tl.arange(0, 32)[None, :]
    stream_bit = word[:, None] * 32 + bit_in_word
    entry = stream_bit // low_bits
    place = tl.load(places_ptr + entry, mask=entry < sent, other=0)
    bit = (place >> (stream_bit % low_bits).to(tl.int32)) & 1
    tl.store(low_ptr + word, tl.sum(bit << bit_in_word, axis=1), mask=word < low_words)


def encode(bucket: CompressedBucket, wire: torch.Tensor, shape: WireLayout) -> None:
    """Writes bucket's wire (kernels.wire.WireLayout `shape`) into `wire`, zeroed."""
    layout = bucket.layout
    if not layout.numel:
        return
    places = torch.empty(max(layout.capacity, 1), dtype=torch.int32, device=wire.device)
    header = bucket.header
    with _on_device(wire):
        _encode_segment_kernel[(layout.num_segments,)](
            bucket.indices, bucket.segment_starts, header, bucket.values, bucket.scales, places,
            wire[:HEADER_BYTES].view(torch.int32), wire[shape.values:shape.values + layout.capacity].view(torch.int8),
            wire[shape.scales:shape.nbytes].view(torch.float32), wire[shape.high:].view(torch.int32),
            layout.num_segments, layout.capacity, layout.num_blocks, shape.low_bits, ENTRIES=ENCODE_ENTRIES,
            BLOCKS_PER_SEGMENT=SEGMENT // layout.block)
        if shape.low_words:
            _pack_low_bits_kernel[(triton.cdiv(shape.low_words, WORDS),)](
                places, header, wire[shape.low:shape.high].view(torch.int32), shape.low_words, layout.capacity,
                shape.low_bits, WORDS=WORDS)


@triton.jit
def _unary_bits(wires_ptr, row, row_words, high_word, high_words, WORDS: tl.constexpr):
    """(bits, bit positions) of one program's WORDS words of a row's unary code, flattened in bit order."""
    word = tl.program_id(1).to(tl.int64) * WORDS + tl.arange(0, WORDS)[:, None]
    bits = tl.load(wires_ptr + row * row_words + high_word + word, mask=word < high_words, other=0)
    bits = (bits >> tl.arange(0, 32)[None, :]) & 1
    position = word * 32 + tl.arange(0, 32)[None, :]
    return tl.reshape(bits, (WORDS * 32,)), tl.reshape(position, (WORDS * 32,))


@triton.jit
def _count_unary_kernel(wires_ptr, counts_ptr, row_words, high_word, high_words, programs, WORDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bits, _ = _unary_bits(wires_ptr, row, row_words, high_word, high_words, WORDS)
    tl.store(counts_ptr + row * programs + tl.program_id(1), tl.sum(bits, axis=0))


@triton.jit
def _decode_entries_kernel(wires_ptr, counts_ptr, offsets_ptr, places_ptr, row_words, high_word, high_words,
                           low_word, low_words, programs, payload_halves, capacity, numel, low_bits,
                           WORDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    program = tl.program_id(1)
    bits, position = _unary_bits(wires_ptr, row, row_words, high_word, high_words, WORDS)
    # Entry number of this program's first set bit: the set bits of the programs before it.
    first = program * 0
    for before in range(0, program, 1024):
        earlier = before + tl.arange(0, 1024)
        first += tl.sum(tl.load(counts_ptr + row * programs + earlier, mask=earlier < program, other=0))
    entry = first + tl.cumsum(bits, axis=0) - bits
    is_entry = (bits == 1) & (entry < capacity)
    # Entry j's low bits start at bit j * L of the low stream and span at most two words.
    low_bit = entry.to(tl.int64) * low_bits
    low_at = low_word + (low_bit >> 5)
    words = row * row_words + low_at
    has_low = is_entry & (low_bits > 0)
    below = tl.load(wires_ptr + words, mask=has_low, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
    above = tl.load(wires_ptr + words + 1, mask=has_low & (low_at + 1 < low_word + low_words), other=0)
    pair = below | (above.to(tl.uint32, bitcast=True).to(tl.int64) << 32)
    low = (pair >> (low_bit & 31)) & ((1 << low_bits) - 1)
    place = ((position - entry).to(tl.int64) << low_bits) | low
    is_entry &= place < numel  # a corrupted place is dropped, never written out of range
    tl.store(offsets_ptr + row * payload_halves + entry, (place % _SEGMENT).to(tl.int16), mask=is_entry)
    tl.store(places_ptr + row * capacity + entry, place.to(tl.int32), mask=is_entry)


@triton.jit
def _segment_starts_kernel(places_ptr, starts_ptr, payload_words, capacity, segments, search_steps,
                           SEGMENTS: tl.constexpr):
    """Each segment's first entry: the first place at or past the segment's start (a binary search
    of the row's places, which rise; unsent entries hold _NO_PLACE)."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1) * SEGMENTS + tl.arange(0, SEGMENTS)
    bound = segment * _SEGMENT
    low = tl.zeros((SEGMENTS,), tl.int32)
    high = tl.zeros((SEGMENTS,), tl.int32) + capacity
    for _ in range(search_steps):
        searching = low < high
        middle = low + ((high - low) >> 1)
        place = tl.load(places_ptr + row * capacity + middle, mask=searching, other=0)
        below = searching & (place < bound)
        low = tl.where(below, middle + 1, low)
        high = tl.where(searching & ~below, middle, high)
    tl.store(starts_ptr + row * payload_words + segment, low, mask=segment < segments)


def decode_places(wires: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, shape: WireLayout) -> None:
    """Writes each row's offsets and segment starts into `payloads` (zeroed) from the rows of `wires`."""
    rows, capacity, device = wires.shape[0], layout.capacity, wires.device
    if not capacity:
        return
    row_words, high_words = wires.shape[1] // 4, shape.high_words
    programs = triton.cdiv(high_words, WORDS)
    words = wires.view(torch.int32)
    counts = torch.empty(rows, programs, dtype=torch.int32, device=device)
    places = torch.full((rows, capacity), _NO_PLACE, dtype=torch.int32, device=device)
    segments = layout.num_segments
    with _on_device(wires):
        _count_unary_kernel[(rows, programs)](words, counts, row_words, shape.high // 4, high_words, programs,
                                              WORDS=WORDS)
        _decode_entries_kernel[(rows, programs)](
            words, counts, payloads.view(torch.int16)[:, HEADER_BYTES // 2:], places, row_words, shape.high // 4,
            high_words, shape.low // 4, shape.low_words, programs, payloads.shape[1] // 2,
            capacity, layout.numel, shape.low_bits, WORDS=WORDS)
        _segment_starts_kernel[(rows, triton.cdiv(segments, STARTS_SEGMENTS))](
            places, payloads.view(torch.int32)[:, layout.starts_offset // 4:], payloads.shape[1] // 4, capacity,
            segments, capacity.bit_length() + 1, SEGMENTS=STARTS_SEGMENTS)
