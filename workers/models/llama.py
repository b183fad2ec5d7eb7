"""The Llama-3 family: RMSNorm, rotary embeddings (Llama-3.1 frequency scaling optional), grouped-query
attention through SDPA, SwiGLU, a tied or untied head.

Sized by `ModelConfig` (kind = "llama"), or a preset: llama3-1b, llama3-3b and llama3-8b are the shapes
of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B. Names follow Meta's reference (tok_embeddings, layers,
attention, feed_forward, norm, output); the query, key and value projections are one matrix (wqkv),
and SwiGLU's gate and up projections another (w13), so each is one matmul. Rotary embeddings rotate
interleaved pairs (x0, x1), (x2, x3), … as Meta's reference does. Both stacked matrices order their
rows so that any contiguous cut holds whole units of work: wqkv key/value group by group (the query
heads that share a key/value head, then that key and value head), w13 gate and up row by row. Tensor
parallelism shards them by rows (workers/models/tensor_plans.py), and each rank computes with the
groups and hidden units it holds, with no reordering. With [model] qkv_bias (Qwen2's attention) wqkv
has a bias, whose entries follow its rows, so a row cut takes its bias with it.

Initialisation: every projection N(0, 0.02), the ones writing into the residual stream (wo, w2)
scaled by 1/sqrt(2 · n_layer) so its variance does not grow with depth, embeddings N(0, 0.02), and
an untied output projection N(0, 1/sqrt(n_embd)) (torchtitan's Llama-3 recipe, with GPT-2's
embedding std, which a tied head needs); wqkv's bias, when it has one, zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.config import ModelConfig
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from workers.models.stack import BlockStack
from workers.models.tensor_plans import embedding_styles, final_norm_styles, llama_block_plan

ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_CONTEXT = 8192
"""Llama-3.1's frequency scaling, as published (its config.json's rope_scaling)."""


def rope_frequencies(head_dim: int, theta: float, scaling: float, device: torch.device | None = None) -> torch.Tensor:
    """Each rotated pair's angular frequency (head_dim / 2 of them), in fp32; with scaling > 0 the
    low frequencies are divided by it and the middle band blended (Llama-3.1)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if not scaling:
        return freqs
    wavelengths = 2 * math.pi / freqs
    low_freq_wavelength = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR
    high_freq_wavelength = ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR
    smooth = (ROPE_ORIGINAL_CONTEXT / wavelengths - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
    blended = (1 - smooth) * freqs / scaling + smooth * freqs
    return torch.where(wavelengths < high_freq_wavelength, freqs,
                       torch.where(wavelengths > low_freq_wavelength, freqs / scaling, blended))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) with each interleaved pair rotated by its position's angle;
    cos and sin are (seq, head_dim / 2), or (batch, seq, head_dim / 2) for per-sample positions."""
    cos, sin = (t[..., None, :].to(x.dtype) for t in (cos, sin))  # a heads axis; a batch axis broadcasts
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: query i may attend key j when j <= i in the same document; a document
    starts where the positions (batch, seq) restart at 0 (packed fine-tuning samples)."""
    document = (positions == 0).cumsum(-1)
    causal = torch.ones(positions.shape[-1], positions.shape[-1], dtype=torch.bool, device=positions.device).tril()
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.n_embd // cfg.n_head
        self.wqkv = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: (batch, 1, seq, seq) bool, True where a query may attend (packed documents); None is causal."""
        B, T, _ = x.shape
        group = self.n_head // self.n_kv_head
        # Rows by key/value group: [q heads of the group; k; v]. -1 groups: all, or this rank's share.
        grouped = self.wqkv(x).view(B, T, -1, group + 2, self.head_dim)
        q = grouped[:, :, :, :group].flatten(2, 3)
        k, v = grouped[:, :, :, group], grouped[:, :, :, group + 1]
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=group > 1)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    @torch.no_grad()
    def lay_out_groups(self) -> None:
        """Reorders rows drawn as [q; k; v] blocks to run key/value group by group: one seed then builds
        the model it built before the rows were grouped, so what was measured at a seed still holds."""
        w = self.wqkv.weight
        kv_rows = self.n_kv_head * self.head_dim
        blocks = w.split([self.n_head * self.head_dim, kv_rows, kv_rows])
        w.copy_(torch.cat([block.view(self.n_kv_head, -1, w.shape[1]) for block in blocks], dim=1).reshape(w.shape))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(x w1) * x w3), with w1 and w3 interleaved row by row in one matrix (w13)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.n_embd, 2 * cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).unflatten(-1, (-1, 2)).unbind(dim=-1)
        return self.w2(F.silu(gate) * up)

    @torch.no_grad()
    def lay_out_rows(self) -> None:
        """Reorders rows drawn as [gate; up] blocks to alternate (as Attention.lay_out_groups, for the seed's sake)."""
        w = self.w13.weight
        w.copy_(torch.stack(w.chunk(2), dim=1).reshape(w.shape))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(BlockStack):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wqkv.weight, std=0.02)
            nn.init.normal_(layer.feed_forward.w13.weight, std=0.02)
            nn.init.normal_(layer.attention.wo.weight, std=residual_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=residual_std)
            if layer.attention.wqkv.bias is not None:
                nn.init.zeros_(layer.attention.wqkv.bias)
            layer.attention.lay_out_groups()
            layer.feed_forward.lay_out_rows()
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=self.cfg.n_embd ** -0.5)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles at `positions` ((seq,) or (batch, seq)), (..., head_dim / 2) in fp32.
        Made each forward (a few kernels) rather than kept as buffers, which a bf16 copy of the model
        would round."""
        cfg = self.cfg
        freqs = rope_frequencies(cfg.n_embd // cfg.n_head, cfg.rope_theta, cfg.rope_scaling, positions.device)
        angles = positions.to(torch.float32)[..., None] * freqs
        return angles.cos(), angles.sin()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, loss_kernel: str = "plain") -> torch.Tensor:
        """The mean cross-entropy over the positions loss_mask keeps (all without one) when targets are
        given, else the logits (loss_kernel: see head_loss). positions (batch, seq): each token's place in
        its packed document; rotary angles restart and attention stays inside each document."""
        self.stage(0)
        x = self.tok_embeddings(idx)
        where = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        cos, sin = self.rotary_tables(where)
        mask = None if positions is None else document_mask(positions)
        for i, layer in enumerate(self.layers):
            self.stage(i + 1)
            x = layer(x, cos, sin, mask)
        return self.head(x, targets, loss_kernel, loss_mask)

    def tensor_parallel_plan(self) -> dict[str, list[ParallelStyle]]:
        plan = {"tok_embeddings": embedding_styles(), "norm": final_norm_styles()}
        if not self.cfg.tie_embeddings:  # split by vocabulary rows; head() multiplies by it (the module is not called)
            plan["output"] = [ColwiseParallel()]
        for i in range(len(self.layers)):
            plan.update({f"layers.{i}.{path}": [style] for path, style in llama_block_plan().items()})
        return plan

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    def output_weight(self) -> torch.Tensor:
        return self.output.weight

    def embedding_modules(self) -> list[nn.Module]:
        return [self.tok_embeddings]

    def head_modules(self) -> list[nn.Module]:
        return [self.norm, self.output]
