"""Counters of what crossed from a slow tier to the compute (benchmarks read these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferStats:
    bytes: int = 0
    rows: int = 0
    requests: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, rows: int, seconds: float) -> None:
        self.bytes += nbytes
        self.rows += rows
        self.requests += 1
        self.seconds += seconds

    def reset(self) -> None:
        self.bytes = self.rows = self.requests = 0
        self.seconds = 0.0
