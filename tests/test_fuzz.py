"""Fuzzing the inputs: random values of every setting (through the API and the command line) and
random shapes and dtypes into the cache and its tiers. Every input is either accepted and gives
the right answer, or refused with one clear sentence (an `InfiniGenError`): never a traceback
from deep inside, never a silently wrong result. Seeded, so a failure replays."""

from __future__ import annotations

import math
import random
import typing

import pytest
import torch

from conftest import VOCAB, left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.cli_settings import add_arguments, from_arguments, parse_setting
from infinigen.compat import cache_kwargs
from infinigen.config import ConfigError, SpeculationKnobs, setting_fields, setting_type
from infinigen.errors import InfiniGenError
from infinigen.storage import DiskTier, Int4RamTier, RamTier, TransferStats, roundtrip

INF = float("inf")


def _one_sentence(exc: BaseException) -> str:
    text = str(exc)
    assert isinstance(exc, InfiniGenError), f"{type(exc).__name__} is not one of infinigen's errors: {text}"
    assert text and "\n" not in text, repr(text)
    return text


# ---------------------------------------------------------------------- values of every setting
def _candidates(name: str, folders: dict) -> tuple[list, list]:
    """(valid, invalid) values for setting `name`, by its type and rule; "valid" ones pass the
    field's own rule (a combination of them may still be refused)."""
    if name == "kv_dir":
        return [None, folders["ok"]], [folders["missing"], folders["file"], 3, ""]
    hint = setting_type(name)
    if typing.get_origin(hint) is dict:  # layer_alpha: {layer: alpha}
        return [{}, {2: 6.0}, {3: 0.0}, {2: INF}, {-1: 1.0}, {10**6: 1.0}], [{2: -1.0}, {"2": 1.0}, {2: "x"}, [1], None]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    inner = args[0] if args else hint
    optional = [None] if type(None) in typing.get_args(hint) else []
    rule = setting_fields()[name].metadata.get("rule")
    if rule is not None and rule.text.startswith("one of"):
        choices = [c.strip() for c in rule.text[len("one of ") :].split(",") if c.strip() != "None"]
        return choices + optional, ["bogus", "", 3] + ([] if optional else [None])
    if inner is bool:
        return [True, False], ["yes", 1, None]
    if inner is int:
        pool, bad = [0, 1, 2, 3, 4, 8, 16, 64, 10**6], [-1, 2.5, True, "3"]
    else:
        pool, bad = [0.0, 1e-9, 0.05, 0.1, 0.3, 0.5, 1.0, 4.0, 9.0, INF], [-1.0, float("nan"), True, "0.5"]
    valid = [v for v in pool if rule is None or rule.ok(v)] + optional
    invalid = [v for v in pool if rule is not None and not rule.ok(v)] + bad + ([] if optional else [None])
    return valid, invalid


def _random_settings(rng: random.Random, folders: dict) -> dict:
    """About a third of the settings set, to valid values; in two configs of five, one of them
    set to an invalid value instead."""
    out = {}
    for name in setting_fields():
        if name != "measure_recall" and rng.random() < 0.35:  # measure_recall only adds an evaluation
            out[name] = rng.choice(_candidates(name, folders)[0])
    if out and rng.random() < 0.4:
        name = rng.choice(sorted(out))
        out[name] = rng.choice(_candidates(name, folders)[1])
    return out


@pytest.fixture
def folders(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "a-file").write_text("x")
    return {"ok": str(tmp_path / "kv"), "missing": str(tmp_path / "missing"), "file": str(tmp_path / "a-file")}


def _lossless(cfg: InfiniGenConfig) -> bool:
    """Settings under which every row reaches attention, exactly: the tokens of a plain model."""
    if cfg.kv_dtype not in (None, "float32") or cfg.spec.fmt != "native":
        return False
    if cfg.policy in ("dense", "full"):
        return True
    return (
        cfg.policy == "infinigen"
        and math.isinf(cfg.alpha)
        and all(math.isinf(a) for a in cfg.layer_alpha.values())
        and cfg.knobs(SpeculationKnobs).budget >= 1.0
        and cfg.budget_tokens is None
        and cfg.host_capacity is None
    )


def _generate(model, cfg, ids, mask, new_tokens, known_length: bool):
    with attach(model, cfg, progress=False) as session:
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if not known_length:
            out = model.generate(**kwargs)
            return out, session.last_cache.summary(), session.last_cache.config
        with session.new_cache(max_length=ids.shape[1] + new_tokens) as cache:
            out = model.generate(**kwargs, **cache_kwargs(model, cache))
            return out, cache.summary(), cache.config


def test_random_settings_through_the_api(folders):
    rng = random.Random(14)
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=24, pad=5)
    new = 4
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    outcomes = {"refused": 0, "ran": 0, "lossless": 0, "disk": 0, "failed clearly": 0}
    for trial in range(120):
        values = _random_settings(rng, folders)
        if trial % 5 == 0:  # the disk tier in one trial of five, unless the draw named a tier
            values.setdefault("tier", "disk")
        try:
            cfg = InfiniGenConfig(**values)
        except Exception as exc:  # noqa: BLE001 - what is checked is the kind of exception
            text = _one_sentence(exc)
            assert isinstance(exc, ConfigError) and any(name in text for name in values), (trial, values, text)
            outcomes["refused"] += 1
            continue
        try:
            out, summary, used = _generate(model, cfg, ids, mask, new, known_length=trial % 2 == 0)
        except Exception as exc:  # noqa: BLE001
            _one_sentence(exc)
            outcomes["failed clearly"] += 1
            continue
        outcomes["ran"] += 1
        assert out.shape == (2, ids.shape[1] + new) and int(out.min()) >= 0 and int(out.max()) < VOCAB
        assert summary["decode_steps"] == new - 1
        frac = summary["fetched_fraction"]
        assert frac is None or 0 <= frac <= 1, (values, frac)
        if _lossless(cfg):
            outcomes["lossless"] += 1
            assert torch.equal(out, plain), (trial, values)
        if cfg.tier == "disk" and cfg.spec.placement == "offload":
            outcomes["disk"] += 1
            # The tier never changes a result at the same unit (left unset, the disk's unit is its block).
            same = cfg.replace(
                tier="ram", block_tokens=used.block_tokens, budget=used.budget, correction=used.correction
            )
            ram, _, _ = _generate(model, same, ids, mask, new, known_length=True)
            assert torch.equal(out, ram), (trial, values)
    # The fuzz reached every kind of outcome (else its value lists need widening).
    assert all(outcomes.values()), outcomes


def _flag_text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def _cli_flags(values: dict) -> list[str]:
    flags = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if setting_type(name) is bool:
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            continue  # a non-bool value cannot be written as a switch
        flags.append(f"{flag}={_flag_text(value)}")  # '=' so that a value may start with '-'
    return flags


def test_the_command_line_and_the_api_agree_on_every_setting(folders, capsys):
    """A flag's text parses to the value the API takes, or the command line refuses it (one
    line); the config built from the flags is the API's config of the same values, or both
    refuse it with the same sentence."""
    from infinigen.cli import Parser

    rng = random.Random(41)
    for _ in range(300):
        values = {k: v for k, v in _random_settings(rng, folders).items() if setting_type(k) is not bool or v in (0, 1)}
        typed = {}
        for name, value in values.items():
            try:
                typed[name] = bool(value) if setting_type(name) is bool else parse_setting(name, _flag_text(value))
            except ConfigError as exc:
                _one_sentence(exc)
                typed = None
                break
        parser = Parser(prog="infinigen generate")
        add_arguments(parser)
        try:
            args = parser.parse_args(_cli_flags({k: typed[k] if typed else v for k, v in values.items()}))
        except SystemExit:
            err = capsys.readouterr().err
            assert typed is None and len(err.splitlines()) == 1 and err.startswith("error: argument --"), err
            continue
        assert typed is not None
        try:
            from_cli = from_arguments(args)
        except ConfigError as exc:
            from_cli = exc
        try:
            from_api = InfiniGenConfig(**typed)
        except ConfigError as exc:
            assert isinstance(from_cli, ConfigError) and str(from_cli) == _one_sentence(exc)
            continue
        assert from_cli == from_api, (values, typed)


def test_random_settings_on_the_command_line(folders, tiny_model_dir, capsys):
    from infinigen.cli import main

    rng = random.Random(7)
    ran = refused = 0
    for _ in range(30):
        values = _random_settings(rng, folders)
        values.setdefault("calibration_tokens", 128)  # keep the fuzz quick: calibrate on 128 tokens
        argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello, world.", "--max-new-tokens", "3"]
        argv += ["--quiet", *_cli_flags(values)]
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        out, err = capsys.readouterr()
        if rc == 0:
            ran += 1
            assert "3 new tokens" in out and err == "", (values, err)
        else:
            refused += 1
            lines = err.splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), (values, err)
            assert "internal error" not in lines[0] and "Traceback" not in err, (values, err)
    assert ran and refused


# ---------------------------------------------------------------------- shapes and dtypes into the tiers
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.complex64]  # fmt: skip


def _tensor(rng: random.Random, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(*shape, generator=g) * 3
    if dtype == torch.complex64:
        return torch.complex(x, x)
    if dtype == torch.bool:
        return x > 0
    x = x.to(dtype)
    return x.transpose(-1, -2).contiguous().transpose(-1, -2) if rng.random() < 0.3 and x.dim() >= 2 else x


def _perturb(rng: random.Random, shape: tuple) -> tuple:
    shape = list(shape)
    r = rng.random()
    if r < 0.5:
        return tuple(shape)
    if r < 0.6:
        return tuple(shape[:-1])
    if r < 0.7:
        return (*shape, 1)
    i = rng.randrange(len(shape))
    shape[i] = rng.choice([0, 1, shape[i] + 1, max(shape[i] - 1, 0)])
    return tuple(shape)


@pytest.mark.parametrize("kind", ["ram", "disk", "int4"])
def test_random_shapes_and_dtypes_into_a_tier(kind, tmp_path):
    rng = random.Random(hash(kind) % 1000)
    b, h, d, dtype = 2, 2, 16, torch.float16
    stats = TransferStats()
    tier = {
        "ram": lambda: RamTier(b, h, d, dtype, stats),
        "disk": lambda: DiskTier(b, h, d, dtype, stats, capacity=400, directory=tmp_path, allow_buffered=True),
        "int4": lambda: Int4RamTier(b, h, d, dtype, stats),
    }[kind]()
    fmt = "int4" if kind == "int4" else "native"
    stored_k, stored_v = [], []
    accepted = refused = 0
    try:
        for _ in range(300):
            if rng.random() < 0.5:  # an append
                n = rng.choice([1, 1, 3, 17])
                kshape = _perturb(rng, (b, h, n, d))
                vshape = kshape if rng.random() < 0.85 else _perturb(rng, kshape)
                kd = rng.choice(DTYPES) if rng.random() < 0.3 else torch.float32
                vd = kd if rng.random() < 0.9 else rng.choice(DTYPES)
                k, v = _tensor(rng, kshape, kd), _tensor(rng, vshape, vd)
                valid = None if rng.random() < 0.7 else _tensor(rng, _perturb(rng, (b, kshape[2] if kshape else 1)),
                                                                 rng.choice([torch.bool, torch.int64]))  # fmt: skip
                if tier.length + (kshape[2] if len(kshape) > 2 else 0) > 400:
                    continue
                try:
                    tier.append(k, v, valid)
                except Exception as exc:  # noqa: BLE001
                    _one_sentence(exc)
                    refused += 1
                    continue
                accepted += 1
                if k.shape[2]:
                    stored_k.append(roundtrip(fmt, k.to(torch.float32), dtype))
                    stored_v.append(roundtrip(fmt, v.to(torch.float32), dtype))
            elif tier.length:  # a gather
                m = rng.choice([1, 4, 9])
                ishape = _perturb(rng, (b, h, m))
                idx_dtype = rng.choice([torch.int64, torch.int64, torch.int32, torch.float32, torch.bool])
                idx = (torch.rand(ishape) * (tier.length + (2 if rng.random() < 0.2 else 0))).floor()
                idx = idx.to(idx_dtype) if idx_dtype != torch.bool else idx > 0
                valid_dtype = torch.bool if rng.random() < 0.8 else rng.choice([torch.int64, torch.uint8])
                valid = (torch.rand(ishape if rng.random() < 0.9 else _perturb(rng, ishape)) < 0.7).to(valid_dtype)
                out_dtype = torch.float32 if rng.random() < 0.8 else rng.choice(DTYPES)
                try:
                    got_k, got_v = tier.gather(idx, valid, torch.device("cpu"), out_dtype)
                except Exception as exc:  # noqa: BLE001
                    _one_sentence(exc)
                    refused += 1
                    continue
                accepted += 1
                ref_k = torch.cat(stored_k, 2)
                ref_v = torch.cat(stored_v, 2)
                pos = idx.long().clamp(0, tier.length - 1)
                want_k = torch.gather(ref_k, 2, pos[..., None].expand(-1, -1, -1, d)).to(out_dtype)
                want_v = torch.gather(ref_v, 2, pos[..., None].expand(-1, -1, -1, d)).to(out_dtype)
                sel = valid
                assert torch.equal(got_k[sel], want_k[sel]) and torch.equal(got_v[sel], want_v[sel])
                assert not got_k[~sel].any()
    finally:
        tier.close()
    assert accepted > 20 and refused > 20, (accepted, refused)


# ---------------------------------------------------------------------- shapes and dtypes into the cache
@pytest.mark.parametrize("policy,tier", [("infinigen", "ram"), ("full", "disk"), ("int4", "ram"), ("dense", "ram")])
def test_random_updates_into_the_cache(policy, tier, tmp_path):
    """`cache.update` as transformers calls it, with random shapes, dtypes and layer indices:
    accepted ones return every position so far (as stored), refused ones say why."""
    rng = random.Random(len(policy) * 7 + len(tier))
    model = tiny_model("llama")  # 4 layers, 2 KV heads of 16 channels, 256 positions
    cfg = InfiniGenConfig(policy=policy, tier=tier, kv_dir=str(tmp_path), calibration_tokens=64, kv_dtype="float16")
    fmt = cfg.spec.fmt
    b, h, d = 2, 2, 16
    accepted = refused = 0
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(4)}
        for _ in range(160):
            layer = rng.choice([0, 1, 2, 3, 0, 1, 2, 3, -1, 4, "0", 1.0])
            n = rng.choice([1, 1, 2, 6])
            kshape = _perturb(rng, (b, h, n, d))
            vshape = kshape if rng.random() < 0.9 else _perturb(rng, kshape)
            kd = torch.float32 if rng.random() < 0.8 else rng.choice(DTYPES)
            k, v = _tensor(rng, kshape, kd), _tensor(rng, vshape, kd)
            try:
                got_k, got_v = cache.update(k, v, layer)
            except Exception as exc:  # noqa: BLE001
                _one_sentence(exc)
                refused += 1
                continue
            accepted += 1
            role = cfg.layer_role(layer)
            held[layer].append((k, v))
            want_k = torch.cat([x for x, _ in held[layer]], 2)
            want_v = torch.cat([y for _, y in held[layer]], 2)
            # past positions come back as stored (layers kept with the compute store the KV's
            # storage dtype too), the new ones as given
            stored_as = fmt if role != "compute" else "native"
            past = want_k.shape[2] - k.shape[2]
            want_k[:, :, :past] = roundtrip(stored_as, want_k[:, :, :past], cfg.storage_dtype())
            want_v[:, :, :past] = roundtrip(stored_as, want_v[:, :, :past], cfg.storage_dtype())
            assert got_k.dtype == want_k.dtype and torch.equal(got_k, want_k), (layer, role)
            assert torch.equal(got_v, want_v)
    assert accepted > 10 and refused > 10, (accepted, refused)
