"""Checkpoints move between world sizes: saved by 2 gloo ranks (sharded DTensors, async), loaded by 3 and by 1."""

import multiprocessing
import traceback

import pytest
import torch
import torch.distributed as dist

from storage.checkpoint_io import checkpoint_group, is_committed, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.integration


def full_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"rows": torch.randn(10, 6, generator=g), "cols": torch.randn(4, 9, generator=g),
            "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16), "replicated": torch.arange(5.0),
            "meta": {"step": 5, "note": "resharded"}}


def sharded(full: dict, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "bf16": distribute_tensor(full["bf16"], mesh, [Shard(0)]),
            "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
            "meta": dict(full["meta"])}


def run(rank: int, world: int, store: str, root: str, mode: str, errors) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        full = full_state()
        if mode == "save":
            group = checkpoint_group()
            state = sharded(full, mesh)
            pending = save_checkpoint(state, root, async_save=True, process_group=group)
            state["rows"].to_local().zero_()  # training moves on while the save is in flight
            pending.result()
        else:
            zeros = {k: torch.zeros_like(v) if torch.is_tensor(v) else {"step": 0, "note": ""} for k, v in full.items()}
            state = sharded(zeros, mesh)
            load_checkpoint(state, root)
            for key in ("rows", "cols", "bf16", "replicated"):
                assert torch.equal(state[key].full_tensor(), full[key]), key
            assert state["meta"] == full["meta"]
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}/{world} {mode}: {traceback.format_exc()}")
        raise


def spawn(world: int, tmp_path, root, mode: str) -> None:
    context = multiprocessing.get_context("fork")  # torch is imported already: no second import per rank
    errors = context.Queue()
    store = tmp_path / f"store-{mode}-{world}"
    procs = [context.Process(target=run, args=(r, world, str(store), str(root), mode, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures and all(p.exitcode == 0 for p in procs), "\n".join(failures) or [p.exitcode for p in procs]


def test_save_on_two_ranks_load_on_three_and_on_one(tmp_path):
    root = tmp_path / "step_00000005"
    spawn(2, tmp_path, root, "save")
    assert is_committed(root) and sorted(p.name for p in root.glob("__*_*.distcp"))[0].startswith("__0_")
    spawn(3, tmp_path, root, "load")
    spawn(1, tmp_path, root, "load")
