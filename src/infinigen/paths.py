"""Where infinigen keeps what it computes once: converted models and skew artifacts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from infinigen.errors import InputError

ENV_CACHE = "INFINIGEN_CACHE_DIR"


class CacheDirError(InputError):
    """The cache folder cannot take what infinigen would write there (read-only, no permission,
    not a folder): said before the work whose result would be lost, naming what chose the folder."""


def default_cache_dir() -> Path:
    """``$INFINIGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/infinigen``, else ``~/.cache/infinigen``."""
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infinigen"


def check_writable(folder: Path) -> Path:
    """`folder` (created if missing) once a file could be made in it; else `CacheDirError`.
    Permissions alone do not tell (root ignores them, a read-only mount does not show in them),
    so a probe file is made and removed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        why = "it is not a folder" if folder.exists() and not folder.is_dir() else exc.strerror or str(exc)
        raise CacheDirError(
            f"the cache folder {folder}{_chosen_by(folder)} is not writable ({why}): {_fix(folder)}"
        ) from None
    return folder


def _chosen_by(folder: Path) -> str:
    env = os.environ.get(ENV_CACHE)
    return f" (${ENV_CACHE})" if env and Path(env) in (folder, *folder.parents) else ""


def _fix(folder: Path) -> str:
    return f"point {ENV_CACHE} at a writable folder" if _chosen_by(folder) else f"set {ENV_CACHE} to a writable folder"
