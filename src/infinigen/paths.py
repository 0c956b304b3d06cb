"""Where infinigen keeps what it computes once: converted models and skew artifacts."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$INFINIGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/infinigen``, else ``~/.cache/infinigen``."""
    env = os.environ.get("INFINIGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infinigen"
