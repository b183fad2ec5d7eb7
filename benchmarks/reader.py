"""Reading a multi-GB token set and a 1.3B-parameter checkpoint into GPU memory, against named baselines.

    PYTHONPATH=. python3 benchmarks/reader.py --dir bench-data --gib 4 --json reader.json

One run measures, on the same files:
- raw disk: `dd if=SHARD of=/dev/null bs=16M iflag=direct` over every shard (O_DIRECT, no page cache);
- naive baseline: `np.fromfile` + `torch.from_numpy` + `.cuda()`, one shard at a time;
- posix path: archipelago's PosixReader (16 threads of preadv) into two pinned buffers, copied on a side stream;
- kvikio path: archipelago's KvikioReader, `CuFile.pread` straight into the GPU tensor;
each cold (page cache dropped before every repeat: posix_fadvise(DONTNEED) on every file, plus
/proc/sys/vm/drop_caches where writable) and warm (the files in page cache), median of --repeats;
- the training pattern: BatchLoader reading random 2049-token samples (64 a step), warm;
- a 1.3B-parameter GPT's fp32 weights (5.2 GB) saved with archipelago's RawWriter and loaded into
  CUDA tensors with kvikio and with the posix path, against stock DCP (FileSystemWriter/Reader).

Targets (DESIGN.md): kvikio path ≥ 90% of the raw O_DIRECT bandwidth and ≥ 1.5× the naive baseline.
Prints a table last; --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.plan import BatchLayout
from storage.checkpoint_io import CheckpointStore, load_checkpoint, save_checkpoint  # noqa: E402
from storage.loader import BatchLoader, read_to_device  # noqa: E402
from storage.readers import (  # noqa: E402
    Extent,  # noqa: E402
    KvikioReader,
    PosixReader,
    kvikio_unavailable,
)
from storage.sampler import DeterministicSampler  # noqa: E402
from storage.shards import HEADER_BYTES, TokenDataset, write_manifest, write_shard  # noqa: E402

GB = 1e9


def make_token_set(directory: Path, total_bytes: int, shard_bytes: int) -> list[Path]:
    """Random uint16 tokens (vocab 50,304) in shards of `shard_bytes`, with a real manifest; returns the train shards.

    Nothing is fsynced here: `drop_cache` flushes every file before evicting it, so the cold reads are cold.
    """
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    train = [write_shard(directory, "train", index, rng.integers(0, 50_304, size=shard_bytes // 2, dtype=np.uint16),
                         [0], "bench")
             for index in range(max(1, total_bytes // shard_bytes))]
    val = write_shard(directory, "val", 0, rng.integers(0, 50_304, size=2**20, dtype=np.uint16), [0], "bench")
    write_manifest(directory, train + [val], 50_304)
    return [directory / shard.path for shard in train]


def drop_cache(paths: list[Path]) -> str:
    """Evicts the files from the page cache; says how."""
    for path in paths:
        for p in ([path] if path.is_file() else sorted(path.rglob("*"))):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "posix_fadvise(DONTNEED) + drop_caches"
    except OSError:
        return "posix_fadvise(DONTNEED)"


def timed(fn, repeats: int, before=None) -> list[float]:
    seconds = []
    for _ in range(repeats):
        if before:
            before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def dd_direct(paths: list[Path]) -> None:
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                       capture_output=True)


def naive(paths: list[Path]) -> list[torch.Tensor]:
    return [torch.from_numpy(np.fromfile(p, dtype=np.uint16, offset=HEADER_BYTES)).cuda() for p in paths]


def whole_shards(paths: list[Path], dest: torch.Tensor) -> list[tuple[Extent, torch.Tensor]]:
    reads, start = [], 0
    for p in paths:
        n = p.stat().st_size - HEADER_BYTES
        reads.append((Extent(str(p), HEADER_BYTES, n, 0), dest[start:start + n]))
        start += n
    return reads


def token_set_bench(args, paths: list[Path], results: dict) -> None:
    payload = sum(p.stat().st_size - HEADER_BYTES for p in paths)
    dest = torch.empty(payload, dtype=torch.uint8, device="cuda")
    posix = PosixReader(args.threads)
    methods = {"dd iflag=direct (raw disk)": lambda: dd_direct(paths), "naive fromfile + .cuda()": lambda: naive(paths),
               "posix path (pinned, 2 buffers)": lambda: read_to_device(posix, whole_shards(paths, dest))}
    why_not = kvikio_unavailable()
    kvikio = None
    if why_not is None:
        kvikio = KvikioReader(args.threads)
        methods["kvikio path (CuFile.pread)"] = lambda: read_to_device(kvikio, whole_shards(paths, dest))
        results["kvikio_mode"] = KvikioReader.mode()
    else:
        results["kvikio_unavailable"] = why_not
    expected = torch.cat([t.view(torch.uint8) for t in naive(paths)])
    for name, fn in methods.items():
        if name.startswith(("posix", "kvikio")):
            dest.fill_(0)
            fn()
            assert torch.equal(dest, expected), f"{name} read wrong bytes"
    del expected
    results["token_bytes"] = payload
    results["cold"], results["warm"] = {}, {}
    for name, fn in methods.items():
        cold = timed(fn, args.repeats, before=lambda: results.__setitem__("cache_drop", drop_cache(paths)))
        results["cold"][name] = {"seconds": cold, "GBps": payload / statistics.median(cold) / GB}
        print(f"  cold {name}: {results['cold'][name]['GBps']:.2f} GB/s {[round(s, 3) for s in cold]}", flush=True)
        if not name.startswith("dd"):
            fn()  # fill the page cache
            warm = timed(fn, args.repeats)
            results["warm"][name] = {"seconds": warm, "GBps": payload / statistics.median(warm) / GB}
            print(f"  warm {name}: {results['warm'][name]['GBps']:.2f} GB/s", flush=True)
    del dest
    torch.cuda.empty_cache()
    posix.close()
    if kvikio:
        kvikio.close()


def loader_bench(args, directory: Path, results: dict) -> None:
    data = TokenDataset(directory, "train", 2048)
    sampler = DeterministicSampler(data.num_samples, seed=0)
    layout = BatchLayout((64,), 1)
    readers = {"posix": lambda: PosixReader(args.threads)}
    if kvikio_unavailable() is None:
        readers["kvikio"] = lambda: KvikioReader(args.threads)
    results["loader"] = {}
    for name, make in readers.items():
        with BatchLoader(data, make(), torch.device("cuda"), depth=2) as loader:
            stream = loader.stream(sampler.steps(0, layout, 0))
            for _ in range(5):
                next(stream)
            steps = 50
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                batch = next(stream)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / steps
        results["loader"][name] = {"ms_per_step": seconds * 1e3, "GBps": 64 * data.sample_bytes / seconds / GB}
        print(f"  loader {name}: {seconds * 1e3:.2f} ms per step of 64 × 2049 tokens", flush=True)
        del batch


def gpt_13b_state() -> dict[str, torch.Tensor]:
    """fp32 weights shaped like GPT 1.3B (24 layers, d 2048, vocab 50,304, context 2048): 1.31e9 parameters."""
    d, layers, vocab = 2048, 24, 50_304
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {"wte": torch.randn(vocab, d, device="cuda", generator=gen), "wpe": torch.randn(2048, d, device="cuda", generator=gen)}
    for i in range(layers):
        for name, shape in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.fc", (4 * d, d)),
                            ("mlp.proj", (d, 4 * d)), ("ln1", (d,)), ("ln2", (d,))):
            state[f"h.{i}.{name}"] = torch.randn(*shape, device="cuda", generator=gen)
    state["ln_f"] = torch.randn(d, device="cuda", generator=gen)
    return state


def checkpoint_bench(args, directory: Path, results: dict) -> None:
    import torch.distributed.checkpoint as dcp

    state = gpt_13b_state()
    params = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    store = CheckpointStore(directory / "ckpt")
    stock = directory / "ckpt-stock-dcp"
    start = time.perf_counter()
    save_checkpoint({"model": state}, store.step(1)).result()
    saved_ours = time.perf_counter() - start
    start = time.perf_counter()
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True)
    saved_stock = time.perf_counter() - start
    results["checkpoint"] = {"params": params, "bytes": nbytes, "save_seconds": {"archipelago": saved_ours,
                                                                                 "stock DCP": saved_stock}}
    print(f"  1.3B checkpoint: {params / 1e9:.2f}e9 params, {nbytes / GB:.2f} GB; saved in {saved_ours:.1f} s "
          f"(stock DCP {saved_stock:.1f} s)", flush=True)
    target = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
    ways = {"stock DCP FileSystemReader": lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(str(stock)), no_dist=True),
            "archipelago posix (pinned, 2 buffers)": lambda: load_checkpoint(target, store.step(1), reader="posix")}
    if kvikio_unavailable() is None:
        ways["archipelago kvikio (into CUDA tensors)"] = lambda: load_checkpoint(target, store.step(1), reader="auto")
    loads = {}
    for name, fn in ways.items():
        for t in target["model"].values():
            t.zero_()
        seconds = timed(fn, args.ckpt_repeats, before=lambda: drop_cache([directory / "ckpt", stock]))
        assert all(torch.equal(target["model"][k], v) for k, v in state.items()), f"{name} loaded wrong values"
        loads[name] = {"seconds": seconds, "GBps": nbytes / statistics.median(seconds) / GB}
        print(f"  load {name}: {statistics.median(seconds):.2f} s ({loads[name]['GBps']:.2f} GB/s) "
              f"{[round(s, 2) for s in seconds]}", flush=True)
    results["checkpoint"]["load_cold"] = loads


def table(results: dict) -> str:
    lines = [f"token set: {results['token_bytes'] / GB:.2f} GB, cache drop: {results.get('cache_drop')}, "
             f"kvikio: {results.get('kvikio_mode') or results.get('kvikio_unavailable')}",
             f"{'method':40} {'cold GB/s':>10} {'warm GB/s':>10}"]
    for name, cold in results["cold"].items():
        warm = results["warm"].get(name)
        lines.append(f"{name:40} {cold['GBps']:10.2f} {'-' if warm is None else format(warm['GBps'], '.2f'):>10}")
    cold = {k.split(" ")[0]: v["GBps"] for k, v in results["cold"].items()}
    warm = {k.split(" ")[0]: v["GBps"] for k, v in results["warm"].items()}
    if "kvikio" in cold:
        lines.append(f"kvikio / raw disk (cold): {cold['kvikio'] / cold['dd']:.2f}  (target ≥ 0.90)")
        lines.append(f"kvikio / naive (cold): {cold['kvikio'] / cold['naive']:.2f}, warm: "
                     f"{warm['kvikio'] / warm['naive']:.2f}  (target ≥ 1.5)")
    lines.append(f"posix / naive (cold): {cold['posix'] / cold['naive']:.2f}, warm: {warm['posix'] / warm['naive']:.2f}")
    for name, row in results.get("loader", {}).items():
        lines.append(f"loader {name}: {row['ms_per_step']:.2f} ms per step of 64 random 2049-token samples (warm)")
    ck = results.get("checkpoint")
    if ck:
        lines.append(f"1.3B checkpoint ({ck['bytes'] / GB:.2f} GB fp32), cold load to GPU:")
        for name, row in ck["load_cold"].items():
            lines.append(f"  {name:40} {statistics.median(row['seconds']):6.2f} s  {row['GBps']:6.2f} GB/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="bench-data", help="where the files go (a real disk, not tmpfs)")
    parser.add_argument("--gib", type=float, default=4.0, help="token set size")
    parser.add_argument("--shard-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ckpt-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--skip-checkpoint", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    directory = Path(args.dir).resolve()
    shutil.rmtree(directory, ignore_errors=True)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "command": " ".join(sys.argv),
               "filesystem": subprocess.run(["df", "-hT", str(directory.parent)], capture_output=True, text=True).stdout}
    print(results["filesystem"], flush=True)
    try:
        start = time.perf_counter()
        paths = make_token_set(directory / "tokens", int(args.gib * 2**30), args.shard_mib * 2**20)
        print(f"wrote {len(paths)} shards in {time.perf_counter() - start:.1f} s", flush=True)
        token_set_bench(args, paths, results)
        loader_bench(args, directory / "tokens", results)
        if not args.skip_checkpoint:
            checkpoint_bench(args, directory, results)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        shutil.rmtree(directory, ignore_errors=True)
    print(table(results))


if __name__ == "__main__":
    main()
