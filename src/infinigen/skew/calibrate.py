"""Calibration: run the model once over real text, capture every layer's queries and keys, and
compute the skew artifact from them.

For RoPE models the queries are rotated by position before the dot product, so the statistics
depend on position: calibration runs over a sequence as long as the contexts to be decoded.
The capture observes the model through forward pre-hooks that are removed before it returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sysconfig
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from infinigen.models import ModelAdapter
from infinigen.progress import bar as progress_bar
from infinigen.progress import ticking
from infinigen.skew.artifact import SkewArtifact, model_fingerprint
from infinigen.skew.channels import skew_from_qk
from infinigen.skew.query_map import QUERY_MAP_DTYPE, apply_query_map, fit_query_map, own_projection, project_queries
from infinigen.skew.tables import (
    CORRECTION_BUDGETS,
    CORRECTION_SHARES,
    RECALL_GRID,
    SPECULATED_INPUTS,
    channel_grid,
    correction_error_table,
    oracle_recall_curve,
    partial_recall_table,
)
from infinigen.speculate import partial_projection

RECALL_QUERIES = 48  # decode positions sampled per layer for the recall curves

MAX_DEFAULT_CALIBRATION = 8192
# The default calibration alternates blocks of prose and source code, so that the skew, the
# query maps and the budget allocation are fitted on more than one genre: fitted on prose alone
# they generalized worse to source code no choice had seen (docs/CHANGELOG.md, commit c58a098).
CALIBRATION_BLOCK = 1024  # tokens per block
# Python source read from the interpreter's own standard library (present wherever Python is),
# packages the `code` evaluation genre does not use (it reads the top-level modules).
CALIBRATION_CODE_PACKAGES = ("json", "email", "asyncio")
_CODE_CHARS = 240_000  # enough source for 16K calibration tokens of code


def calibration_text() -> str:
    """The calibration prose shipped with the package (Milton, *Areopagitica*, 1644; public domain)."""
    return resources.files("infinigen.data").joinpath("areopagitica.txt").read_text(encoding="utf-8")


def calibration_code() -> str:
    """Python source of `CALIBRATION_CODE_PACKAGES` from this interpreter's standard library,
    files in name order, about `_CODE_CHARS` characters ("" where those packages are absent)."""
    return stdlib_source(CALIBRATION_CODE_PACKAGES, _CODE_CHARS)


def stdlib_source(packages: tuple[str, ...], chars: int) -> str:
    """The `*.py` files directly in `packages` of this interpreter's standard library, in name
    order, until about `chars` characters ("" where none is found)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for package in packages:
        for path in sorted((folder / package).glob("*.py")):
            if size >= chars:
                return "".join(parts)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            parts.append(text)
            size += len(text)
    return "".join(parts)


def default_calibration_source() -> str:
    """What the default calibration reads, as a tag stored in the artifact: a cached artifact
    calibrated on other default text (an older version's, another interpreter's sources) is
    recalibrated rather than used."""
    prose, code = calibration_text(), calibration_code()
    digest = hashlib.blake2b((prose + "\0" + code).encode(), digest_size=8).hexdigest()
    return f"{'prose+code' if code else 'prose'}:{digest}"


SYNTHETIC_SOURCE = "synthetic ids"  # the tag of a calibration on seeded random ids (no tokenizer)


def text_calibration_source(text: str) -> str:
    """The tag of a calibration on the user's own text (kept however the default changes)."""
    return "file:" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def default_calibration_tokens(adapter: ModelAdapter) -> int:
    return int(min(adapter.max_positions, MAX_DEFAULT_CALIBRATION))


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def _tail(ids: torch.Tensor, n: int) -> torch.Tensor:
    """The last `n` of `ids`; all of them repeated, cut to `n`, if there are fewer."""
    if ids.numel() < n:
        return ids.repeat(math.ceil(n / max(ids.numel(), 1)))[:n]
    return ids[-n:]


def calibration_ids(tokenizer, num_tokens: int, text: str | None = None) -> torch.Tensor:
    """[1, num_tokens] calibration ids. With `text`: its end. By default: blocks of
    `CALIBRATION_BLOCK` tokens alternating prose and code, prose first — the prose from the end
    of the shipped essay (its opening is the demo prompt, so the two never overlap), the code
    from the start of `calibration_code()`; prose alone where no code is found. Text too short
    for its share is repeated."""
    if text is not None:
        return _tail(_ids(tokenizer, text), num_tokens)[None]
    prose = _ids(tokenizer, calibration_text())
    code_text = calibration_code()
    if not code_text:
        return _tail(prose, num_tokens)[None]
    blocks = math.ceil(num_tokens / CALIBRATION_BLOCK)
    prose = _tail(prose, (blocks + 1) // 2 * CALIBRATION_BLOCK)
    code = _ids(tokenizer, code_text)
    code = _tail(code[: blocks // 2 * CALIBRATION_BLOCK], blocks // 2 * CALIBRATION_BLOCK)
    parts = [
        (prose if b % 2 == 0 else code)[b // 2 * CALIBRATION_BLOCK : (b // 2 + 1) * CALIBRATION_BLOCK]
        for b in range(blocks)
    ]
    return torch.cat(parts)[:num_tokens][None]


def synthetic_calibration_ids(vocab_size: int, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Seeded random ids, for models that come without a tokenizer (tiny test models)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=g)


@torch.no_grad()
def collect_qk(
    model: nn.Module,
    adapter: ModelAdapter,
    input_ids: torch.Tensor,
    progress: bool = True,
    query_maps: dict[int, torch.Tensor] | None = None,
    speculated: dict[int, dict[str, torch.Tensor]] | None = None,
    positions: torch.Tensor | None = None,
    values: dict[int, torch.Tensor] | None = None,
):
    """Run the model once and capture, per layer, its queries and keys as the dot product
    sees them (post-RoPE), by recomputing them from each attention module's normalized input.
    `query_maps`: if given, filled with every layer's (but the first's) query map fitted to the
    previous layer's input (`infinigen.skew.query_map`). `speculated` (with `query_maps` and
    `positions`): filled with every layer's (but the first's) speculated queries [H, P, d] at
    the P `positions`, by the name of the input they are formed from (`SPECULATED_INPUTS`): the
    previous layer's input through the layer's own projection, and through its fitted map (as
    stored, in `QUERY_MAP_DTYPE`, cross-fitted). `values`: if given, filled with every global
    (not sliding-window) layer's values [Hkv, T, d]: the correction tables read no others."""
    mods = adapter.attention_modules()
    qs: dict[int, torch.Tensor] = {}
    ks: dict[int, torch.Tensor] = {}
    previous: list[torch.Tensor] = []  # the last layer's normalized input, for the next fit
    bar = progress_bar(total=len(mods), desc="calibrating skew", unit="layer", disable=not progress)
    handles = []
    for i, mod in enumerate(mods):

        def hook(module, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings")
            projected = module.q_proj(x)
            qs[i] = adapter.query_heads(i, projected, pe)[0].to(torch.float32).cpu()  # [H, T, d]
            ks[i] = adapter.keys(i, x, pe)[0].to(torch.float32).cpu()  # [Hkv, T, d]
            if values is not None and not adapter.is_local(i):  # the correction tables' (global layers only)
                values[i] = adapter.values(i, x)[0].to(torch.float32).cpu()
            if query_maps is not None:
                if previous:
                    query_maps[i] = fit_query_map(previous[0], projected[0], own_projection(module.q_proj)).cpu()
                    if speculated is not None and positions is not None:
                        speculated[i] = _speculated_queries(
                            adapter, i, module, previous[0], projected[0], pe, positions
                        )
                previous[:] = [x[0]]
            bar.update(1)

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        device = next(model.parameters()).device
        with ticking(bar), rope_state_kept(model):
            model(input_ids=input_ids.to(device), use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return qs, ks


def _speculated_queries(adapter, layer, module, previous, target, pe, positions) -> dict[str, torch.Tensor]:
    """Layer `layer`'s speculated queries at `positions` ([H, P, d] each, float32, on the CPU),
    from the previous layer's normalized input [T, D]: through the layer's own projection, and
    through a fitted map (rounded as the artifact stores it). The fitted ones are cross-fitted:
    a position in one half of the text is speculated through the map fitted on the other half
    (`target` [T, H·d]: the layer's own query projection), so that the speculation is measured
    on text its map has not seen, as at decode. Fitted in-sample, the map looked better than it
    generalizes."""
    own = own_projection(module.q_proj)
    half = previous.shape[0] // 2
    first = fit_query_map(previous[:half], target[:half], own).to(QUERY_MAP_DTYPE)
    second = fit_query_map(previous[half:], target[half:], own).to(QUERY_MAP_DTYPE)
    late = (torch.arange(previous.shape[0], device=previous.device) >= half)[None, :, None]
    fitted = torch.where(late, apply_query_map(previous[None], first), apply_query_map(previous[None], second))
    out = {}
    for name, projected in (("previous", project_queries(module.q_proj, previous[None])), ("fitted", fitted)):
        q = adapter.query_heads(layer, projected, pe)[0]
        out[name] = q[:, positions.to(q.device)].to(torch.float32).cpu()
    return out


@contextlib.contextmanager
def rope_state_kept(model: nn.Module):
    """Run the model without changing its rotary embeddings' state: ``dynamic`` (and
    ``longrope``) RoPE recompute their frequencies from the longest sequence seen so far and
    keep them, so a calibration run longer than the text decoded next would change how that
    text is decoded."""
    saved = []
    for module in model.modules():
        if hasattr(module, "original_max_seq_len"):  # transformers' rotary embedding modules
            attrs = {k: v for k, v in vars(module).items() if k not in ("_buffers", "_parameters", "_modules")}
            saved.append((module, attrs, {k: None if b is None else b.clone() for k, b in module._buffers.items()}))
    try:
        yield
    finally:
        for module, attrs, buffers in saved:
            for k in [k for k in vars(module) if k not in attrs and k not in ("_buffers", "_parameters", "_modules")]:
                delattr(module, k)
            module.__dict__.update(attrs)
            module._buffers.clear()
            module._buffers.update(buffers)


def calibrate(
    model: nn.Module,
    adapter: ModelAdapter,
    input_ids: torch.Tensor,
    partial_ratio: float,
    skewed: bool = True,
    fingerprint: str | None = None,
    progress: bool = True,
    source: str = "given ids",
) -> SkewArtifact:
    """Compute the skew artifact of a (not yet folded) model from calibration ids [1, T]
    (`source`: what they are, stored as the artifact's "calibration" tag).

    Besides the skew, the channels and the oracle's recall curves, each layer gets the recall of
    speculating with its top c skewed channels at a few c (`tables.partial_recall_table`, at
    the same sampled positions as the recall curves): the error of a partial score is not
    spread evenly over the layers, so with `channel_allocation` "calibrated" the channels go
    where they buy the most recall, at the same mean count. And each layer but the first gets
    its query map fitted to the previous layer's input (`infinigen.skew.query_map`, for
    `speculate_from` "fitted"). And each global layer but the first gets the table from which
    the correction is chosen per layer (`tables.correction_error_table`, for both inputs of
    `SPECULATED_INPUTS`; knob `correction` None)."""
    t = int(input_ids.shape[-1])
    # decode positions over the last three quarters of the text: contexts from T/4 to T
    positions = torch.linspace(max(t // 4, 1), t - 1, min(RECALL_QUERIES, max(t - t // 4 - 1, 1))).round().long()
    positions = positions.unique()
    maps: dict[int, torch.Tensor] = {}
    speculated: dict[int, dict[str, torch.Tensor]] = {}
    values: dict[int, torch.Tensor] = {}
    qs, ks = collect_qk(
        model, adapter, input_ids, progress=progress, query_maps=maps, speculated=speculated, positions=positions,
        values=values,
    )  # fmt: skip
    skews: dict[int, torch.Tensor | None] = {}
    channels: dict[int, torch.Tensor] = {}
    orders: dict[int, torch.Tensor] = {}
    tables: dict[int, torch.Tensor] = {}
    counts = channel_grid(adapter.head_dim)
    curves: dict[int, torch.Tensor] = {}
    grid = torch.tensor(RECALL_GRID)
    corrections: dict[int, torch.Tensor] = {}
    oracle_errors: dict[int, torch.Tensor] = {}
    done = progress_bar(total=adapter.num_layers, desc="calibrating tables", unit="layer", disable=not progress)
    with ticking(done):
        for i in range(adapter.num_layers):
            a, c, order = skew_from_qk(qs[i], ks[i], adapter.num_kv_heads, partial_ratio, skewed, with_order=True)
            skews[i] = a if skewed else None
            channels[i] = c
            orders[i] = order
            curves[i] = oracle_recall_curve(qs[i], ks[i], positions, adapter.scaling(i), grid)
            tables[i] = partial_recall_table(qs[i], ks[i], positions, adapter.scaling(i), skews[i], order, counts)
            if i in speculated and not adapter.is_local(i):  # local layers are never speculated
                projection = partial_projection(skews[i], c, adapter.head_dim)
                per_input = [
                    correction_error_table(qs[i], speculated[i][name], ks[i], values[i], positions, adapter.scaling(i), projection)
                    for name in SPECULATED_INPUTS
                ]  # fmt: skip
                corrections[i] = torch.stack([errors for errors, _ in per_input])
                oracle_errors[i] = per_input[0][1]
            done.update(1)
    return SkewArtifact(
        skews=skews,
        channels=channels,
        fingerprint=fingerprint or model_fingerprint(model),
        partial_ratio=float(partial_ratio),
        skewed=skewed,
        calibration_tokens=int(input_ids.shape[-1]),
        meta={"model_type": str(model.config.model_type), "calibration": source},
        recall_curves=curves,
        recall_grid=grid,
        channel_orders=orders,
        channel_recall=tables,
        channel_grid=torch.tensor(counts, dtype=torch.long),
        query_maps={i: m.to(QUERY_MAP_DTYPE) for i, m in maps.items()},
        correction_errors=corrections,
        oracle_errors=oracle_errors,
        correction_budgets=torch.tensor(CORRECTION_BUDGETS),
        correction_shares=torch.tensor(CORRECTION_SHARES),
    )
