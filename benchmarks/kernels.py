"""Compression kernels against their named baselines, measured in the same run on one CUDA GPU.

    python3 benchmarks/kernels.py                              # fp32 buckets of 25, 100, 400, 1000 MB, k = 1 %
    python3 benchmarks/kernels.py --sizes-mb 25 100 --k-ratio 0.01
    python3 benchmarks/kernels.py --sweep                      # every tuning of the Triton kernels, same buffers

Per bucket size:
  copy        the baseline: dst.copy_(src) of the bucket; its bandwidth counts bytes read + written
  compress    compress(bucket, residual, k_ratio, check_finite=False), the comm-hook path; bytes =
              bucket read + residual read and written + payload written. Every replay compresses
              the same state: the residuals are restored before it (untimed, then 256 MB written so
              none is left in L2); without that, each replay would add the bucket to its residual
              once more, and later replays would time ever larger residuals
  decompress  decompress_accumulate(dense, payload); bytes = payload entries, scales and starts read + 8 per
              entry (its dense fp32 element read and written). At k = 1 % entries are ~100 elements
              apart, so each costs DRAM a 32-byte sector both ways: "sector GB/s" counts that
  dense       decompress_sum of one payload: the bucket written whole (zeros and values); bytes = valid
              payload bytes read + the fp32 bucket written once
  sum         decompress_sum of 8 payloads (an all-gather over 8 ranks) into the bucket, against the
              row-by-row path (zero an fp32 sum, decompress_accumulate each row, divide, copy); bytes =
              valid payload bytes read + the fp32 bucket written once
  wire        the top-k hook's Elias-Fano wire (kernels.wire): encode_wire of one payload and decode_wires
              of 8 gathered rows, against compress of the same bucket (the hook runs all three each
              step), in graphs and eager back to back (Python launch cost included, as in the hook);
              "wire of payload" is the bytes sent against the payload's
  topk        topk_by_magnitude(x, k) against the baseline torch.topk(|x|, k, sorted=False) with |x|
              computed beforehand: device time (both in CUDA graphs; ours without the final wait
              for the count) and eager time (each call waited for, Python included); "kept" is
              the count returned over k, and "exact" whether they are exactly the largest that many
Bandwidth timing captures one call per buffer set in a CUDA graph (sets rotate so L2 never holds a
bucket from the last call; the graph removes Python's launch cost), warms up, and reports the
median of many replays; the copy baseline takes the faster of that and back-to-back eager calls.
"eager us" is compress called back to back without a graph, Python launch cost included, each pass
over the sets from restored residuals.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
import kernels as kp  # noqa: E402
from kernels import reference  # noqa: E402
from kernels import triton_kernels as tk
from kernels.compression import DEFAULT_BLOCK  # noqa: E402
from kernels.payload import PayloadLayout, allocate  # noqa: E402
from kernels.selection import SelectionPlan  # noqa: E402
from kernels.wire import decode_wires, encode_wire  # noqa: E402

RANKS = 8
"""Payloads summed by decompress_sum per call, as after an all-gather over 8 ranks."""
L2_EVICT_BYTES = 256 * 2**20
"""Written between replays that restore residuals: several times an H200's 50 MB of L2."""
ROTATE_BYTES = 1 << 30
"""Buffers cycled through per size, so each call finds its inputs in DRAM, not the 60 MB L2."""


def selected(backend: ModuleType, x: torch.Tensor, residual: torch.Tensor | None, k_ratio: float):
    """One selection by `backend` (kernels.triton_kernels, or kernels.reference: the twin the Triton
    kernel must match bit for bit), without compress()'s or topk_by_magnitude()'s final wait for the
    counts, which no CUDA graph holds: compress with a residual, top-k without."""
    plan = SelectionPlan.for_ratio(x.numel(), k_ratio)
    layout = PayloadLayout(x.numel(), plan.capacity, torch.int8 if residual is not None else x.dtype,
                           DEFAULT_BLOCK if residual is not None else None)
    out, workspace = allocate(layout, plan, x.device)
    backend.select(x, residual, plan, out, workspace)
    return out


def graph_seconds(calls: list[Callable[[], object]], replays: int = 30,
                  before_each: Callable[[], object] | None = None) -> float:
    """Median seconds per call: all calls captured in one CUDA graph, replayed `replays` times
    (each after before_each(), untimed, when given)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # warm-up: compiles kernels and fills the allocator's cache
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        if before_each:
            before_each()
        times.append(_timed(graph.replay))
    return statistics.median(times) / len(calls)


def eager_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call, run and waited for one at a time, after two warm-up calls."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    return statistics.median(_timed(call) for _ in range(repeats))


def _timed(call: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def back_to_back_seconds(calls: list[Callable[[], object]], rounds: int = 10,
                         before_each: Callable[[], object] | None = None) -> float:
    """Seconds per call over `rounds` passes through calls without waiting between them; with
    before_each, run untimed before each pass, the median pass's."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    if before_each is None:
        return _timed(lambda: [call() for _ in range(rounds) for call in calls]) / (rounds * len(calls))
    times = []
    for _ in range(rounds):
        before_each()
        times.append(_timed(lambda: [call() for call in calls]))
    return statistics.median(times) / len(calls)


@dataclass
class Buffers:
    """Random-normal fp32 buckets and 1e-3-scale residuals, enough sets to rotate through 1 GiB."""
    numel: int
    buckets: list[torch.Tensor]
    residuals: list[torch.Tensor]
    copies: list[torch.Tensor]
    saved: list[torch.Tensor]
    """The residuals as made: compress updates them in place, so timings restore them."""
    evict: torch.Tensor

    def restore_residuals(self) -> None:
        for residual, saved in zip(self.residuals, self.saved):
            residual.copy_(saved)
        self.evict.zero_()  # so no call starts with a residual the copies left in L2

    @classmethod
    def make(cls, size_mb: float) -> Buffers:
        numel = int(size_mb * 1e6) // 4
        sets = max(2, math.ceil(ROTATE_BYTES / (numel * 4)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        buckets = [torch.randn(numel, device="cuda", generator=gen) for _ in range(sets)]
        residuals = [torch.randn(numel, device="cuda", generator=gen) * 1e-3 for _ in range(sets)]
        return cls(numel, buckets, residuals, [torch.empty_like(b) for b in buckets], [r.clone() for r in residuals],
                   torch.empty(L2_EVICT_BYTES // 4, device="cuda"))


def copy_gbs(buffers: Buffers) -> float:
    # The baseline is the faster of two ways to time the copy, so it is never flattered.
    copy_calls = [lambda d=d, s=s: d.copy_(s) for d, s in zip(buffers.copies, buffers.buckets)]
    copy_s = min(graph_seconds(copy_calls), back_to_back_seconds(copy_calls))
    return 2 * buffers.numel * 4 / copy_s / 1e9


def bench_kernels(buffers: Buffers, k_ratio: float) -> dict:
    numel, buckets, residuals, copies = buffers.numel, buffers.buckets, buffers.residuals, buffers.copies
    sets = len(buckets)
    compress_calls = [lambda i=i: kp.compress(buckets[i], residuals[i], k_ratio, check_finite=False)
                      for i in range(sets)]
    compress_s = graph_seconds(compress_calls, before_each=buffers.restore_residuals)
    eager_s = back_to_back_seconds(compress_calls, before_each=buffers.restore_residuals)
    buffers.restore_residuals()
    payloads = [kp.compress(buckets[i], residuals[i], k_ratio) for i in range(sets)]
    compress_gbs = (3 * numel * 4 + payloads[0].payload.numel()) / compress_s / 1e9

    sent = payloads[0].sent()
    decompress_s = graph_seconds([lambda d=d, p=p: kp.decompress_accumulate(d, p) for d, p in zip(copies, payloads)])
    layout = payloads[0].layout
    payload_read = sent * layout.entry_bytes + 4 * layout.num_blocks + 4 * layout.num_segments
    decompress_gbs = (payload_read + 8 * sent) / decompress_s / 1e9
    sector_gbs = (payload_read + 64 * sent) / decompress_s / 1e9

    # One payload written into the whole bucket (decompress into dense), then an all-gather's worth
    # (different buckets) averaged into it: decompress_sum in one pass against what the hook did
    # before (zero an fp32 sum, add each row, divide, copy).
    like = payloads[0]
    dense_s = graph_seconds([lambda d=d, p=p: kp.decompress_sum(d, p.payload.view(1, -1), p)
                             for d, p in zip(copies, payloads)])
    dense_gbs = (_valid_bytes(like) + 4 * numel) / dense_s / 1e9
    rows = torch.stack([payloads[i % sets].payload for i in range(RANKS)])
    valid_bytes = sum(_valid_bytes(like.with_payload(row)) for row in rows)
    sum_s = graph_seconds([lambda d=d: kp.decompress_sum(d, rows, like, RANKS) for d in copies])
    total = torch.empty_like(copies[0])
    rowwise_s = graph_seconds([lambda d=d: _sum_row_by_row(d, total, rows, like) for d in copies])
    check = torch.empty_like(copies[0])
    _sum_row_by_row(check, total, rows, like)
    kp.decompress_sum(copies[0], rows, like, RANKS)
    sum_matches = bool(torch.equal(check, copies[0]))  # bit for bit, including the division
    sum_gbs = (valid_bytes + 4 * numel) / sum_s / 1e9
    encode_s = graph_seconds([lambda p=p: encode_wire(p) for p in payloads])
    wires = torch.stack([encode_wire(like.with_payload(row)) for row in rows])
    decode_s = graph_seconds([lambda: decode_wires(wires, layout)])
    wire_eager_s = back_to_back_seconds([lambda: (encode_wire(like), decode_wires(wires, layout))])
    wire_matches = bool(torch.equal(decode_wires(wires, layout), rows))
    wire_share = wires.shape[1] / layout.nbytes
    del rows, total, check, payloads, wires
    buffers.restore_residuals()

    k = max(1, round(k_ratio * numel))
    magnitudes = [b.abs() for b in buckets]  # outside the baseline's timing: torch.topk alone, its best case
    topk_device_s = graph_seconds([lambda b=b: selected(tk, b, None, k_ratio) for b in buckets])
    torch_device_s = graph_seconds([lambda m=m: torch.topk(m, k, sorted=False) for m in magnitudes])
    x, repeats = buckets[0], 5 if numel > 50_000_000 else 15
    topk_eager_s = eager_seconds(lambda: kp.topk_by_magnitude(x, k), repeats)
    torch_eager_s = eager_seconds(lambda: torch.topk(magnitudes[0], k, sorted=False), repeats)
    index, _ = kp.topk_by_magnitude(x, k)
    exact = torch.topk(magnitudes[0], len(index), sorted=False).indices
    exact_match = torch.equal(index.long().sort().values, exact.sort().values)
    del magnitudes, exact
    torch.cuda.empty_cache()
    return dict(compress_gbs=compress_gbs, compress_us=compress_s * 1e6, eager_us=eager_s * 1e6,
                decompress_gbs=decompress_gbs, sector_gbs=sector_gbs, decompress_us=decompress_s * 1e6,
                sent_over_k=sent / k, dense_gbs=dense_gbs, dense_us=dense_s * 1e6, sum_gbs=sum_gbs,
                sum_us=sum_s * 1e6, rowwise_us=rowwise_s * 1e6, sum_matches=sum_matches,
                encode_us=encode_s * 1e6, decode_us=decode_s * 1e6, wire_eager_us=wire_eager_s * 1e6,
                wire_share=wire_share, wire_matches=wire_matches,
                topk_device_ms=topk_device_s * 1e3, torch_device_ms=torch_device_s * 1e3,
                topk_eager_ms=topk_eager_s * 1e3, torch_eager_ms=torch_eager_s * 1e3, kept_over_k=len(index) / k,
                exact=exact_match)


def _valid_bytes(c) -> int:
    """Payload bytes a receiver reads: header, the entries sent, and the arrays after the entries."""
    return 16 + c.layout.entry_bytes * c.sent() + c.layout.nbytes - c.layout.scales_offset


def _sum_row_by_row(out: torch.Tensor, total: torch.Tensor, rows: torch.Tensor, like) -> None:
    total.zero_()
    for row in rows:
        kp.decompress_accumulate(total, like.with_payload(row))
    out.copy_(total.div_(len(rows)))  # as the hook did; for 8 ranks exactly the correctly rounded quotient


COMPRESS_SWEEP = [dict(unit=1, elements_per_thread=16), dict(unit=1, elements_per_thread=8),
                  dict(unit=2, elements_per_thread=16), dict(unit=1, elements_per_thread=16, row_scan=True)]
"""Tunings of compress's pass tried by --sweep. Earlier sweeps (benchmarks/RESULTS.md) also tried
4 tiles a program, evict-first hints on the streamed lines, and waiting for the threshold before
loading a program's first tile: slower."""
TOPK_SWEEP = [dict(tile=1024, unit=1, elements_per_thread=16), dict(tile=1024, unit=2, elements_per_thread=16),
              dict(tile=1024, unit=2, elements_per_thread=8), dict(tile=1024, unit=4, elements_per_thread=16),
              dict(tile=2048, unit=2, elements_per_thread=16), dict(tile=1024, unit=2, elements_per_thread=16, row_scan=True),
              dict(tile=1024, unit=1, elements_per_thread=16, row_scan=True)]
"""Tunings of top-k's pass tried; tiles of 4096 were slower everywhere in the earlier sweep."""
SUM_SWEEP = [(256, 16), (256, 8), (512, 16)]
"""(entries of a rank loaded at once, warps) tried for decompress_sum."""


def sweep(buffers: Buffers, k_ratio: float, copy: float) -> list[dict]:
    """Each tuning of triton_kernels timed on the same buffers: compress, top-k (against
    torch.topk) and decompress_sum of one and of RANKS payloads; the defaults are restored after."""
    compress, decompress_sum, topk_by_magnitude = kp.compress, kp.decompress_sum, kp.topk_by_magnitude
    defaults = (tk.COMPRESS_TUNING, tk.TOPK_TUNING, tk.SUM_TUNING)
    numel, buckets, residuals, copies = buffers.numel, buffers.buckets, buffers.residuals, buffers.copies
    rows, sets = [], len(buckets)
    try:
        for tuning in COMPRESS_SWEEP:
            tk.COMPRESS_TUNING = tk.Tuning(tile=0, **tuning)
            if not _compiles(lambda: compress(buckets[0], residuals[0].clone(), k_ratio), "compress", tuning, rows):
                continue
            seconds = graph_seconds([lambda i=i: compress(buckets[i], residuals[i], k_ratio, check_finite=False)
                                     for i in range(sets)], before_each=buffers.restore_residuals)
            twin_residual = residuals[0].clone()
            got = compress(buckets[0], residuals[0], k_ratio, check_finite=False)
            want = selected(reference, buckets[0], twin_residual, k_ratio)
            same = torch.equal(got.payload, want.payload) and torch.equal(residuals[0], twin_residual)
            rows.append(dict(kernel="compress", tuning=_described(tuning), us=seconds * 1e6,
                             of_copy=(3 * numel * 4 + got.payload.numel()) / seconds / 1e9 / copy, same_as_twin=same))
        tk.COMPRESS_TUNING = defaults[0]
        k = max(1, round(k_ratio * numel))
        magnitudes = [b.abs() for b in buckets[:2]]
        torch_s = graph_seconds([lambda m=m: torch.topk(m, k, sorted=False) for m in magnitudes])
        del magnitudes
        twin = selected(reference, buckets[0], None, k_ratio)
        twin_topk = twin.indices[:twin.sent()], twin.values[:twin.sent()]
        for tuning in TOPK_SWEEP:
            tk.TOPK_TUNING = tk.Tuning(**tuning)
            if not _compiles(lambda: topk_by_magnitude(buckets[0], k), "topk", tuning, rows):
                continue
            seconds = graph_seconds([lambda b=b: selected(tk, b, None, k_ratio) for b in buckets])
            index, values = topk_by_magnitude(buckets[0], k)
            same = torch.equal(index, twin_topk[0]) and torch.equal(values, twin_topk[1])
            rows.append(dict(kernel="topk", tuning=_described(tuning), us=seconds * 1e6,
                             speedup=torch_s / seconds, same_as_twin=same))
        tk.TOPK_TUNING = defaults[1]
        payloads = [compress(buckets[i], residuals[i].clone(), k_ratio) for i in range(min(sets, RANKS))]
        like = payloads[0]
        gathered = torch.stack([payloads[i % len(payloads)].payload for i in range(RANKS)])
        one = (_valid_bytes(like) + 4 * numel)
        eight = sum(_valid_bytes(like.with_payload(row)) for row in gathered) + 4 * numel
        for chunk, warps in SUM_SWEEP:
            tk.SUM_TUNING = tk.SumTuning(chunk=chunk, warps=warps)
            dense_s = graph_seconds([lambda d=d, i=i: decompress_sum(d, payloads[i % len(payloads)].payload.view(1, -1),
                                                                     like) for i, d in enumerate(copies)])
            sum_s = graph_seconds([lambda d=d: decompress_sum(d, gathered, like, RANKS) for d in copies])
            decompress_sum(copies[0], gathered, like, RANKS)
            reference.decompress_sum(copies[1], gathered, like.layout, RANKS)
            rows.append(dict(kernel="sum", tuning=f"chunk {chunk}, {warps} warps",
                             dense_of_copy=one / dense_s / 1e9 / copy, sum_of_copy=eight / sum_s / 1e9 / copy,
                             dense_us=dense_s * 1e6, sum_us=sum_s * 1e6,
                             same_as_twin=torch.equal(copies[0], copies[1])))
    finally:
        tk.COMPRESS_TUNING, tk.TOPK_TUNING, tk.SUM_TUNING = defaults
    return rows


def _compiles(call: Callable[[], object], kernel: str, tuning: dict, rows: list[dict]) -> bool:
    """Whether a tuning compiles and runs; if not, a row says why and the sweep goes on."""
    try:
        call()
        return True
    except Exception as e:  # a tuning Triton cannot compile is a finding of the sweep, not its end
        rows.append(dict(kernel=kernel, tuning=_described(tuning), error=f"{type(e).__name__}: {str(e)[:300]}"))
        return False


def _described(tuning: dict) -> str:
    return ", ".join(f"{name} {value}" for name, value in tuning.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[25, 100, 400, 1000])
    parser.add_argument("--k-ratio", type=float, default=0.01)
    parser.add_argument("--sweep", action="store_true",
                        help="time every tuning in COMPRESS_SWEEP, TOPK_SWEEP and SUM_SWEEP instead of the full table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{datetime.date.today()} | k_ratio {args.k_ratio}", flush=True)
    rows = []
    for size in args.sizes_mb:
        buffers = Buffers.make(size)
        copy = copy_gbs(buffers)
        if args.sweep:
            for row in sweep(buffers, args.k_ratio, copy):
                print(f"| {size:g} MB | {row.pop('kernel')} | {row.pop('tuning')} | "
                      + " | ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                                   for key, value in row.items()) + " |", flush=True)
            del buffers
            torch.cuda.empty_cache()
            continue
        rows.append(dict(size_mb=size, numel=buffers.numel, sets=len(buffers.buckets), copy_gbs=copy,
                         **bench_kernels(buffers, args.k_ratio)))
        print(rows[-1], flush=True)
        del buffers
        torch.cuda.empty_cache()
    if rows:
        print_table(rows)


def print_table(rows: list[dict]) -> None:
    print("\n| bucket | copy GB/s | compress GB/s (of copy) | compress us: graph / eager | "
          "decompress GB/s (of copy) | decompress sector GB/s (of copy) | sent/k | "
          "dense GB/s (of copy) | dense us | "
          "topk ms, graph: ours / torch.topk (speed-up) | topk ms, eager: ours / torch.topk (speed-up) | "
          "kept/k | exact | "
          f"sum of {RANKS} GB/s (of copy) | sum of {RANKS} us: decompress_sum / row by row | same bits | "
          f"wire us: encode / decode {RANKS} / compress | wire us, eager: both | wire of payload | round trip exact |")
    print("| --- " * 20 + "|")
    for r in rows:
        copy = r["copy_gbs"]
        print(f"| {r['size_mb']:g} MB | {copy:.0f} | {r['compress_gbs']:.0f} "
              f"({r['compress_gbs'] / copy:.0%}) | {r['compress_us']:.1f} / {r['eager_us']:.1f} | "
              f"{r['decompress_gbs']:.0f} ({r['decompress_gbs'] / copy:.0%}) | {r['sector_gbs']:.0f} "
              f"({r['sector_gbs'] / copy:.0%}) | {r['sent_over_k']:.3f} | {r['dense_gbs']:.0f} "
              f"({r['dense_gbs'] / copy:.0%}) | {r['dense_us']:.1f} | {r['topk_device_ms']:.3f} / "
              f"{r['torch_device_ms']:.3f} ({r['torch_device_ms'] / r['topk_device_ms']:.1f}x) | "
              f"{r['topk_eager_ms']:.3f} / {r['torch_eager_ms']:.3f} "
              f"({r['torch_eager_ms'] / r['topk_eager_ms']:.1f}x) | "
              f"{r['kept_over_k']:.3f} | {r['exact']} | {r['sum_gbs']:.0f} ({r['sum_gbs'] / copy:.0%}) | "
              f"{r['sum_us']:.1f} / {r['rowwise_us']:.1f} | {r['sum_matches']} | {r['encode_us']:.1f} / "
              f"{r['decode_us']:.1f} / {r['compress_us']:.1f} | {r['wire_eager_us']:.1f} | {r['wire_share']:.0%} | "
              f"{r['wire_matches']} |")


if __name__ == "__main__":
    main()
