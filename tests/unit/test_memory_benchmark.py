"""benchmarks/memory.py's reading of an allocator trace: the peak and what is alive at it, by place."""

from tests.benchmark_support import load_benchmark

MiB = 2**20


def alloc(address: int, size: int, filename: str, line: int = 1) -> dict:
    return {"action": "alloc", "addr": address, "size": size, "frames": [{"filename": filename, "line": line, "name": "f"}]}


def free(address: int, action: str = "free_requested") -> dict:
    return {"action": action, "addr": address}


def test_the_peak_is_the_highest_total_and_lists_what_was_alive_then():
    bench = load_benchmark("memory")
    project = str(bench.ROOT / "kernels/loss.py")
    inductor = "/tmp/torchinductor_user/ab/cab12.py"
    trace = [alloc(1, 100 * MiB, inductor), alloc(2, 300 * MiB, project, 160), free(1), free(1, "free_completed"),
             alloc(3, 50 * MiB, inductor), free(2), alloc(4, 200 * MiB, inductor), free(3, "free_completed")]
    peak, alive = bench.live_at_peak(trace)
    # 100 + 300, then 300 + 50 = 350, then 50 + 200: the first is the highest
    assert peak == 400 * MiB
    assert sorted(entry["addr"] for entry in alive) == [1, 2]
    rows = bench.by_place(alive, rows=5)
    assert rows == [{"where": "kernels/loss.py:160 f", "GiB": round(300 / 1024, 3), "allocations": 1},
                    {"where": "cab12.py:1 f", "GiB": round(100 / 1024, 3), "allocations": 1}]


def test_a_free_of_memory_allocated_before_the_trace_is_passed_over():
    bench = load_benchmark("memory")
    trace = [free(99), alloc(1, 10 * MiB, "/usr/lib/python3/site-packages/torch/x.py"), free(1)]
    peak, alive = bench.live_at_peak(trace)
    assert peak == 10 * MiB and [entry["addr"] for entry in alive] == [1]
    assert bench.made_where(alive[0]) == "/usr/lib/python3/site-packages/torch/x.py:1 f"
