"""The memory estimate against torch.cuda.max_memory_allocated, for GPT-2 124M, GPT 1.3B and the Llama-3.2
1B and 3B shapes on one GPU.

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_memory_gpu.py -s -p no:cacheprovider

The measured step is the worker's own (workers/engine.py Engine: bf16 autocast, fused AdamW,
clipping; or, with bf16 weights, a bf16 compute copy stepped by the one-pass Triton AdamW), the
second one, so AdamW's states exist; the estimate is the fake-tensor step of planning/memory.py,
computed on the CPU without looking at the GPU.
"""

import pytest
import torch

from core.config import JobConfig
from planning import memory
from tests.engine_support import engine_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Largest error allowed: the 5 % issue 30 asks, for every case. On 2026-12-05 the Llama shapes failed it
# (1B +5.9 % autocast, +8.9 % bf16 weights) until the estimate ran rms_norm as CUDA's fused kernel runs it
# (planning/as_cuda.py); then both Llama shapes and GPT 1.3B measured −0.0 % (benchmarks/RESULTS.md).
CASES = {  # name: ([model] table, micro-batch, largest error allowed)
    "GPT-2 124M": ({"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024, "vocab_size": 50304}, 32, 0.05),
    "GPT 1.3B": ({"n_layer": 24, "n_head": 16, "n_embd": 2048, "seq_len": 2048, "vocab_size": 50304}, 8, 0.05),
    "Llama-3.2-1B shape": ({"preset": "llama3-1b", "seq_len": 2048}, 4, 0.05),
    "Llama-3.2-3B shape": ({"preset": "llama3-3b", "seq_len": 2048}, 2, 0.05),
}


def config_for(model: dict, micro_batch: int, bf16_weights: bool) -> JobConfig:
    return JobConfig.from_dict({"name": "memory", "model": model, "cluster": {"use_gpu": True, "num_workers": 1},
                                "train": {"global_batch_size": micro_batch, "micro_batch_size": micro_batch,
                                          "bf16_weights": bf16_weights}})


def measure(config: JobConfig) -> tuple[int, int]:
    """(bytes allocated between steps, peak bytes allocated during the second step)."""
    from workers.engine import Engine

    device = torch.device("cuda", 0)
    engine = Engine(engine_spec(config, 1, config.train.micro_batch_size, 1), 0, device)
    batch = torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size, config.model.seq_len + 1),
                          device=device)
    engine([batch], 1e-4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    between = torch.cuda.memory_allocated()
    engine([batch], 1e-4)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del engine, batch
    torch.cuda.empty_cache()
    return between, peak


@pytest.mark.parametrize("bf16_weights", [False, True], ids=["autocast", "bf16 weights"])
@pytest.mark.parametrize("name", list(CASES))
def test_estimate_close_to_max_memory_allocated(name, bf16_weights):
    model, micro_batch, tolerance = CASES[name]
    config = config_for(model, micro_batch, bf16_weights)
    step = memory.measure_step(memory.StepSpec.for_job(config, device_type="cuda"), micro_batch)
    between, peak = measure(config)
    print(f"\n{name}{' bf16 weights' if bf16_weights else ''}: B={micro_batch} T={model['seq_len']}  estimate {step.peak_bytes / 2**30:.2f} GiB  "
          f"measured {peak / 2**30:.2f} GiB  ({(step.peak_bytes - peak) / peak:+.1%}); between steps: estimated "
          f"{(step.parameter_bytes + step.optimizer_bytes) / 2**30:.2f} GiB, measured {between / 2**30:.2f} GiB")
    assert abs(step.peak_bytes - peak) / peak < tolerance
