import dataclasses
import math

import pytest

from infinigen import ConfigError, InfiniGenConfig
from infinigen.config import POLICIES


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": -0.1},
        {"alpha": float("nan")},
        {"partial_ratio": 0.0},
        {"partial_ratio": 1.5},
        {"budget": 0.0},
        {"budget": 1.01},
        {"budget_tokens": 0},
        {"min_tokens": 0},
        {"dense_layers": 0},
        {"aggregation": "mean"},
        {"policy": "h2o-typo"},
        {"kv_dtype": "int8"},
        {"calibration_tokens": 4},
        {"sinks": -1},
        {"recent_ratio": 1.5},
        {"page_tokens": 0},
        {"layer_alpha": {3: -1.0}},
        {"layer_alpha": {"3": 1.0}},
        {"policy": "int4", "tier": "disk"},
        {"policy": "full", "host_capacity": 0.5},
        {"host_capacity": 0.5, "tier": "disk"},
        {"alpha": True},
        {"min_tokens": 2.5},
        {"kv_dir": 3},
        {"io_threads": 0},
    ],
)
def test_bad_values_are_refused(kwargs):
    with pytest.raises(ConfigError):
        InfiniGenConfig(**kwargs)


def test_edges_are_accepted():
    cfg = InfiniGenConfig(alpha=math.inf, partial_ratio=1.0, budget=1.0)
    assert cfg.to_dict()["alpha"] == "inf"
    assert InfiniGenConfig(alpha=0.0, partial_ratio=0.01, budget=1e-3).alpha == 0.0


def test_round_trip_through_json():
    import json

    cfg = InfiniGenConfig(alpha=math.inf, layer_alpha={2: 6.0, 5: math.inf}, policy="quest", budget=0.2)
    back = InfiniGenConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    with pytest.raises(ConfigError, match="unknown settings"):
        InfiniGenConfig.from_dict({"alpah": 3})


def test_selectors_get_their_own_knobs_with_the_policy_default_budget():
    from infinigen.select.h2o import H2OKnobs
    from infinigen.select.infinigen import SpeculationKnobs

    assert InfiniGenConfig(policy="h2o").knobs(H2OKnobs) == H2OKnobs(budget=0.1, recent_ratio=0.5)
    assert InfiniGenConfig().knobs(SpeculationKnobs).budget == 0.1  # the one knob: 10% by default
    assert InfiniGenConfig(policy="h2o", budget=0.3).knobs(H2OKnobs).budget == 0.3


def test_the_config_is_composed_from_the_selectors_registry():
    """Each selector's file declares its knobs and what its policy means; the config's fields and
    `POLICIES` are read from the registry, field for field (help, rule, default, group)."""
    from infinigen.config import READING_EVERY_ROW, setting_fields
    from infinigen.select import SELECTORS

    fields = setting_fields()
    for name, cls in SELECTORS.items():
        assert POLICIES[name] is cls.policy and cls.policy.selector == name
        assert issubclass(InfiniGenConfig, cls.Knobs)
        for f in dataclasses.fields(cls.Knobs):
            assert fields[f.name].metadata is f.metadata and fields[f.name].default == f.default, f.name
        cfg = InfiniGenConfig(policy=name, budget=0.2)
        assert cfg.knobs(cls.Knobs) == cls.Knobs(
            **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls.Knobs)}
        )
    assert set(POLICIES) == set(SELECTORS) | set(READING_EVERY_ROW)
    assert all(spec.selector is None for spec in READING_EVERY_ROW.values())


def test_a_knob_two_selectors_declare_is_refused(monkeypatch):
    from dataclasses import dataclass

    import infinigen.config as config
    from infinigen.select.base import SelectionBudget, Selector
    from infinigen.validation import knob

    @dataclass(frozen=True)
    class Clashing(SelectionBudget):
        sinks: int = knob(2, "another selector's sinks")

    class Other(Selector):
        name = "other"
        Knobs = Clashing

    monkeypatch.setattr(config, "SELECTORS", {**config.SELECTORS, "other": Other})
    with pytest.raises(TypeError, match="'sinks' is declared by both StreamingKnobs and Clashing"):
        config._selector_knobs()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_round_trips_through_json(policy):
    import json

    cfg = InfiniGenConfig(policy=policy, alpha=4, budget=0.1)
    assert InfiniGenConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "name,text,value",
    [
        ("alpha", "inf", math.inf),
        ("skew", "off", False),
        ("budget_tokens", "none", None),
        ("layer_alpha", "2:6, 3:7.5", {2: 6.0, 3: 7.5}),
        ("kv_dtype", "bfloat16", "bfloat16"),
    ],
)
def test_settings_parse_from_text(name, text, value):
    from infinigen.cli_settings import parse_setting

    assert parse_setting(name, text) == value


def test_text_that_does_not_parse_names_the_setting():
    from infinigen.cli_settings import parse_setting

    with pytest.raises(ConfigError, match="min_tokens takes an integer"):
        parse_setting("min_tokens", "many")
    with pytest.raises(ConfigError, match="unknown setting 'alpah'; known: .*alpha"):
        parse_setting("alpah", "1")


def _flags(parser) -> set[str]:
    import re

    return set(re.findall(r"--[a-z][a-z-]*", parser.format_help()))


def test_every_setting_is_a_flag_of_every_command():
    """Flags are derived from the config: none missing, none copied by hand."""
    from infinigen.bench.decode import build_parser as bench_parser
    from infinigen.cli import EVAL_FIXED, build_parser, eval_overrides
    from infinigen.config import setting_fields

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices  # argparse's subcommands
    for name in setting_fields():
        flag = "--" + name.replace("_", "-")
        assert flag in _flags(sub["generate"]), name
        assert flag in _flags(bench_parser()) or name == "policy", name
        assert flag in _flags(sub["demo"]) or name == "policy", name
        assert flag in _flags(sub["skew"]) or name == "policy", name
        if name not in EVAL_FIXED:
            default = getattr(InfiniGenConfig(), name)
            text = ",".join(f"{k}:{v}" for k, v in default.items()) if isinstance(default, dict) else str(default)
            assert eval_overrides([f"{name}={text}"]) == {name: default}, name


def test_flags_build_the_same_config_as_the_api():
    from infinigen.cli import build_parser
    from infinigen.cli_settings import RUN_DEFAULTS, from_arguments

    argv = [
        "generate",
        "--alpha",
        "4",
        "--no-skew",
        "--policy",
        "h2o",
        "--recent-ratio",
        "0.25",
        "--layer-alpha",
        "3:2",
    ]
    args = build_parser().parse_args(argv)
    cfg = from_arguments(args, RUN_DEFAULTS)
    want = InfiniGenConfig(
        alpha=4.0, skew=False, policy="h2o", recent_ratio=0.25, layer_alpha={3: 2.0}, kv_dtype="float16"
    )
    assert cfg == want


def test_an_empty_kv_dir_is_refused_not_read_as_the_current_folder():
    with pytest.raises(ConfigError, match="kv_dir must be a folder path"):
        InfiniGenConfig(tier="disk", kv_dir=" ")


INFINIGEN_KNOBS = (
    "alpha",
    "partial_ratio",
    "partial_format",
    "aggregation",
    "skew",
    "calibration_tokens",
    "min_tokens",
    "block_tokens",
    "unit_keys",
    "unit_score",
    "unit_heads",
    "layer_alpha",
    "allocation",
    "channel_allocation",
    "correction",
    "correction_target",
    "speculate_from",
)


def _group_flags(parser, title: str) -> set[str]:
    group = next(g for g in parser._action_groups if g.title == title)  # argparse keeps no public list
    return {flag for action in group._group_actions for flag in action.option_strings if not flag.startswith("--no-")}


def test_research_switches_are_a_group_of_their_own_and_still_flags():
    """`--help` leads with the few settings a user chooses; InfiniGen's knobs (and the baselines')
    are listed apart, yet each is a flag and an `eval --set` key like any other."""
    from infinigen.cli import build_parser, eval_overrides
    from infinigen.cli_settings import ADVANCED_GROUP, USER_GROUP
    from infinigen.config import advanced_settings, setting_fields
    from infinigen.select.infinigen import SpeculationKnobs

    advanced = set(advanced_settings())
    assert {f.name for f in dataclasses.fields(SpeculationKnobs)} - {"budget", "budget_tokens"} == set(INFINIGEN_KNOBS)
    assert set(INFINIGEN_KNOBS) <= advanced
    assert {"policy", "budget", "tier", "kv_dir", "block_cache", "host_capacity", "kv_dtype"}.isdisjoint(advanced)
    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    flag = {name: "--" + name.replace("_", "-") for name in setting_fields()}
    assert _group_flags(generate, ADVANCED_GROUP) == {flag[n] for n in advanced}
    assert _group_flags(generate, USER_GROUP) == {flag[n] for n in setting_fields() if n not in advanced}
    assert ADVANCED_GROUP in generate.format_help()
    args = build_parser().parse_args(["generate", "--partial-ratio", "0.5", "--no-skew"])
    assert (args.partial_ratio, args.skew) == (0.5, False)
    assert eval_overrides(["partial_ratio=0.5"]) == {"partial_ratio": 0.5}


def test_docs_list_exactly_the_settings_of_the_config():
    """docs/settings.md is generated from the config; it cannot drift from it."""
    from pathlib import Path

    from infinigen.cli_settings import settings_markdown
    from infinigen.config import advanced_settings, setting_fields

    text = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text(encoding="utf-8")
    rows = [line.split("|")[1:4] for line in text.splitlines() if line.startswith("| `")]
    listed = {name.strip().strip("`"): kind.strip() for name, _, kind in rows}
    assert len(rows) == len(listed) == len(setting_fields())
    assert listed == {n: ("advanced" if n in advanced_settings() else "user") for n in setting_fields()}
    assert text == settings_markdown(), "docs/settings.md is stale: python -m infinigen.cli_settings > docs/settings.md"
