"""Tokenizers a dataset can be prepared with; the manifest records each one's identity.

    load_tokenizer("bytes")                       # every byte a token, plus end-of-document (vocab 257)
    load_tokenizer("hf:path/to/tokenizer.json")   # a BPE (or any) tokenizer from a Hugging Face tokenizers file

The identity (`Tokenizer.name`) is what checkpoints and manifests compare: "bytes", or
"hf-json:<sha256 prefix of the file>" — the file's content, not its path, so a copy of the same
tokenizer elsewhere is the same tokenizer and an edited file is not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from core.errors import DataError

DATASET_COPY = "tokenizer.json"
"""The copy of its "hf:PATH" tokenizers file a prepared dataset keeps beside its manifest: what made the tokens
travels with them (`archipelago export` gives it to the exported model)."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>")
"""Special tokens taken as end-of-document, in this order, from a tokenizers file."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    dtype: str

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]: ...

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Pieces of text as tokens, no end-of-document added (a conversation is encoded piece by piece)."""
        ...


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


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

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        return [self.encode_document(d) for d in documents]

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode(), dtype=np.uint8).astype(self.dtype) for t in texts]

    def decode(self, tokens: np.ndarray) -> str:
        return bytes(int(t) for t in tokens if t < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class HFJsonTokenizer:
    """A `tokenizers` library tokenizer file (tokenizer.json); end-of-document is its EOS special token."""

    path: str
    name: str
    vocab_size: int
    eos_id: int
    dtype: str
    _tokenizer: Any = field(repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str) -> HFJsonTokenizer:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise DataError("the tokenizers package is not installed", where=f"tokenizer hf:{path}",
                            fix="pip install tokenizers, or prepare with the bytes tokenizer") from None
        file = Path(path)
        try:
            content = file.read_bytes()
            tokenizer = HFTokenizer.from_str(content.decode())
        except FileNotFoundError:
            raise DataError("tokenizer file not found", where=str(file),
                            fix='give the path of a tokenizers JSON file, e.g. "hf:tokenizer.json"') from None
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise DataError(f"not a tokenizers JSON file ({e})", where=str(file),
                            fix="save the tokenizer with tokenizer.save(path) from the tokenizers library") from None
        eos = next((tokenizer.token_to_id(t) for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(f"the tokenizer has none of the end-of-document tokens {list(EOS_CANDIDATES)}",
                            where=str(file), fix='add one as a special token, e.g. "<|endoftext|>"')
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(content).hexdigest()[:16]
        return cls(str(file), f"hf-json:{digest}", vocab, eos, token_dtype(vocab), tokenizer)

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") for d in documents]
        out = []
        for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False):
            tokens = np.empty(len(encoding.ids) + 1, dtype=self.dtype)
            tokens[:-1] = encoding.ids
            tokens[-1] = self.eos_id
            out.append(tokens)
        return out

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=self.dtype) for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: np.ndarray) -> str:
        return self._tokenizer.decode([int(t) for t in tokens])

    @property
    def eos_token(self) -> str:
        """The end-of-document token's text ("<|endoftext|>")."""
        return self._tokenizer.id_to_token(self.eos_id)


def load_tokenizer(spec: str) -> ByteTokenizer | HFJsonTokenizer:
    """"bytes" or "hf:PATH" (a tokenizers JSON file)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFJsonTokenizer.from_file(spec.removeprefix("hf:"))
    raise DataError(f"unknown tokenizer {spec!r}", where="tokenizer",
                    fix='use "bytes" or "hf:path/to/tokenizer.json"')
