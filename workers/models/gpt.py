"""A decoder-only transformer (GPT-2 style): causal SDPA attention, pre-norm blocks, tied embeddings.

Sized entirely by `ModelConfig`; the same code trains the byte-level CPU demo, GPT-2 124M
(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50304) and a 1.3B model
(n_layer=24, n_head=16, n_embd=2048, seq_len=2048).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from core.config import ModelConfig
from kernels.loss import linear_cross_entropy
from workers.models.chunked_loss import chunked_cross_entropy

# Selective activation checkpointing keeps what is expensive to recompute (matmuls, attention)
# and recomputes the cheap, memory-hungry rest (norms, GELU, residual adds) in backward.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)), self.dropout, self.training)


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
        self.activation_checkpointing = "off"
        """off, selective or full; set through GPT.set_activation_checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing == "off" or not torch.is_grad_enabled():
            return self._forward(x)
        context = (functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                   if self.activation_checkpointing == "selective" else None)
        kwargs = {"context_fn": context} if context else {}
        return checkpoint(self._forward, x, use_reentrant=False, preserve_rng_state=False, **kwargs)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix embeds tokens and scores them
        self.before_stage: Callable[[int], None] | None = None
        """Called with 0 before the embeddings and i + 1 before block i, when set: the next-forward
        overlap (workers/comm/overlap.py) applies the updates each stage needs there."""
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def set_activation_checkpointing(self, mode: str) -> None:
        """Recompute block activations in backward: "off", "selective" (keep matmul and attention
        outputs) or "full". Module names do not change, so checkpoints load either way."""
        for block in self.blocks:
            block.activation_checkpointing = mode

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                loss_kernel: str = "plain") -> torch.Tensor:
        """Returns the mean cross-entropy over all positions when targets are given, else the logits.

        loss_kernel: "plain" (F.cross_entropy over fp32 logits), "fused" (kernels.loss: the final
        norm and the logits' gradient made in the forward pass, inside one op) or "chunked"
        (workers.models.chunked_loss: the (tokens × vocab) logits never exist whole)."""
        T = idx.shape[1]
        if self.before_stage is not None:
            self.before_stage(0)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for i, block in enumerate(self.blocks):
            if self.before_stage is not None:
                self.before_stage(i + 1)
            x = block(x)
        return self.head(x, targets, loss_kernel)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None, loss_kernel: str) -> torch.Tensor:
        """Final norm, output projection and loss: a separate method so that FSDP2, which compiles
        block by block, can compile it too (eager, its fp32 logits cost time and memory)."""
        if targets is not None and loss_kernel == "fused":  # the op runs the final norm itself (kernels/loss.py)
            return linear_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1), self.ln_f)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        if loss_kernel == "chunked":
            return chunked_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))
        if loss_kernel != "plain":
            raise ValueError(f"loss_kernel must be 'fused', 'chunked' or 'plain', got {loss_kernel!r}")
        logits = self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls plus attention scores (PaLM appendix B)."""
        cfg = self.cfg
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
