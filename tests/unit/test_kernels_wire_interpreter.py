"""The Elias-Fano wire's Triton kernels (kernels/triton_wire.py), run by Triton's CPU interpreter,
against their torch twins in kernels/wire.py: the same wire bytes, the same decoded payloads.

Skips where triton is not installed (`make test` installs it; under CI=true a skip fails);
tests/gpu/test_kernels_triton.py runs the compiled kernels on a GPU."""

import importlib.util

import pytest

from tests.interpreter_support import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed; install it to check the kernels in its interpreter")

SCRIPT = r"""
import json, torch

from kernels import compress, triton_wire
from kernels.payload import SEGMENT
from kernels.wire import WireLayout, decode_places_twin, encode_twin

results = []
# Six low bits an entry; none (over half the elements sent); a ragged last segment; an overflowing
# selection (every magnitude ties); all zero (nothing sent).
for numel, k_ratio, kind in [(50_000, 0.01, "randn"), (3 * SEGMENT + 5, 0.6, "randn"), (100_003, 0.2, "randn"),
                             (2 * SEGMENT, 0.05, "ties"), (20_000, 0.05, "zeros")]:
    gen = torch.Generator().manual_seed(numel)
    bucket = {"randn": lambda: torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen),
              "ties": lambda: torch.ones(numel), "zeros": lambda: torch.zeros(numel)}[kind]()
    payloads = [compress(sign * bucket, torch.zeros(numel), k_ratio) for sign in (1.0, -0.5, 2.0)]
    layout, shape = payloads[0].layout, WireLayout.of(payloads[0].layout)
    wires, twins = [], []
    for payload in payloads:
        got, want = (torch.zeros(shape.nbytes, dtype=torch.uint8) for _ in range(2))
        triton_wire.encode(payload, got, shape)
        encode_twin(payload, want, shape)
        wires.append(got)
        twins.append(want)
    rows = torch.stack(wires)
    decoded, decoded_twin = (torch.zeros(3, layout.nbytes, dtype=torch.uint8) for _ in range(2))
    triton_wire.decode_places(rows, decoded, layout, shape)
    decode_places_twin(rows, decoded_twin, layout, shape)
    # decode_places writes only offsets and starts; the payloads' other bytes are copied by decode_wires.
    places = lambda p: torch.cat([p[:, 16:layout.values_offset], p[:, layout.starts_offset:]], 1)  # noqa: E731
    originals = torch.stack([p.payload for p in payloads])
    # One more unary bit at the end of row 0 names a place past the bucket: both drop it.
    last = shape.high_bits - 1
    rows[0, shape.high + last // 8] |= 1 << (last % 8)
    extra, extra_twin = (torch.zeros(3, layout.nbytes, dtype=torch.uint8) for _ in range(2))
    triton_wire.decode_places(rows, extra, layout, shape)
    decode_places_twin(rows, extra_twin, layout, shape)
    results.append({"case": f"{numel} {k_ratio} {kind}", "encode": all(map(torch.equal, wires, twins)),
                    "corrupted": torch.equal(extra, extra_twin) and torch.equal(extra, decoded),
                    "decode": torch.equal(decoded, decoded_twin),
                    "round_trip": torch.equal(places(decoded), places(originals)),
                    "sent": payloads[0].sent()})
print(json.dumps(results))
"""


def test_triton_wire_kernels_match_their_twins_in_the_interpreter():
    results = run_interpreted(SCRIPT)
    assert len(results) == 5
    for row in results:
        assert row["encode"] and row["decode"] and row["round_trip"] and row["corrupted"], row
    assert results[0]["sent"] > 0 and results[-1]["sent"] == 0
