"""Fine-tuning documents: conversations and instruction pairs from JSON Lines, with a loss mask, packed
into samples of exactly seq_len tokens.

    archipelago prepare --source chats/ --format chat --seq-len 2048 --tokenizer hf:tokenizer.json --out data/chat
    archipelago prepare --source pairs/ --format instruction --seq-len 2048 --out data/sft

A chat line is {"messages": [{"role": "system" | "user" | "assistant", "content": "…"}, …]}; an
instruction line is {"prompt": "…", "response": "…"} (a user turn and an assistant turn). Each
conversation is rendered with one simple template (the tokenizer's own chat template, a Jinja program
in tokenizer_config.json, is not run):

    <|user|>\\n{content}\\n<|assistant|>\\n{content}<end-of-document token>

every turn a header `<|role|>\\n` then its content, a newline after the others' content and the
tokenizer's end-of-document token after the assistant's. Only the assistant's content and its end
token count in the loss (storage/flags.py); the pieces are tokenized one by one.

Packing: conversations are laid whole into samples of seq_len tokens in file order; one that does not
fit the rest of a sample starts the next, and the rest is padded (end-of-document tokens, not
counted, a document of their own); one longer than seq_len is cut to seq_len (the summary counts
them). Sample i of the split is then tokens [i·seq_len, (i+1)·seq_len], as for any dataset, so the
sampler, the readers and the ledger are those of pretraining data; a final padding token lets the
last sample have its last target.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np

from core.errors import DataError
from storage.flags import TARGET_BIT, flag

ChatFormat = Literal["chat", "instruction"]
ROLES = ("system", "user", "assistant")
TRAINED_ROLE = "assistant"


def turns_of(line: bytes, fmt: ChatFormat, where: str) -> list[tuple[str, str]]:
    """(role, content) of one JSON line; DataError naming `where` (file, byte) and the fix otherwise."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"not a JSON line ({type(e).__name__}: {e})", where=where, fix="fix or remove that line") from None
    if fmt == "instruction":
        return _instruction(record, where)
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError('the line has no "messages" list', where=where,
                        fix='write each chat line as {"messages": [{"role": "user", "content": "…"}, '
                            '{"role": "assistant", "content": "…"}]}, or use --format instruction for prompt/response')
    turns = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise DataError(f"message {i} has role {role!r} and content of type {type(content).__name__}",
                            where=where, fix=f'give every message a "role" ({", ".join(ROLES)}) and a text "content"')
        turns.append((role, content))
    return turns


def _instruction(record: Any, where: str) -> list[tuple[str, str]]:
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
        raise DataError('the line lacks text "prompt" and "response" fields', where=where,
                        fix='write each line as {"prompt": "…", "response": "…"}, or use --format chat for messages')
    return [("user", record["prompt"]), ("assistant", record["response"])]


def render(turns: list[tuple[str, str]]) -> list[tuple[str, bool]]:
    """The template's text pieces and whether each counts in the loss (the end token is added by encode)."""
    pieces = []
    for role, content in turns:
        pieces.append((f"<|{role}|>\n", False))
        pieces.append((content if role == TRAINED_ROLE else content + "\n", role == TRAINED_ROLE))
    return pieces


def encode(turns: list[tuple[str, str]], tokenizer) -> np.ndarray:
    """A conversation as flagged words: its pieces tokenized, the end token after each assistant turn."""
    pieces = render(turns)
    tokens, counted = [], []
    for (_, trained), ids in zip(pieces, tokenizer.encode_texts([text for text, _ in pieces])):
        tokens.append(ids)
        counted.append(np.full(ids.size, trained))
        if trained:
            tokens.append(np.array([tokenizer.eos_id]))
            counted.append(np.array([True]))
    return flag(np.concatenate(tokens), np.concatenate(counted))


class Packer:
    """Lays flagged documents whole into samples of seq_len words and hands each full sample to `sink`
    (a shard writer: add(words), flush())."""

    def __init__(self, sink, seq_len: int, pad_id: int):
        self.sink, self.seq_len, self.pad_id = sink, seq_len, pad_id
        self.sample = np.empty(seq_len, dtype=np.uint32)
        self.filled = 0
        self.documents = 0
        self.truncated = 0
        """Documents cut at seq_len: what followed was dropped."""
        self.trained_tokens = 0
        """Tokens the loss counts, in what was kept."""

    def add(self, words: np.ndarray) -> None:
        self.documents += 1
        if words.size > self.seq_len:
            self.truncated += 1
            words = words[:self.seq_len]
        self.trained_tokens += int(np.count_nonzero(words & TARGET_BIT))
        if self.filled + words.size > self.seq_len:
            self._pad_out()
        self.sample[self.filled:self.filled + words.size] = words
        self.filled += words.size
        if self.filled == self.seq_len:
            self._emit()

    def flush(self) -> None:
        """Pads the last sample, adds the one token its last target needs, and flushes the sink."""
        if self.filled:
            self._pad_out()
        self.sink.add(self._padding(1))
        self.sink.flush()

    def _pad_out(self) -> None:
        self.sample[self.filled:] = self._padding(self.seq_len - self.filled)
        self._emit()

    def _padding(self, count: int) -> np.ndarray:
        return flag(np.full(count, self.pad_id), np.zeros(count, dtype=bool))

    def _emit(self) -> None:
        self.sink.add(self.sample.copy())
        self.filled = 0
