"""Whole processes: `infinigen generate --tier disk` killed, interrupted or terminated mid-decode
leaves nothing in its KV directory; two runs share one directory; an interrupted calibration
leaves nothing. Each child is paused at a known point by reading its progress on stderr (the
"decoding" bar appears once the prompt is in the KV files), never by sleeping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import open_files_in

SRC = Path(__file__).resolve().parents[1] / "src"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def _start(*argv: str, cache: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC), INFINIGEN_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "infinigen.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # Ctrl-C as a terminal delivers it: a suite started in the background (`make test &`)
        # inherits SIGINT ignored, and Python would then never raise KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for(proc: subprocess.Popen, marker: bytes) -> bytes:
    """Read the child's stderr until `marker` shows (it blocks on the pipe; no polling)."""
    seen = b""
    while marker not in seen:
        chunk = proc.stderr.read1(4096)
        if not chunk:
            proc.wait()
            pytest.fail(f"the child ended (status {proc.returncode}) before {marker!r}: {seen.decode()[-2000:]}")
        seen += chunk
    return seen


def _generate(model: Path, kv_dir: Path, cache: Path, tokens: int, *extra: str) -> subprocess.Popen:
    return _start(
        "generate", "--model", str(model), "--prompt", PROMPT, "--policy", "full", "--tier", "disk",
        "--kv-dir", str(kv_dir), "--max-new-tokens", str(tokens), *extra, cache=cache,
    )  # fmt: skip


@pytest.mark.parametrize(
    "sig,status,says",
    [
        (signal.SIGKILL, -signal.SIGKILL, None),
        (signal.SIGINT, 130, "error: interrupted (Ctrl-C)"),
        (signal.SIGTERM, 128 + signal.SIGTERM, "error: stopped by SIGTERM"),
    ],
    ids=["SIGKILL", "SIGINT", "SIGTERM"],
)
def test_a_run_stopped_mid_decode_leaves_nothing(sig, status, says, tiny_model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    proc = _generate(tiny_model_dir, kv_dir, tmp_path / "cache", 3000)
    try:
        _wait_for(proc, b"decoding")
        held = open_files_in(kv_dir, proc.pid)
        assert len(held) == 4  # one KV file per layer, open mid-decode ...
        assert list(kv_dir.iterdir()) == []  # ... and none of them has a name
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == status
    assert list(kv_dir.iterdir()) == []
    if says is not None:
        lines = [line for line in err.decode().replace("\r", "\n").splitlines() if line.startswith("error")]
        assert lines == [says] and "Traceback" not in err.decode()


def test_two_runs_share_one_kv_directory(tiny_model_dir, tmp_path):
    """Both hold their files in the directory at once (the first is paused mid-decode while the
    second starts), both calibrate into one shared cache, and both produce the tokens a run
    alone produces."""
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    cache = tmp_path / "cache"
    # row by row: left unset, the disk would choose in its blocks and the RAM run below in rows
    extra = ("--policy", "infinigen", "--calibration-tokens", "256", "--alpha", "3", "--block-tokens", "1", "--json")
    first = _generate(tiny_model_dir, kv_dir, cache, 200, *extra)
    second = None
    try:
        _wait_for(first, b"decoding")
        first.send_signal(signal.SIGSTOP)
        second = _generate(tiny_model_dir, kv_dir, cache, 200, *extra)
        _wait_for(second, b"decoding")
        assert len(open_files_in(kv_dir, first.pid)) == len(open_files_in(kv_dir, second.pid)) == 2
        first.send_signal(signal.SIGCONT)
        outs = [json.loads(p.communicate(timeout=300)[0]) for p in (first, second)]
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
    assert first.returncode == second.returncode == 0
    assert outs[0]["text"] == outs[1]["text"] and outs[0]["new_tokens"] == 200
    assert list(kv_dir.iterdir()) == []

    alone = _generate(tiny_model_dir, tmp_path, cache, 200, *extra, "--tier", "ram")
    assert json.loads(alone.communicate(timeout=300)[0])["text"] == outs[0]["text"]
    artifacts = list((cache / "skew").iterdir())
    assert len(artifacts) == 1 and artifacts[0].suffix == ".safetensors"  # one sound artifact, no temporaries


def test_an_interrupted_calibration_leaves_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "skew" / "tiny.safetensors"
    proc = _start(
        "skew", "--model", str(tiny_model_dir), "--calibration-tokens", "4096", "--output", str(out),
        cache=tmp_path / "cache",
    )  # fmt: skip
    try:
        _wait_for(proc, b"calibrating skew")
        proc.send_signal(signal.SIGSTOP)  # held inside the calibration while Ctrl-C arrives
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "error: interrupted (Ctrl-C)" in err.decode() and "Traceback" not in err.decode()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
