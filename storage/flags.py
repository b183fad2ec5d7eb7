"""Flagged tokens: how a fine-tuning dataset carries its loss mask and document starts in the tokens.

    words = flag(tokens, counted, start=True)              # prepare: uint32 words of one document
    batch = unpack(micro_batch)                            # a worker: inputs, targets, loss_mask, positions

A dataset prepared with `--format chat|instruction` stores each token as a uint32 word: bits 0-29 the
token id, bit 30 set on the first token of a document, bit 31 set on a token the loss counts as a
target (a response token). The shards, readers, sampler and ledger move words as they move plain
tokens, so the exactly-once sampler works unchanged; the manifest says the words are flagged
(Manifest.token_flags), and the engine unpacks each micro-batch.

A flag sits on the target: `loss_mask[i]` says whether predicting token i + 1 counts, so the first
token of a packed document (never counted) is never predicted from the document before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TARGET_BIT = 1 << 31
START_BIT = 1 << 30
TOKEN_MASK = START_BIT - 1
MAX_VOCAB = START_BIT
"""Flagged datasets hold token ids below 2**30."""


def flag(tokens: np.ndarray, counted: np.ndarray) -> np.ndarray:
    """One document's tokens as flagged uint32 words: its first token marked as a start, `counted` (bool,
    per token) marked as targets the loss counts."""
    words = tokens.astype(np.uint32) | np.where(counted, np.uint32(TARGET_BIT), np.uint32(0))
    if words.size:
        words[0] |= np.uint32(START_BIT)
    return words


@dataclass(frozen=True, slots=True)
class FlaggedBatch:
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    """bool: the targets the loss counts."""
    positions: torch.Tensor
    """Each input token's place in its document (0 where one starts)."""


def unpack(batch: torch.Tensor) -> FlaggedBatch:
    """A (B, seq_len + 1) micro-batch of flagged words (int64) as token ids, mask and positions."""
    tokens = batch & TOKEN_MASK
    starts = (batch[:, :-1] & START_BIT) != 0
    index = torch.arange(starts.shape[1], device=batch.device).expand_as(starts)
    last_start = torch.cummax(torch.where(starts, index, 0), dim=-1).values
    return FlaggedBatch(inputs=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=(batch[:, 1:] & TARGET_BIT) != 0,
                        positions=index - last_start)
