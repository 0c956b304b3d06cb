"""The one evaluator: S teacher-forced tokens through any policy in one forward pass, on a
session of its own (`infinigen.measure.forced` has the how: the forced layers and their runs).
"""

from __future__ import annotations

from torch import nn

from infinigen.api import attach
from infinigen.attach import Session
from infinigen.config import InfiniGenConfig
from infinigen.measure.forced import ForcedResult, ForcedRunner, Prefix

__all__ = ["Evaluator", "ForcedResult", "Prefix"]


class Evaluator(ForcedRunner):
    """Teacher-forced evaluation of many configs on one text, sharing one dense prefill
    (`ForcedRunner.prefill`, `ForcedRunner.run`).

    Use as a context manager: it attaches the model for its lifetime (one session, which loads
    each config's skew artifact as needed) and detaches it on exit."""

    def __init__(self, model: nn.Module, tokenizer=None, progress: bool = False) -> None:
        super().__init__(model)
        self.tokenizer, self.progress = tokenizer, progress

    @property
    def session(self) -> Session:
        if self._session is None or not self._session.attached:
            # policy dense: no skew is folded into the weights, so one prefill serves every config.
            self._session = attach(
                self.model, InfiniGenConfig(policy="dense"), tokenizer=self.tokenizer, progress=self.progress
            )
        return self._session

    def close(self) -> None:
        if self._session is not None:
            self._session.detach()
            self._session = None

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
