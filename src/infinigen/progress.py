"""Progress bars that never go quiet: long work (a calibration's phases, a GGUF conversion) shows
a bar whose clock moves every second even while one step takes tens of seconds, so a user can
tell a slow step from a hung one."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from tqdm.auto import tqdm

TICK_SECONDS = 1.0  # how often a bar is redrawn while its current step runs


@contextlib.contextmanager
def ticking(bar: tqdm) -> Iterator[tqdm]:
    """`bar`, redrawn every `TICK_SECONDS` by a daemon thread until the block ends (then closed)."""
    if bar.disable:
        yield bar
        return
    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_SECONDS):
            bar.refresh()

    thread = threading.Thread(target=tick, name="infinigen-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        done.set()
        thread.join()
        bar.close()


def bar(**kwargs) -> tqdm:
    """A tqdm bar on stderr (stdout may carry JSON); use it inside `ticking`."""
    return tqdm(file=sys.stderr, **kwargs)


@contextlib.contextmanager
def step(desc: str, progress: bool, about: str | None = None) -> Iterator[None]:
    """One step with no inner progress (a file read by another library): its elapsed time, ticking.
    about: what it usually takes, said beside the clock."""
    fmt = "{desc}: {elapsed}" + (f" (about {about})" if about else "")
    with ticking(bar(desc=desc, bar_format=fmt, disable=not progress, leave=False)):
        yield


def duration(seconds: float) -> str:
    """A duration for a person: seconds under 90 s, then minutes (to a tenth under ten)."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    return f"{seconds / 60:.1f} minutes" if seconds < 600 else f"{seconds / 60:.0f} minutes"
