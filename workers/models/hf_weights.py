"""Hugging Face safetensors weights: what a directory holds, checked against a model, and the built-in
Llama's layout of a Hugging Face Llama's tensors.

    stored = stored_tensors("models/llama")                 # {tensor name: StoredTensor}, headers only
    check_shapes(expected, "models/llama")                  # ConfigError naming the file, tensor and fix
    layout = llama_layout(config)                            # our parameter -> the HF tensors it stacks
    read_rows(layout["layers.0.attention.wqkv.weight"], 0, 96, stored, reads)  # our rows [0, 96), on reads' device

A directory holds `model.safetensors`, or shards `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`; every *.safetensors file is read (as torch.distributed.checkpoint's
HuggingFaceStorageReader does), so the index is not needed to find a tensor, only to name a file that
is missing. The bytes are read through
storage/safetensors_io.py: on GPUs with kvikio straight into GPU memory.

The built-in Llama stacks q, k, v into one matrix (wqkv) and SwiGLU's gate and up into another
(w13), interleaved so that any contiguous cut of rows holds whole units of work (what tensor
parallelism shards): wqkv key/value group by group (the group's query heads, then its key head and
its value head), w13 a gate row then an up row. `Piece.block` is how many of a piece's rows each
such group takes. The built-in also rotates interleaved pairs (x0, x1), (x2, x3), … as Meta's
reference does, where Hugging Face's LlamaForCausalLM rotates the two halves of each head
(rotate_half). A HF q or k projection's row h·d + c·d/2 + i (head h of size d, half c, index i) is
therefore the built-in's row h·d + 2i + c: `Piece.heads` marks the pieces so turned. Qwen2's q, k
and v biases ([model] qkv_bias) stack into wqkv's bias entry for row as their weights stack: the
same groups, the same turns. Reading by rows lets a rank read only the rows of its FSDP2 shard
(dim 0) from each file, never the whole tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.config import ModelConfig
from core.errors import ConfigError
from storage.safetensors_io import StoredTensor, TensorReads, read_header

WHERE = "[model] hf_dir"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    return sorted(Path(hf_dir).glob("*.safetensors"))


def stored_tensors(hf_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor the directory's safetensors files hold, where its bytes lie (headers only)."""
    return {name: tensor for file in safetensors_files(hf_dir) for name, tensor in read_header(file).items()}


def _check_index(hf_dir: Path) -> None:
    """A sharded checkpoint's index names every file of it: one missing is named as the file, not as the
    first tensor that is not found."""
    index = hf_dir / INDEX_FILE
    if not index.is_file():
        return
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{index} is unreadable ({e})", where=WHERE, fix="download the checkpoint again") from None
    missing = sorted(f for f in files if not (hf_dir / f).is_file())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"{index} names {missing[0]}{more}, which is not in {hf_dir}", where=WHERE,
                          fix="download the missing safetensors files of the checkpoint again")


def check_shapes(expected: dict[str, tuple[int, ...]], hf_dir: str | Path) -> None:
    """Every expected tensor is stored with its shape, as 16- or 32-bit floating-point numbers (an integer or
    float8 tensor, whose scales live elsewhere, would be cast to weights without a word); ConfigError naming
    the file, the tensor and the fix."""
    _check_index(Path(hf_dir))
    stored = stored_tensors(hf_dir)
    config = Path(hf_dir) / "config.json"
    for key, shape in expected.items():
        if key not in stored:
            raise ConfigError(f"no tensor {key!r} in {hf_dir}'s safetensors files (a model of {config} has one)",
                              where=WHERE, fix="use the weights saved with this config.json, or remove the "
                                               "*.safetensors files to start from initialised weights")
        found, file = stored[key].shape, stored[key].path
        if found != tuple(shape):
            raise ConfigError(f"{file}: tensor {key!r} is {list(found)}, the model {config} describes needs "
                              f"{list(shape)}", where=WHERE,
                              fix="the weights belong to another config: put their own config.json beside them")
        if not stored[key].dtype.is_floating_point or stored[key].dtype.itemsize < 2:
            raise ConfigError(f"{file}: tensor {key!r} holds {stored[key].dtype} numbers, not bf16, fp16 or fp32 weights",
                              where=WHERE, fix="use the model's own safetensors files (quantized checkpoints are not "
                                               "read: take the bf16 or fp32 release)")


@dataclass(frozen=True, slots=True)
class Piece:
    """A HF tensor stacked, by rows, into one of our parameters."""

    key: str
    rows: int
    heads: int = 0
    """Rotary heads to turn from HF's halves into interleaved pairs (q and k projections); 0 = as stored."""
    block: int = 0
    """Rows of this piece in each group of our parameter, whose groups take `block` rows from each of
    its pieces in turn (wqkv: a key/value group's q heads, then its k head, then its v head); 0 = all
    its rows in one block."""

    def source_rows(self) -> np.ndarray:
        """For each of this piece's rows in our parameter, the HF tensor's row it comes from."""
        ours = np.arange(self.rows)
        if not self.heads:
            return ours
        head_dim = self.rows // self.heads
        within = ours % head_dim
        return ours - within + (within % 2) * (head_dim // 2) + within // 2


def row_sources(pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray]:
    """For each row of our parameter stacked from `pieces`, which piece it comes from (its index) and
    that HF tensor's row."""
    blocks = [piece.block or piece.rows for piece in pieces]
    stride, total = sum(blocks), sum(piece.rows for piece in pieces)
    which, source = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
    offset = 0
    for i, (piece, block) in enumerate(zip(pieces, blocks, strict=True)):
        rows = np.arange(piece.rows)
        ours = rows // block * stride + offset + rows % block
        which[ours], source[ours] = i, piece.source_rows()
        offset += block
    return which, source


def llama_layout(config: ModelConfig) -> dict[str, list[Piece]]:
    """Our built-in Llama's parameters (deduplicated names: a tied head is the embedding) and the HF
    LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM tensors each stacks."""
    layout = {"tok_embeddings.weight": [Piece("model.embed_tokens.weight", config.vocab_size)],
              "norm.weight": [Piece("model.norm.weight", config.n_embd)]}
    if not config.tie_embeddings:
        layout["output.weight"] = [Piece("lm_head.weight", config.vocab_size)]
    for i in range(config.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        layout |= {
            ours + "attention.wqkv.weight": qkv_pieces(config, theirs + "self_attn.", ".weight"),
            ours + "attention.wo.weight": [Piece(theirs + "self_attn.o_proj.weight", config.n_embd)],
            ours + "attention_norm.weight": [Piece(theirs + "input_layernorm.weight", config.n_embd)],
            ours + "ffn_norm.weight": [Piece(theirs + "post_attention_layernorm.weight", config.n_embd)],
            ours + "feed_forward.w13.weight": [Piece(theirs + "mlp.gate_proj.weight", config.hidden_dim, block=1),
                                               Piece(theirs + "mlp.up_proj.weight", config.hidden_dim, block=1)],
            ours + "feed_forward.w2.weight": [Piece(theirs + "mlp.down_proj.weight", config.n_embd)],
        }
        if config.qkv_bias:
            layout[ours + "attention.wqkv.bias"] = qkv_pieces(config, theirs + "self_attn.", ".bias")
    return layout


def qkv_pieces(config: ModelConfig, prefix: str, suffix: str) -> list[Piece]:
    """HF's q_proj, k_proj and v_proj `suffix` (".weight" or ".bias") as wqkv stacks them: key/value
    group by group, q and k heads turned from halves to interleaved pairs."""
    head_dim = config.n_embd // config.n_head
    group_rows = config.n_head // config.kv_heads * head_dim  # one key/value group's query rows
    return [Piece(f"{prefix}q_proj{suffix}", config.n_head * head_dim, config.n_head, block=group_rows),
            Piece(f"{prefix}k_proj{suffix}", config.kv_heads * head_dim, config.kv_heads, block=head_dim),
            Piece(f"{prefix}v_proj{suffix}", config.kv_heads * head_dim, block=head_dim)]


def expected_shapes(layout: dict[str, list[Piece]], ours: dict[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """The HF tensors' shapes a layout needs, given our parameters' shapes."""
    return {piece.key: (piece.rows, *ours[name][1:]) for name, pieces in layout.items() for piece in pieces}


def read_rows(pieces: list[Piece], start: int, stop: int, stored: dict[str, StoredTensor],
              reads: TensorReads) -> torch.Tensor:
    """Rows [start, stop) of our parameter stacked from `pieces`, on `reads`' device: each piece's
    rows in one read of the span of its HF tensor they come from (`stored`: stored_tensors' answer)."""
    which, source = (rows[start:stop] for rows in row_sources(pieces))
    out = None
    for i in np.unique(which):
        piece, here = pieces[i], np.flatnonzero(which == i)
        first, last = int(source[here].min()), int(source[here].max()) + 1
        span = reads.rows(stored[piece.key], first, last)
        if out is None:
            out = span.new_empty((stop - start, *span.shape[1:]))
        out[torch.from_numpy(here).to(span.device)] = span[torch.from_numpy(source[here] - first).to(span.device)]
    return out


def stack_for_export(pieces: list[Piece], tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our whole parameter `tensor` cut back into the HF tensors of `pieces` (read_rows turned around)."""
    which, source = row_sources(pieces)
    out = {}
    for i, piece in enumerate(pieces):
        here = np.flatnonzero(which == i)
        hf = tensor.new_empty((piece.rows, *tensor.shape[1:]))
        hf[torch.from_numpy(source[here])] = tensor[torch.from_numpy(here)]
        out[piece.key] = hf
    return out
