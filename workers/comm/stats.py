"""What communication cost in a step: bytes handed to collectives, and time the step waited on them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    bytes_sent: int = 0
    """Bytes this rank handed to collectives since the last `take()` (payload, not wire bytes:
    a ring all-reduce moves about twice its payload)."""

    def add(self, nbytes: int) -> None:
        self.bytes_sent += nbytes

    def take(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent
