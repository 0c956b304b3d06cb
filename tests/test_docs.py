"""The docs stay what a reader scans: a short README with the essentials on its first screen, a
policy table that matches the code, and no result file that no document cites."""

from __future__ import annotations

from pathlib import Path

from infinigen.config import POLICIES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIRST_SCREEN = "\n".join(README.splitlines()[:60])


def test_the_readme_is_short_and_its_first_screen_has_the_essentials():
    assert len(README.splitlines()) <= 130
    for essential in (
        "make demo",
        "make test",
        "pip install",
        "```python",
        "| policy |",
    ):
        assert essential in FIRST_SCREEN, essential
    figures = [line for line in FIRST_SCREEN.splitlines() if line.startswith("![") and "](docs/bench/" in line]
    assert len(figures) == 1 and figures[0].endswith(".png)"), figures
    assert (ROOT / figures[0].split("](", 1)[1][:-1]).is_file()


def test_every_policy_has_a_row_in_the_readme():
    for name in POLICIES:
        assert f"| `{name}` |" in README, name


def test_every_result_file_is_cited_by_a_document():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in docs)
    uncited = []
    for folder in ("eval", "bench"):
        for path in sorted((ROOT / "docs" / folder).rglob("*")):
            if path.is_file():
                # A run writes its rows (.json) beside its tables (.md/.txt): citing one cites both.
                stems = {p.relative_to(ROOT / "docs").as_posix() for p in path.parent.glob(f"{path.stem}.*")}
                if not any(rel in text for rel in stems):
                    uncited.append(path.relative_to(ROOT / "docs").as_posix())
    assert not uncited, f"result files no document cites: {uncited}"
