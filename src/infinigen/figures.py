"""Matplotlib is an optional extra (`infinigen-kv[plots]`): figures are drawn when it is
installed, and a run without it still writes its tables and JSON, saying once why no figure."""

from __future__ import annotations

import sys
from types import ModuleType

PLOTS_PIP = "pip install 'infinigen-kv[plots]'"
_said = False


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None (with one line on stderr) without matplotlib."""
    global _said
    try:
        import matplotlib
    except ImportError:
        if not _said:
            print(f"[infinigen] no figure: matplotlib is not installed ({PLOTS_PIP})", file=sys.stderr)
            _said = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
