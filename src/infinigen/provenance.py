"""What a benchmark or evaluation row must carry to be reproducible: the code and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def commit() -> str:
    """The short commit of the checkout the package runs from, with "+modified" when the
    package's tracked sources differ from it (a result then came from code no commit holds);
    'unknown' outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = _git(root, "rev-parse", "--short", "HEAD").stdout.strip()
    except Exception:
        return "unknown"
    changed = _git(root, "diff", "--quiet", "HEAD", "--", str(Path(__file__).resolve().parent), check=False)
    return head + ("+modified" if changed.returncode == 1 else "")


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=check)


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    info["cpus"] = os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line for line in f if line.startswith("model name"))
        info["cpu"] = model.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    info["cuda"] = torch.cuda.is_available()
    return info
