"""A decoder-only transformer (GPT-2 style): causal SDPA attention, pre-norm blocks, tied embeddings.

Sized entirely by `ModelConfig`; the same code trains the byte-level CPU demo, GPT-2 124M
(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50304) and a 1.3B model
(n_layer=24, n_head=16, n_embd=2048, seq_len=2048).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.config import ModelConfig
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from workers.models.stack import BlockStack
from workers.models.tensor_plans import embedding_styles, final_norm_styles, gpt_block_plan


class CausalSelfAttention(nn.Module):
    """The query, key and value projections are one matrix whose rows run head by head ([q_h; k_h; v_h]
    for each head h), so that any contiguous cut of its rows holds whole heads: tensor parallelism
    shards it by rows (column-wise) and each rank attends with the heads it holds."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism.
        q, k, v = self.qkv(x).view(B, T, -1, 3, self.head_dim).unbind(dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)), self.dropout, self.training)

    @torch.no_grad()
    def lay_out_heads(self) -> None:
        """Reorders rows drawn as [q; k; v] blocks to run head by head: one seed then builds the model it
        built before the rows ran head by head, so what was measured at a seed still holds."""
        for p in [self.qkv.weight] + ([self.qkv.bias] if self.qkv.bias is not None else []):
            p.copy_(p.view(3, -1, self.head_dim, *p.shape[1:]).transpose(0, 1).reshape(p.shape))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(BlockStack):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix embeds tokens and scores them
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        for block in self.blocks:
            block.attn.lay_out_heads()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, loss_kernel: str = "plain") -> torch.Tensor:
        """Returns the mean cross-entropy over the positions loss_mask keeps (all without one) when targets
        are given, else the logits (loss_kernel: see head_loss). positions (batch, seq), each token's place
        in its document, restart the position embeddings at each packed document; attention still
        crosses them (this model's attention takes no document mask: README, fine-tuning data)."""
        T = idx.shape[1]
        self.stage(0)
        where = torch.arange(T, device=idx.device) if positions is None else positions
        x = self.tok_emb(idx) + self.pos_emb(where)
        for i, block in enumerate(self.blocks):
            self.stage(i + 1)
            x = block(x)
        return self.head(x, targets, loss_kernel, loss_mask)

    def tensor_parallel_plan(self) -> dict[str, list[ParallelStyle]]:
        # Positions split by rows too: each rank gets its sequence shard's positions to add.
        plan = {"tok_emb": embedding_styles(),
                "pos_emb": [RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-2))],
                "ln_f": final_norm_styles()}
        for i in range(len(self.blocks)):
            plan.update({f"blocks.{i}.{path}": [style] for path, style in gpt_block_plan().items()})
        return plan

    def tie_weights(self) -> None:
        self.lm_head.weight = self.tok_emb.weight

    @property
    def final_norm(self) -> nn.Module:
        return self.ln_f

    def output_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def embedding_modules(self) -> list[nn.Module]:
        return [self.tok_emb, self.pos_emb]

    def head_modules(self) -> list[nn.Module]:
        return [self.ln_f, self.lm_head]
