"""Safetensors files read through archipelago's range readers give the safetensors library's tensors
(every dtype a checkpoint holds, any run of rows, slices straight into a destination or through a
buffer), and a damaged file is refused before any read, naming the file and the fix."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.errors import ConfigError
from storage.safetensors_io import TensorReads, read_header

TENSORS = {
    "f32": torch.randn(7, 5),
    "bf16": torch.randn(9, 4).to(torch.bfloat16),
    "f16": torch.randn(3, 2, 4).to(torch.float16),
    "i64": torch.arange(11, dtype=torch.int64) * 7919,
    "i8": torch.randint(-128, 127, (6, 3), dtype=torch.int8),
    "bool": torch.rand(5, 2) > 0.5,
    "fp8": torch.randn(4, 8).to(torch.float8_e4m3fn),
    "scalar": torch.tensor(3.25),
}


@pytest.fixture
def stored(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return read_header(tmp_path / "model.safetensors")


def test_the_header_says_what_the_safetensors_library_reads(tmp_path, stored):
    assert set(stored) == set(TENSORS)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name, tensor in stored.items():
            assert tensor.dtype == f.get_tensor(name).dtype and tensor.shape == tuple(f.get_slice(name).get_shape())


def test_any_run_of_rows_reads_back_bit_for_bit(tmp_path, stored):
    with TensorReads(tmp_path, "cpu", reader="posix") as reads:
        assert reads.kind == "posix"
        for name, expected in TENSORS.items():
            whole = reads.rows(stored[name], 0, expected.shape[0] if expected.dim() else 1)
            assert whole.dtype == expected.dtype and whole.shape == expected.shape, name
            assert torch.equal(whole.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
            if expected.dim() and expected.shape[0] > 2:
                part = reads.rows(stored[name], 1, expected.shape[0] - 1)
                assert torch.equal(part.view(torch.uint8), expected[1:-1].view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # straight into the target; through a buffer
def test_slices_land_in_their_target(tmp_path, stored, dtype):
    expected = TENSORS["bf16"]
    with TensorReads(tmp_path, "cpu", reader="posix") as reads:
        rows = torch.full((4, 4), -1.0, dtype=dtype)
        reads.copy_into(stored["bf16"], rows, (3, 0), (4, 4))
        assert torch.equal(rows, expected[3:7].to(dtype))
        block = torch.full((5, 2), -1.0, dtype=dtype)
        reads.copy_into(stored["bf16"], block, (2, 1), (5, 2))
        assert torch.equal(block, expected[2:7, 1:3].to(dtype))
        scalar = torch.zeros((), dtype=dtype)
        reads.copy_into(stored["scalar"], scalar, (), ())
        assert scalar.item() == 3.25


def test_the_remote_reader_reads_the_same_bytes(tmp_path, stored):
    with TensorReads(tmp_path, "cpu", reader="remote") as reads:
        assert reads.kind == "remote"
        assert torch.equal(reads.rows(stored["f32"], 2, 6), TENSORS["f32"][2:6])


def headed(path, header, data=b"\x00" * 8):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])


@pytest.mark.parametrize("damage, said", [
    (lambda p: cut(p, -1), "claims bytes"),                                  # a download cut short
    (lambda p: cut(p, 5), "header length"),                                  # not even the length
    (lambda p: p.write_bytes((2**40).to_bytes(8, "little") + b"{}"), "header length"),
    (lambda p: p.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{]"), "not JSON"),
    (lambda p: p.write_bytes((2).to_bytes(8, "little") + b"[]"), "not a JSON object"),
    (lambda p: headed(p, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}), "dtypes it reads: F64"),
    (lambda p: headed(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}), "claims bytes [0, 4)"),
])
def test_a_damaged_file_is_refused_before_any_read(tmp_path, damage, said):
    save_file({"w": torch.randn(4, 4)}, str(tmp_path / "model.safetensors"))
    damage(tmp_path / "model.safetensors")
    with pytest.raises(ConfigError) as raised:
        read_header(tmp_path / "model.safetensors")
    assert said in raised.value.what and "model.safetensors" in raised.value.what
    assert raised.value.where == "[model] hf_dir" and "download the checkpoint again" in raised.value.fix


def test_kvikio_forced_where_it_cannot_run_names_the_setting(tmp_path):
    with pytest.raises(ConfigError) as raised:
        TensorReads(tmp_path, "cpu", reader="kvikio")
    assert raised.value.where == "[checkpoint] reader" and '"auto"' in raised.value.fix
