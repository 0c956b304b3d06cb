"""The package's layering, read from its source: no import cycles, and nothing below points up.

Data flows one way — config → attach → cache → layers → selectors and storage — so a module may
import only modules of its own layer or below it (docs/architecture.md). Imports inside
functions count too: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "infinigen"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_there_are_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep] if dep in stack else [node, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


# What each part of the package must never depend on, directly or through another module.
FORBIDDEN = {
    # The config is the top of the rules: it declares the settings with the validation rules, reads the
    # selectors' registry (each selector's knobs and what its policy means; through InfiniGen's, the
    # calibration tables' math) and may consult storage's rule; it knows no command line, cache,
    # layer, model family or calibration run.
    "infinigen.config": (
        "infinigen.cli",
        "infinigen.attach",
        "infinigen.cache",
        "infinigen.layers",
        "infinigen.transfer",
        "infinigen.attention",
        "infinigen.models",
        "infinigen.skew.calibrate",
    ),
    # How a setting states and checks its rule, for any settings: it declares none of them.
    "infinigen.validation": ("infinigen.config", "infinigen.cli", "infinigen.storage", "infinigen.speculate"),
    "infinigen.speculate": ("transformers", "infinigen."),
    # Calibration's tables are tensor math over captured queries and keys: they know no model family,
    # neither the run that captures them nor the artifact that stores them.
    "infinigen.skew.tables": (
        "infinigen.models",
        "infinigen.skew.calibrate",
        "infinigen.skew.artifact",
        "infinigen.skew.query_map",
    ),
    "infinigen.storage": ("infinigen.select", "infinigen.attention", "infinigen.layers", "infinigen.cache"),
    # The selectors declare their own settings; the config reads them, never the other way.
    "infinigen.select": (
        "infinigen.config",
        "infinigen.cache",
        "infinigen.layers",
        "infinigen.attach",
        "infinigen.attention",
    ),
    "infinigen.layers": ("infinigen.cache", "infinigen.attach"),
    # A layer's transfers and counters know tiers and selections, not who selects or attends.
    "infinigen.transfer": (
        "infinigen.select",
        "infinigen.layer_selector",
        "infinigen.layers",
        "infinigen.attention",
        "infinigen.cache",
        "infinigen.attach",
    ),
    # The selector's calls for one layer, shared by the decode path and the forced evaluator.
    "infinigen.layer_selector": (
        "infinigen.transfer",
        "infinigen.layers",
        "infinigen.attention",
        "infinigen.cache",
        "infinigen.attach",
    ),
    "infinigen.roles": ("infinigen.",),
    "infinigen.cache": ("infinigen.attach",),
    "infinigen.models": ("infinigen.cache", "infinigen.layers", "infinigen.attach", "infinigen.select"),
    "infinigen.skew": ("infinigen.cache", "infinigen.layers", "infinigen.attach", "infinigen.select"),
    # Kernels only do faster what code above them does: they know no part of the method.
    "infinigen.kernels": (
        "infinigen.storage",
        "infinigen.select",
        "infinigen.speculate",
        "infinigen.layers",
        "infinigen.cache",
        "infinigen.attach",
        "infinigen.config",
        "infinigen.models",
    ),
    "infinigen.growing": ("infinigen.",),
    # What calibration measures and the evaluation reuses works on a session someone else made:
    # it knows neither who calibrates nor who evaluates, attaches or runs the command line.
    "infinigen.measure": (
        "infinigen.calibration",
        "infinigen.api",
        "infinigen.eval",
        "infinigen.cli",
        "infinigen.bench",
    ),
    # The calibration step measures through `measure`; `attach` (in api) and the evaluation sit above it.
    # ("infinigen.cli." is the cli module alone: the settings' flags in cli_settings are below it.)
    "infinigen.calibration": ("infinigen.eval", "infinigen.api", "infinigen.cli.", "infinigen.bench"),
    # `infinigen.attach`: calibration, then a session; it knows no evaluation or command line.
    "infinigen.api": ("infinigen.eval", "infinigen.cli.", "infinigen.bench"),
    # The evaluation attaches through api (so it reaches calibration that way) and knows no command line.
    "infinigen.eval": ("infinigen.cli.", "infinigen.bench"),
}


# The runtime only reads what calibration decided: nothing it runs on imports the evaluation, the
# calibration step, what they measure with, or the `attach` that runs calibration.
RUNTIME = (
    "infinigen.attach",
    "infinigen.generate_guard",
    "infinigen.cache",
    "infinigen.summary",
    "infinigen.budget",
    "infinigen.layers",
    "infinigen.transfer",
    "infinigen.layer_selector",
    "infinigen.roles",
    "infinigen.attention",
    "infinigen.select",
    "infinigen.storage",
    "infinigen.skew",
    "infinigen.models",
    "infinigen.speculate",
    "infinigen.config",
    "infinigen.kernels",
)


ABOVE_THE_RUNTIME = ("infinigen.measure", "infinigen.calibration", "infinigen.api", "infinigen.eval")


@pytest.mark.parametrize("part", RUNTIME)
def test_the_runtime_does_not_import_measurement_calibration_or_evaluation(part):
    graph = import_graph()
    for mod in [m for m in graph if m == part or m.startswith(part + ".")]:
        hits = sorted(r for r in _reach(graph, mod) if r.startswith(ABOVE_THE_RUNTIME))
        assert not hits, f"{mod} depends on {hits}"


def top_level_part(module: str) -> str:
    """The part of the package a module belongs to: `infinigen.eval.suite` -> `infinigen.eval`."""
    return ".".join(module.split(".")[:2])


def test_no_two_parts_of_the_package_import_each_other():
    """Between the package's top-level parts (`infinigen.X`, a module or a subpackage) imports
    point one way: no part reaches itself through another, directly or through others. Module
    cycles are caught above; this catches two parts whose modules point at each other without one
    module ever reaching itself (calibration importing a measurement from eval while eval imports
    calibration's attach, say)."""
    parts: dict[str, set[str]] = {}
    for mod, deps in import_graph().items():
        here = top_level_part(mod)
        parts.setdefault(here, set()).update(top_level_part(d) for d in deps if top_level_part(d) != here)
    for part in sorted(parts):
        reached = _reach(parts, part)
        if part in reached:
            circle = sorted(p for p in reached if part in _reach(parts, p))
            pytest.fail(f"these parts of the package import each other, directly or through others: {circle}")


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_nothing_below_points_up(part):
    graph = import_graph()
    mods = [m for m in graph if m == part or m.startswith(part + ".")]
    for mod in mods:
        reached = _reach(graph, mod) - set(mods)
        for bad in FORBIDDEN[part]:
            hits = sorted(r for r in reached if r.startswith(bad) or r == bad.rstrip("."))
            assert not hits, f"{mod} depends on {hits}"
    if part == "infinigen.speculate":
        text = (SRC / "speculate.py").read_text(encoding="utf-8")
        assert "transformers" not in text and "from infinigen" not in text


def test_selectors_and_storage_do_not_know_each_other():
    """Siblings below the layers: neither imports the other (the config, above both, may use
    storage's rule of which tier holds which format)."""
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("infinigen.select"):
            assert not [d for d in deps if d.startswith("infinigen.storage")], mod
        if mod.startswith("infinigen.storage"):
            assert not [d for d in deps if d.startswith(("infinigen.select", "infinigen.config"))], mod


def test_only_attach_changes_a_model():
    """The calls that change a model for longer than one call appear in attach.py only
    (calibration observes the model through hooks it removes before returning)."""
    mutators = ("set_attn_implementation(", "fold_skew(", "model.generate =")
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for call in mutators:
            if call in text and path.name not in ("attach.py", "base.py", "opt.py"):
                pytest.fail(f"{path.relative_to(SRC)} calls {call}")
    hooks = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if "register_forward_pre_hook" in p.read_text()]
    assert sorted(hooks) == ["attach.py", "skew/calibrate.py"]
