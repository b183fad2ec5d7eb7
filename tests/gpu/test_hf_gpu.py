"""Hugging Face models and loss masks on a GPU (run by `make test-gpu`): the Triton loss kernel leaves out
ignored rows as its twin does, and a kind = "hf" Llama trains compiled in bf16 through the engine with
the compile check passing, from the weights transformers saved."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: it comes with CUDA builds of torch, so no CUDA here")
pytest.importorskip("transformers")

from core.config import JobConfig  # noqa: E402
from kernels import triton_loss  # noqa: E402
from kernels.loss import IGNORE_INDEX, cross_entropy_rows_twin  # noqa: E402
from tests.engine_support import engine_spec  # noqa: E402
from tests.hf_support import write_model  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.pretrained import load_pretrained  # noqa: E402

pytestmark = pytest.mark.gpu


def test_the_kernel_ignores_masked_rows_as_the_twin_does():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(4096, 50304, device="cuda", generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 50304, (4096,), device="cuda", generator=g)
    targets[::3] = IGNORE_INDEX
    got, want = logits.clone(), logits.clone()
    got_losses = triton_loss.cross_entropy_rows(got, targets, 1 / 4096)
    want_losses = cross_entropy_rows_twin(want, targets, 1 / 4096)
    assert torch.allclose(got_losses, want_losses, rtol=1e-5, atol=0)
    assert (got_losses[::3] == 0).all() and (got[::3] == 0).all()
    assert torch.allclose(got.float(), want.float(), rtol=torch.finfo(torch.bfloat16).eps, atol=1e-12)


def test_a_hugging_face_llama_trains_compiled_in_bf16(tmp_path):
    write_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8, vocab_size=512)
    config = JobConfig.from_dict({"model": {"kind": "hf", "hf_dir": str(tmp_path), "seq_len": 256},
                                  "train": {"global_batch_size": 8, "micro_batch_size": 8, "precision": "bf16",
                                            "lr": 1e-3},
                                  "compile": {"enable": True}, "cluster": {"use_gpu": True, "num_workers": 1}})
    spec = engine_spec(config, 1, 8, 1)
    engine = Engine(dataclasses.replace(spec), 0, torch.device("cuda"))
    assert load_pretrained(engine.model, config.model)
    batch = torch.randint(0, 512, (8, 257), device="cuda")
    losses = [float(engine([batch], lr=1e-3)[0]) for _ in range(5)]
    assert engine.compile_check is not None and losses[-1] < losses[0]
