"""Tokenizers a dataset can be prepared with; the manifest records which one by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Every byte is a token; one extra token ends each document."""

    name: str = "bytes"
    vocab_size: int = 257
    eos_id: int = 256
    dtype: str = "uint16"

    def encode_document(self, data: bytes) -> np.ndarray:
        tokens = np.empty(len(data) + 1, dtype=self.dtype)
        tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
        tokens[-1] = self.eos_id
        return tokens

    def decode(self, tokens: np.ndarray) -> str:
        return bytes(int(t) for t in tokens if t < 256).decode("utf-8", errors="replace")


TOKENIZERS = {"bytes": ByteTokenizer()}
