"""A result names the code it came from: the commit, marked when the sources differ from it."""

import shutil
import subprocess
from pathlib import Path

import pytest

import infinigen.provenance as provenance


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_commit_is_marked_modified_exactly_when_the_package_sources_differ(tmp_path, monkeypatch):
    package = tmp_path / "src" / "infinigen"
    package.mkdir(parents=True)
    source = package / "provenance.py"
    source.write_text("x = 1\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(provenance, "__file__", str(source))
    assert provenance.commit() == head
    (tmp_path / "notes.txt").write_text("untracked, outside the package\n")
    assert provenance.commit() == head
    source.write_text("x = 2\n")
    assert provenance.commit() == head + "+modified"


def test_commit_outside_git_is_unknown(tmp_path, monkeypatch):
    package = Path(tmp_path) / "src" / "infinigen"
    package.mkdir(parents=True)
    monkeypatch.setattr(provenance, "__file__", str(package / "provenance.py"))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert provenance.commit() == "unknown"
