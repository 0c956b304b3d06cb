"""What a cache will keep next to the compute, planned before it holds anything, and fitted into
a memory budget (`compute_memory`).

`estimate` is the arithmetic of every part `infinigen.memory` counts (`memory.PARTS`), from the
shapes a generation will reach: the model's layers and heads, the batch, the positions, the
dtypes, the policy's roles and the selector's state. It is held to the measured counters by
`tests/test_budget.py` (never below them, at most a stated margin above).

`plan` fits a config into a budget (a size, or a share of what dense keeps for the request),
lossless changes first: the disk tier's block cache shrinks, then its rounds of reads
(`read_chunk`, down to `PLANNED_READ_CHUNK`; speed only); then the layers that read every row
read it in chunks (`fetch_chunk`: the largest chunk the budget leaves, at least
`PLANNED_FETCH_CHUNK`), the dense layers read from the tier instead of kept (speed only); then
the sliding-window layers' windows read back from the tier each step (`windows_on_compute`;
speed only); then InfiniGen's partial keys go to a lower precision (int8, then int4:
`partial_format`). A request that does not fit even then is refused in one sentence (`MemoryBudgetError`), before any KV is
computed.

The default, `compute_memory="auto"`, is a target rather than a limit: an offloading policy is
planned within `infinigen.config.AUTO_SHARE` of dense's KV by the steps that leave its output
unchanged alone (the partial keys keep the precision asked for), and where none of those plans
fits, the smallest is taken and its changes say by how much it misses (a default never refuses a
request the cache can serve).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from infinigen.errors import InputError
from infinigen.layers import ComputeLayer, LocalLayer, Positions, reads_in_place
from infinigen.memory import PARTS, dense_kv_bytes, format_bytes
from infinigen.prefill import PREFILL_CHUNK
from infinigen.roles import Role
from infinigen.storage import rows_dtype
from infinigen.storage.disk import DiskTier
from infinigen.transfer import RowBuffers

# The fewest positions per read when a plan chunks every-row reads (128 KiB a region at d = 64).
PLANNED_FETCH_CHUNK = 512
# The smallest round of disk reads a plan shrinks `read_chunk` to (a quarter of the largest request).
PLANNED_READ_CHUNK = 256 << 10
CHUNKED = "every-row reads in chunks"  # a plan's change; the chunk it sized follows
WINDOWS = "sliding windows read from the tier"


class MemoryBudgetError(InputError):
    """The request does not fit the compute memory budget, whatever the plan gives up."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Request:
    """What a generation will reach: batch rows and positions (prompt + new tokens)."""

    batch: int
    positions: int


def estimate(config, adapter, selector, request: Request, compute_dtype: torch.dtype) -> dict[str, int]:
    """Bytes each part of `memory.PARTS` will hold with the compute at the end of `request`."""
    b, n = request.batch, request.positions
    hkv, d = adapter.num_kv_heads, adapter.head_dim
    kv_dtype = config.storage_dtype() or compute_dtype
    parts = dict.fromkeys(PARTS, 0)
    roles = config.layer_roles(adapter)
    offloaded = [i for i, r in enumerate(roles) if r.offloaded]
    for i, role in enumerate(roles):
        if role == Role.COMPUTE:
            parts["dense_layers"] += ComputeLayer.planned_bytes(b, hkv, n, d, kv_dtype)
        elif role == Role.LOCAL:
            parts["local_layers"] += LocalLayer.planned_bytes(b, hkv, n, d, kv_dtype, adapter.window(i))
        elif role == Role.SELECT and selector is not None:
            parts["speculation_state"] += selector.state_bytes(i, b, n, n, kv_dtype)  # reserved for n
    held = transfer_rows(config, adapter, selector, n)
    # a layer read in chunks lands the next chunk in a second pair of its parity
    chunked = {i % 2 for i, r in enumerate(roles) if r == Role.FETCH_ALL} if config.fetch_chunk else set()
    second = tuple(min(config.fetch_chunk, n) if parity in chunked else 0 for parity in (0, 1))
    rows = rows_dtype(config.spec.fmt, kv_dtype, compute_dtype)  # what a selection's rows are read back as
    parts["transfer_buffers"] = RowBuffers.planned_bytes(
        held.stored, held.whole, second, 2 * b * hkv * d, rows, compute_dtype
    )
    parts["metadata"] = Positions.planned_bytes(b, n)
    if offloaded and config.spec.placement == "offload" and config.tier == "disk" and config.spec.fmt != "int4":
        span = max((_range_read(config, adapter, i, r, n) for i, r in enumerate(roles)), default=0)
        _disk_parts(parts, config, request, hkv, d, kv_dtype, offloaded, held.most, span)
    return parts


def _range_read(config, adapter, layer: int, role: Role, positions: int) -> int:
    """The positions of one region a step's range read of `layer` takes: every row (all at once
    or a chunk at a time), a sliding window; 0 for a layer that reads no range."""
    if role == Role.FETCH_ALL:
        return min(config.fetch_chunk, positions) if config.fetch_chunk else positions
    if role == Role.WINDOW:
        return min(adapter.window(layer) - 1, positions)
    return 0


@dataclass(frozen=True)
class TransferRows:
    """The most rows one step of an offloaded layer reads, by the kind of buffer they land in
    (`transfer.RowBuffers`) and by the parity of the layer's index (layers of one parity share a
    pair of each kind): `stored`, a selection's rows, a chunk of every row or a window, in the
    tier's dtype; `whole`, every row of a layer read at once and the new token, in the compute
    dtype. 0: no layer of that parity uses the kind."""

    stored: tuple[int, int] = (0, 0)
    whole: tuple[int, int] = (0, 0)

    @property
    def most(self) -> int:
        """The most rows any step reads."""
        return max(*self.stored, *self.whole)


def _device_type(adapter) -> str:
    """Where the model computes ("cpu" for a model split across devices' first part)."""
    try:
        return next(adapter.model.parameters()).device.type
    except (AttributeError, StopIteration):
        return "cpu"


def transfer_rows(config, adapter, selector, positions: int) -> TransferRows:
    """What the transfer buffers of a generation reaching `positions` hold (all zero when nothing
    is offloaded)."""
    stored, whole = [0, 0], [0, 0]
    for i, role in enumerate(config.layer_roles(adapter)):
        if not role.offloaded:
            continue
        if role == Role.SELECT and selector is not None:
            if reads_in_place(config.tier, config.spec.fmt, config.host_capacity is not None, selector.observes,
                              adapter.head_dim, _device_type(adapter)):  # fmt: skip
                continue  # attended where the tier keeps them: no buffer
            rows = min(selector.max_rows(i, positions), positions)
        elif role == Role.WINDOW or config.fetch_chunk:  # the window, or every row a chunk at a time
            rows = _range_read(config, adapter, i, role, positions)
        else:
            whole[i % 2] = max(whole[i % 2], positions)  # every row: the past ones and the new token
            continue
        stored[i % 2] = max(stored[i % 2], rows)
    return TransferRows(tuple(stored), tuple(whole))


def _disk_parts(
    parts, config, request: Request, hkv: int, d: int, kv_dtype, layers: list[int], rows: int, span: int
) -> None:
    """The disk tier's RAM, as the tier plans it (`DiskTier.planned_bytes`): block cache (and its
    maps), tails, the shared read and staging buffers. `span`: the most positions of one region a
    step's range read takes (0: no layer reads a range)."""
    planned = DiskTier.planned_bytes(
        regions=request.batch * hkv,
        row_bytes=2 * d * _itemsize(kv_dtype),
        positions=request.positions,
        layers=len(layers),
        block_cache=config.block_cache,
        read_chunk=config.read_chunk_bytes,
        span=span,
        rows=rows,
        appended=min(request.positions, PREFILL_CHUNK),  # a prefill chunk's staging
        directory=config.kv_dir,
    )
    for part, nbytes in planned.items():
        parts[part] += nbytes


@dataclass(frozen=True)
class Plan:
    """A config fitted to `budget` (None: no budget), what it will keep, and what was changed."""

    config: object
    selector: object
    request: Request
    parts: dict[str, int]
    budget: int | None
    changes: tuple[str, ...]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> dict:
        """JSON-safe: the budget, the request, the estimate by part and what was given up."""
        return {
            "compute_memory": self.config.compute_memory,  # as written: a size, a share of dense's KV, or auto
            "compute_memory_bytes": self.budget,
            "batch": self.request.batch,
            "positions": self.request.positions,
            "estimated_compute_kv_bytes": self.total,
            "estimated_parts": dict(self.parts),
            "changes": list(self.changes),
        }


def plan(config, adapter, selector_for, request: Request, compute_dtype: torch.dtype) -> Plan:
    """Fit `config` into its `compute_memory` (see the module docstring). `selector_for(config)`
    gives the selector a config makes (the plan may change the partial keys' format)."""
    dense = dense_kv_bytes(adapter, request.batch, request.positions, config.storage_dtype() or compute_dtype)
    budget = config.compute_memory_bytes(dense)
    if budget is None:
        selector = selector_for(config)
        return Plan(config, selector, request, estimate(config, adapter, selector, request, compute_dtype), None, ())
    tried = []  # (parts, the candidate at its smallest, its selector, the changes it made)
    for candidate, changes in _candidates(config, adapter, lossy=not config.aims):
        selector = selector_for(candidate)
        size = functools.partial(
            estimate, adapter=adapter, selector=selector, request=request, compute_dtype=compute_dtype
        )
        lean = _lean(candidate)
        tried.append((size(lean), lean, selector, changes))
        if sum(tried[-1][0].values()) > budget:
            continue
        fits = _Fits(size, budget)
        candidate, changes = _loosen(config, candidate, lean, changes, fits, request.positions)
        return Plan(candidate, selector, request, size(candidate), budget, tuple(changes))
    least, lean, selector, changes = min(tried, key=lambda t: sum(t[0].values()))
    need = sum(least.values())
    if config.aims:  # the default target is no limit: the smallest plan that keeps the output, and the miss
        aim, least_share = 100 * budget / max(dense, 1), 100 * need / max(dense, 1)
        missed = f"aim {aim:.1f} % of dense's KV not met: at least {format_bytes(need)} = {least_share:.1f} %"
        return Plan(lean, selector, request, least, budget, (*_leaned(config, lean, changes), missed))
    biggest = sorted(((v, k) for k, v in least.items() if v), reverse=True)[:2]
    largest = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for v, k in biggest)
    share = f" ({100 * budget / dense:.1f} % of dense's KV)" if dense else ""
    raise MemoryBudgetError(
        f"{request.batch} x {request.positions} positions need at least {format_bytes(need)} next to the compute "
        f"under policy {config.policy!r} ({largest}) "
        f"but compute_memory is {format_bytes(budget)}{share}: lower the batch or the length, or raise compute_memory"
    )


@dataclass(frozen=True)
class _Fits:
    """Whether a config's estimate fits the budget."""

    size: object
    budget: int

    def __call__(self, config) -> bool:
        return sum(self.size(config).values()) <= self.budget


def _loosen(config, candidate, lean, changes: tuple[str, ...], fits: _Fits, positions: int):
    """Given that `lean` fits: back from it towards `candidate`, in the order the speed gained
    per byte kept: the largest rounds of disk reads (every offloaded layer's gathers), then the
    largest every-row chunk (when the plan chose chunks; the few layers that read every row),
    then the largest block cache that fit; with the changes from `config` each made."""
    if lean.read_chunk != candidate.read_chunk:
        rounds = candidate.read_chunk_bytes
        if not fits(lean.replace(read_chunk=candidate.read_chunk)):
            step = min(64 << 10, PLANNED_READ_CHUNK)  # rounds sized to whole steps
            rounds = step * _largest(
                lambda n: fits(lean.replace(read_chunk=str(n * step))), PLANNED_READ_CHUNK // step, rounds // step
            )
            changes = (*changes, _rounds_change(config, rounds))
        candidate, lean = candidate.replace(read_chunk=str(rounds)), lean.replace(read_chunk=str(rounds))
    if candidate.fetch_chunk != config.fetch_chunk:  # chunks the plan chose: the largest that fits
        chunk = _largest(lambda c: fits(lean.replace(fetch_chunk=c)), candidate.fetch_chunk, positions)
        candidate, lean = candidate.replace(fetch_chunk=chunk), lean.replace(fetch_chunk=chunk)
        changes = tuple(f"{c} of {chunk} positions" if c == CHUNKED else c for c in changes)
    if not fits(candidate):  # the largest block cache that fits (it only speeds reads)
        low, high = 0.0, candidate.block_cache
        for _ in range(20):
            mid = (low + high) / 2
            low, high = (mid, high) if fits(candidate.replace(block_cache=mid)) else (low, mid)
        fitted = candidate.replace(block_cache=math.floor(low * 1e4) / 1e4)  # rounded down: it still fits
        if not fits(fitted):
            fitted = lean
        changes = (*changes, _block_cache_change(config, fitted.block_cache))
        candidate = fitted
    return candidate, changes


def _leaned(config, lean, changes: tuple[str, ...]) -> tuple[str, ...]:
    """The changes from `config` to `lean` (a candidate at its smallest), in the words `_loosen` uses."""
    changes = tuple(f"{c} of {lean.fetch_chunk} positions" if c == CHUNKED else c for c in changes)
    if lean.block_cache != config.block_cache:
        changes = (*changes, _block_cache_change(config, lean.block_cache))
    if lean.read_chunk != config.read_chunk:
        changes = (*changes, _rounds_change(config, lean.read_chunk_bytes))
    return changes


def _block_cache_change(config, fraction: float) -> str:
    return f"block cache {config.block_cache:g} -> {fraction:g}"


def _rounds_change(config, nbytes: int) -> str:
    return f"disk read rounds {config.read_chunk} -> {format_bytes(nbytes)}"


def _lean(config):
    """`config` with what only speeds reads given up: no block cache, the smallest rounds of
    disk reads a plan takes."""
    lean = config.replace(block_cache=0.0) if config.block_cache else config
    if config.tier == "disk" and config.read_chunk_bytes > PLANNED_READ_CHUNK:
        lean = lean.replace(read_chunk=str(PLANNED_READ_CHUNK))
    return lean


def _largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), given fits(low) and that fitting only gets
    harder as n grows."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _candidates(config, adapter, lossy: bool = True):
    """Configs to try, in order: as given; then (lossless, slower) the layers that read every row
    read in chunks, the dense layers among them instead of kept with the compute; then the sliding
    windows read back from the tier too; then InfiniGen's partial keys int8 / int4, each without
    and with those steps (chunks of a short context can hold more than the dense layers they
    replace). Each with the changes it made; a step that changes no layer of this model is not
    offered."""
    formats = [(config, ())]
    if lossy and config.policy == "infinigen":
        order = ["kv", "int8", "int4"]
        for fmt in order[order.index(config.partial_format) + 1 :]:
            formats.append((config.replace(partial_format=fmt), (f"partial keys {config.partial_format} -> {fmt}",)))
    out = []
    for candidate, changes in formats:
        out.append((candidate, changes))
        if config.spec.placement != "offload":
            continue
        roles, lean, steps = set(candidate.layer_roles(adapter)), candidate, []
        if not config.fetch_chunk and roles & {Role.COMPUTE, Role.FETCH_ALL}:
            steps = ["dense layers read from the tier", CHUNKED] if Role.COMPUTE in roles else [CHUNKED]
            lean = candidate.replace(fetch_chunk=PLANNED_FETCH_CHUNK, dense_layers_on_compute=False)
            out.append((lean, (*steps, *changes)))  # `plan` names the chunk it sizes
        if Role.LOCAL in roles and config.spec.fmt == "native":
            out.append((lean.replace(windows_on_compute=False), (*steps, WINDOWS, *changes)))
    return out
