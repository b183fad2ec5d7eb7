"""Triton kernels for the top-k hook's Elias–Fano wire (kernels.wire); CUDA tensors only.

They give the same bytes as the torch twins in kernels/wire.py, with a handful of launches
instead of about fifty (the twins' launches cost more host time than the hook can spare).

encode  a program per segment of the payload (SEGMENT elements) turns its entries' offsets into
        places, keeps each place in a scratch array and sets its unary bit (place >> L) + j with
        an atomic OR (entries of one 32-bit word come from one or two segments); then a program
        per WORDS words of the low stream gathers the L low bits of the places that word holds
decode  a program per WORDS words of a row's unary code counts the set bits; a cumsum of the
        counts gives each program the entry number of its first set bit, and the program turns
        its set bits into entries: offset in its segment (for the payload), place (for the
        segment starts, found by one batched searchsorted), low bits read from the low stream
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.payload import HEADER_BYTES, SEGMENT, CompressedBucket, PayloadLayout
from kernels.triton_kernels import _on_device

_SEGMENT = tl.constexpr(SEGMENT)
ENCODE_ENTRIES = 256
"""Entries an encoding program turns into places per pass over its segment."""
WORDS = 64
"""32-bit words of a bit stream per packing or decoding program (2,048 bits)."""
_NO_PLACE = 2**31 - 1
"""Scratch place of an entry not sent: after every real place, so searchsorted counts past none."""


@triton.jit
def _encode_places_kernel(offsets_ptr, starts_ptr, header_ptr, places_ptr, unary_ptr, segments, capacity, low_bits,
                          ENTRIES: tl.constexpr):
    segment = tl.program_id(0)
    sent = tl.minimum(tl.load(header_ptr), capacity)
    first = tl.minimum(tl.load(starts_ptr + segment), sent)
    after = tl.load(starts_ptr + segment + 1, mask=segment + 1 < segments, other=sent)
    last = tl.maximum(tl.minimum(after, sent), first)
    for chunk in range(first, last, ENTRIES):
        entry = chunk + tl.arange(0, ENTRIES)
        mask = entry < last
        place = segment * _SEGMENT + tl.load(offsets_ptr + entry, mask=mask, other=0).to(tl.int32)
        tl.store(places_ptr + entry, place, mask=mask)
        unary_bit = (place >> low_bits) + entry
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


def encode(bucket: CompressedBucket, wire: torch.Tensor, low: int, high: int, low_bits: int) -> None:
    """Writes bucket's places into `wire` (zeroed): the low stream at byte `low`, the unary code at `high`."""
    layout, device = bucket.layout, bucket.payload.device
    if not layout.capacity:
        return
    places = torch.empty(layout.capacity, dtype=torch.int32, device=device)
    header = bucket.header
    with _on_device(wire):
        _encode_places_kernel[(layout.num_segments,)](
            bucket.indices, bucket.segment_starts, header, places, wire[high:].view(torch.int32),
            layout.num_segments, layout.capacity, low_bits, ENTRIES=ENCODE_ENTRIES)
        low_words = -(-layout.capacity * low_bits // 32)
        if low_words:
            _pack_low_bits_kernel[(triton.cdiv(low_words, WORDS),)](
                places, header, wire[low:high].view(torch.int32), low_words, layout.capacity, low_bits, WORDS=WORDS)


@triton.jit
def _unary_bits(wires_ptr, row, row_words, high_word, high_words, WORDS: tl.constexpr):
    """(bits, bit positions) of one program's WORDS words of a row's unary code, flattened in bit order."""
    word = tl.program_id(1) * WORDS + tl.arange(0, WORDS)[:, None]
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
def _decode_entries_kernel(wires_ptr, firsts_ptr, offsets_ptr, places_ptr, row_words, high_word, high_words,
                           low_word, low_words, programs, payload_halves, capacity, numel, low_bits,
                           WORDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bits, position = _unary_bits(wires_ptr, row, row_words, high_word, high_words, WORDS)
    entry = tl.load(firsts_ptr + row * programs + tl.program_id(1)) + tl.cumsum(bits, axis=0) - bits
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


def decode_places(wires: torch.Tensor, payloads: torch.Tensor, layout: PayloadLayout, low: int, high: int,
                  high_bits: int, low_bits: int) -> None:
    """Writes each row's offsets and segment starts into `payloads` (zeroed) from the rows of `wires`."""
    rows, capacity, device = wires.shape[0], layout.capacity, wires.device
    if not capacity:
        return
    row_words, high_words = wires.shape[1] // 4, -(-high_bits // 32)
    programs = triton.cdiv(high_words, WORDS)
    words = wires.view(torch.int32)
    counts = torch.empty(rows, programs, dtype=torch.int32, device=device)
    places = torch.full((rows, capacity), _NO_PLACE, dtype=torch.int32, device=device)
    with _on_device(wires):
        _count_unary_kernel[(rows, programs)](words, counts, row_words, high // 4, high_words, programs, WORDS=WORDS)
        firsts = (torch.cumsum(counts, 1, dtype=torch.int32) - counts).contiguous()
        _decode_entries_kernel[(rows, programs)](
            words, firsts, payloads.view(torch.int16)[:, HEADER_BYTES // 2:], places, row_words, high // 4,
            high_words, low // 4, -(-capacity * low_bits // 32), programs, payloads.shape[1] // 2, capacity,
            layout.numel, low_bits, WORDS=WORDS)
    bounds = (torch.arange(layout.num_segments, dtype=torch.int32, device=device) * SEGMENT).expand(rows, -1)
    starts = payloads[:, layout.starts_offset:layout.starts_offset + 4 * layout.num_segments].view(torch.int32)
    starts.copy_(torch.searchsorted(places, bounds.contiguous()).clamp_(max=capacity))
