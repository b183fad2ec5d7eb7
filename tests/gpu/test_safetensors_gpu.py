"""Hugging Face safetensors read into GPU memory with kvikio: rows, slices straight into bf16 targets
or through a buffer into fp32 ones, and torch.distributed.checkpoint's Hugging Face load through
archipelago's reader, each equal to the safetensors library's tensors.

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_safetensors_gpu.py -p no:cacheprovider
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from storage.readers import kvikio_unavailable
from storage.safetensors_io import SafetensorsStorageReader, TensorReads, read_header

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)


@pytest.fixture
def hf_dir(tmp_path):
    reason = kvikio_unavailable()
    if reason is not None:
        pytest.skip(f"kvikio cannot run here: {reason}")
    generator = torch.Generator().manual_seed(0)
    save_file({"embed.weight": torch.randn(1000, 256, generator=generator).to(torch.bfloat16),
               "norm.weight": torch.randn(256, generator=generator)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_kvikio_reads_rows_and_slices_into_gpu_memory(hf_dir):
    expected = load_file(str(hf_dir / "model.safetensors"))
    stored = read_header(hf_dir / "model.safetensors")
    with TensorReads(hf_dir, CUDA, reader="kvikio") as reads:
        assert reads.kind == "kvikio"
        rows = reads.rows(stored["embed.weight"], 100, 600)
        assert rows.device.type == "cuda" and torch.equal(rows.cpu(), expected["embed.weight"][100:600])
        direct = torch.empty(300, 256, dtype=torch.bfloat16, device=CUDA)
        reads.copy_into(stored["embed.weight"], direct, (700, 0), (300, 256))
        assert torch.equal(direct.cpu(), expected["embed.weight"][700:])
        staged = torch.empty(10, 64, dtype=torch.float32, device=CUDA)
        reads.copy_into(stored["embed.weight"], staged, (5, 128), (10, 64))
        assert torch.equal(staged.cpu(), expected["embed.weight"][5:15, 128:192].float())


def test_a_dcp_load_of_hugging_face_weights_reads_through_kvikio(hf_dir):
    expected = load_file(str(hf_dir / "model.safetensors"))
    state = {"embed.weight": torch.zeros(1000, 256, dtype=torch.bfloat16, device=CUDA),
             "norm.weight": torch.zeros(256, device=CUDA)}
    with TensorReads(hf_dir, CUDA, reader="kvikio") as reads:
        dcp.load(state, storage_reader=SafetensorsStorageReader(hf_dir, reads))
    for name, tensor in state.items():
        assert torch.equal(tensor.cpu(), expected[name]), name
