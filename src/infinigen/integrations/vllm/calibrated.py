"""The skew artifact a vLLM process serves with: a given file, else the one calibrated for the
model folder vLLM loads (found in infinigen's cache, or made once, as `infinigen skew` does).

The model is read once more through transformers for this (its weights fingerprint the
artifact, and a calibration runs it); it is dropped before vLLM serves."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from infinigen.attach import Session
from infinigen.calibration import Calibrator
from infinigen.select import measured_choice, reads_choice
from infinigen.skew import SkewArtifact


def artifact_for(model_path: str, config, given: Path | None = None, progress: bool = True) -> SkewArtifact:
    """(vLLM calls its model in inference mode; a calibration runs outside it.)"""
    with torch.inference_mode(False):
        return _artifact_for(model_path, config, given, progress)


def _artifact_for(model_path: str, config, given: Path | None, progress: bool) -> SkewArtifact:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    calibrator = Calibrator(model, tokenizer, progress=progress, given=given)
    with calibrator.locked(config):
        art = calibrator.skew_for(config)
        if reads_choice(config) and measured_choice(art) is None:
            with Session(model, config, artifact=art, tokenizer=tokenizer) as session:
                calibrator.complete(session, art, config)
    del model, calibrator
    gc.collect()
    return art
