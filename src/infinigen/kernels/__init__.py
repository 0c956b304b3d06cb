"""Small C kernels for the decode hot path, compiled once per machine on first use.

Decoding at long context is bound by memory traffic, so each kernel reads its data where it lies,
once, on the cores torch itself uses. One job per file:
- `score.c`: partial scores of 4-bit partial-key codes against int8 queries in integer dot
  products, block by block (vLLM's pages through a block table, or the library's buffers); the
  instruction path is chosen when it runs (`isa.c`: AVX-512 VNNI, AVX-512 BW, AVX-VNNI, AVX2, or the
  portable C that CI holds every other path to, bit for bit);
- `select.c`: the selection rule over those scores (aggregation of a GQA group, the budget's cut by
  a radix select over sampled candidates, units, the correction's top-up), one row or a whole step's
  rows at once (`select_codes`, threaded);
- `attend.c`: attention of a decode position over rows as stored in 16 bits, widened in registers:
  over rows gathered into buffers (`attend`), or over chosen positions read where the tier keeps
  them (`attend_rows`, threaded, exact softmax parts merged);
- `quantize.c`: new partial keys quantized into their codes;
- `paged.c`: one decode layer of a batch over an engine's pages in one call (vLLM's plugin);
- `gather.c`: a disk tier's gather (RAM tail, block cache, coalesced reads in flight through Linux
  AIO, row assembly) without the interpreter lock.
They are plain C99 built with the system C compiler (``$CC``, else ``cc``) for the CPU they run on,
with OpenMP: the runtime torch has loaded (the same ``libgomp.so.1``), so the kernels' threads are
torch's own and the two never compete for a core. They are cached under the infinigen cache folder
keyed by the sources, the compiler flags and the CPU, and called through ctypes (no Python headers).
Without a compiler, or with ``INFINIGEN_KERNELS=0``, `available()` is False and callers use their
Python code (tensor operations), which the tests hold the kernels to; ``INFINIGEN_ISA=portable``
caps the instruction path (`isa_cap` does it for a block of code).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from infinigen.paths import default_cache_dir

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("select.c", "gather.c", "attend.c", "quantize.c", "score.c", "isa.c", "paged.c")
]
_HEADERS = [
    Path(__file__).with_name(name) for name in ("numeric.h", "isa.h", "score.h", "select.h", "attend.h", "scratch.h")
]
AGGREGATIONS = {"max": 0, "union": 1, "sum": 2, "mass": 3}
UNIT_RULES = {"max": 0, "mass": 1, "top2": 2}  # speculate.UNIT_SCORES, as the kernel numbers them
# The partial keys' formats the selection kernel reads (widened to float32 as it scores); int8:
# quantized codes, uint8: two 4-bit codes per byte (both with per-position scales,
# `infinigen.select.quantized`).
KEY_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CODE_FORMATS = {torch.int8: 3, torch.uint8: 4}
MAX_GROUP = 16  # query heads per KV head the kernels take (select.c's MAX_GROUP)
# -fno-trapping-math lets the compiler turn the kernels' float selects into vector blends (the
# results are IEEE-identical; only floating-point exception flags could differ, and none are read);
# -ffp-contract=off keeps every path's float finish the same sequence of roundings (no fused
# multiply-adds where the reference has none). -fopenmp: the kernels' threads are those of the
# OpenMP runtime torch has loaded (the same libgomp.so.1, found by its name), so the kernels and
# torch's operations share one pool of threads and never compete for a core; without OpenMP the
# kernels run on the calling thread.
_BASE_FLAGS = ["-O3", "-fno-trapping-math", "-fno-strict-aliasing", "-ffp-contract=off"]
_FLAG_SETS = (
    [*_BASE_FLAGS, "-march=native", "-mprefer-vector-width=512", "-fopenmp"],  # x86: 512-bit loops where it has them
    [*_BASE_FLAGS, "-march=native", "-fopenmp"],
    [*_BASE_FLAGS, "-fopenmp"],
    [*_BASE_FLAGS, "-march=native"],
    _BASE_FLAGS,
)
# The instruction paths of the integer kernels (isa.h), best last; `isa()` says which one runs.
ISA_PATHS = ("portable", "avx2", "avx-vnni", "avx512", "avx512-vnni")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def _cpu_key() -> str:
    """What the compiled code depends on besides its source: machine and CPU features."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{flags}"


def _compile() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    source = b"".join(src.read_bytes() for src in [*_SOURCES, *_HEADERS])
    folder = default_cache_dir() / "kernels"
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(source + " ".join([cc, *flags]).encode() + _cpu_key().encode()).hexdigest()[:16]
        target = folder / f"infinigen-{key}.so"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            cmd = [cc, *flags, "-std=c99", "-fPIC", "-shared", "-o", tmp, *map(str, _SOURCES), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
                continue
            os.replace(tmp, target)  # atomic: concurrent first uses never load a half-written file
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:  # e.g. an OpenMP runtime it cannot use: the next flag set
            errors.append(f"{target}: {exc}")
            continue
        _bind(lib)
        return lib
    raise RuntimeError("; ".join(errors))


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, f32, f64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int
    lib.ig_select.restype = i64
    lib.ig_select.argtypes = [p, cint, i64, i64, p, p, p, i64, i64, i64, i64, p, cint, f32, f64, i64, i64, i64, cint]
    lib.ig_select.argtypes += [p, p, p, p, p]
    lib.ig_top_up.restype = i64
    lib.ig_top_up.argtypes = [p, cint, i64, i64, p, p, p, i64, i64, i64, i64, p, cint, p, p, p, p, p, p, p]
    lib.ig_attend_scratch.restype = i64
    lib.ig_attend_scratch.argtypes = [i64]
    lib.ig_attend.restype = None
    lib.ig_attend.argtypes = [p, p, cint, i64, i64, i64, i64, i64, i64, i64, i64, p, p, p, p, p, i64, p, p, p]
    lib.ig_quantize_keys.restype = i64
    lib.ig_quantize_keys.argtypes = [p, p, p, i64, i64, i64, cint, p, p, i64, i64]
    lib.ig_widen.restype = None
    lib.ig_widen.argtypes = [p, cint, i64, p]
    lib.ig_isa.restype = lib.ig_isa_best.restype = cint
    lib.ig_isa.argtypes = lib.ig_isa_best.argtypes = []
    lib.ig_set_isa_cap.restype = None
    lib.ig_set_isa_cap.argtypes = [cint]
    lib.ig_select_codes.restype = i64
    lib.ig_select_codes.argtypes = [p, i64, i64, i64, i64, p, p, i64, p, p, p, p, p, p, i64, p, p, cint]
    lib.ig_attend_rows.restype = i64
    lib.ig_attend_rows.argtypes = [p, i64, i64, i64, i64, p, p, p, i64, p, p, p, p, cint]
    lib.ig_paged_decode.restype = i64
    lib.ig_paged_decode.argtypes = [p]
    u64 = ctypes.c_uint64
    lib.ig_aio_setup.restype = u64
    lib.ig_aio_setup.argtypes = [i64]
    lib.ig_aio_destroy.restype = None
    lib.ig_aio_destroy.argtypes = [u64]
    lib.ig_gather_rows.restype = i64
    # fd, block, record, rows, file offsets, tail offsets, tails; the block cache; gap, request, AIO context;
    # the read buffer and its size, two work arrays, the rows out, the counters out
    lib.ig_gather_rows.argtypes = [cint, i64, i64, i64, p, p, p, p, i64, p, p, p, p, i64, i64, u64]
    lib.ig_gather_rows.argtypes += [p, i64, p, p, p, p]


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one warning saying why) when they cannot be built."""
    global _lib, _tried, _why_not
    if os.environ.get("INFINIGEN_KERNELS", "1") == "0":
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _compile()
            except Exception as exc:  # no compiler, a failed build, a library that will not load
                _why_not = str(exc)
                warnings.warn(
                    f"infinigen: the C selection kernel is unavailable ({exc}); using tensor operations (slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if _lib is not None and os.environ.get("INFINIGEN_ISA"):  # cap the integer paths (tests, CI)
                _lib.ig_set_isa_cap(ISA_PATHS.index(os.environ["INFINIGEN_ISA"]))
            _tried = True
    return _lib


def available() -> bool:
    return library() is not None


def _library_for(keys: torch.Tensor) -> ctypes.CDLL:
    """The compiled kernels, after checking that they can read `keys`."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C selection kernel is unavailable: {_why_not}")
    if keys.dtype not in KEY_FORMATS or not keys.is_contiguous() or keys.device.type != "cpu":
        raise ValueError("keys must be a contiguous float32, float16 or bfloat16 CPU tensor")
    return lib


def _library_for_codes(codes: torch.Tensor, scales: torch.Tensor) -> ctypes.CDLL:
    """The compiled kernels, after checking that they can read quantized keys and their scales."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C selection kernel is unavailable: {_why_not}")
    b, hkv, _, capacity = codes.shape
    if codes.dtype not in CODE_FORMATS or not codes.is_contiguous() or codes.device.type != "cpu":
        raise ValueError("codes must be a contiguous int8 or uint8 CPU tensor")
    if scales.dtype != torch.float16 or not scales.is_contiguous() or tuple(scales.shape) != (b, hkv, 1, capacity):
        raise ValueError(f"scales must be a contiguous float16 [{b}, {hkv}, 1, {capacity}] tensor")
    return lib


def widen(keys: torch.Tensor) -> torch.Tensor:
    """`keys` (contiguous, CPU, a `KEY_FORMATS` dtype) widened to float32 as the selection
    kernel widens them when it scores."""
    lib = _library_for(keys)
    out = torch.empty(keys.shape, dtype=torch.float32)
    lib.ig_widen(keys.data_ptr(), KEY_FORMATS[keys.dtype], keys.numel(), out.data_ptr())
    return out


def quantize_keys(
    keys: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, at: int
) -> bool:
    """Quantize keys [B, Hkv, n, c] (float32) about `mu`, `sigma` [B, Hkv, c] (float32) into the
    columns [at, at + n) of `codes` [B, Hkv, c or ceil(c/2), capacity] (int8, or uint8 holding two
    4-bit codes) and `scales` [B, Hkv, 1, capacity] (float16), bit for bit as
    `infinigen.select.quantized.quantize`. False (nothing written) where the kernel cannot: no
    compiled library, or tensors it does not read."""
    lib = library()
    b, hkv, n, c = keys.shape
    ok = (
        lib is not None
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (keys, mu, sigma, codes, scales))
        and keys.dtype == mu.dtype == sigma.dtype == torch.float32
        and codes.dtype in CODE_FORMATS
        and scales.dtype == torch.float16
        and 0 <= at
        and at + n <= codes.shape[-1] == scales.shape[-1]
    )
    if not ok:
        return False
    return (
        lib.ig_quantize_keys(
            keys.data_ptr(),
            mu.data_ptr(),
            sigma.data_ptr(),
            b * hkv,
            n,
            c,
            CODE_FORMATS[codes.dtype],
            codes.data_ptr(),
            scales.data_ptr(),
            codes.shape[-1],
            at,
        )  # fmt: skip
        == 0
    )


def attend_reads(head_dim: int) -> bool:
    """Whether the attention kernels are built and read rows of this head dim."""
    lib = library()
    return lib is not None and lib.ig_attend_scratch(head_dim) > 0


def can_attend(rows: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether `attend` reads these stored rows (k, v) [B, Hkv, n, d]: CPU tensors in a
    `KEY_FORMATS` dtype, channels contiguous, keys and values laid out alike, a head dim the
    kernel reads (`ig_attend_scratch`: a multiple of 8)."""
    k, v = rows
    return (
        k.device.type == "cpu"
        and k.dtype in KEY_FORMATS
        and v.dtype == k.dtype
        and k.dim() == 4
        and k.shape == v.shape
        and k.stride() == v.stride()
        and k.stride(-1) == 1
        and library() is not None
        and library().ig_attend_scratch(k.shape[-1]) > 0
    )


def attend(
    query: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    valid: torch.Tensor | None,
    new: tuple[torch.Tensor, torch.Tensor],
    weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The math of `attention.attend_stored` in one call, reading the rows where they are stored.

    query [B, Hkv, G, d] float32, already multiplied by the attention scaling; rows (k, v)
    [B, Hkv, n, d] that `can_attend` accepts; valid [B, Hkv, n] bool or None (every row);
    new (k, v) [B, Hkv, 1, d]. Returns the output [B, Hkv, G, d] float32 and, when `weights`,
    the weights [B, Hkv, G, n + 1] (the new position last)."""
    out, probs, _ = _attend(query, rows, valid, new, weights, False)
    return out, probs


def attend_part(
    query: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of `attention.attend_part` in one call: attention over the rows alone (no new
    position), normalized among them, and the log of its normalizer [B, Hkv, G, 1] (-inf, with
    a zero output, where no row is valid). Arguments as `attend`'s."""
    out, _, norm = _attend(query, rows, valid, None, False, True)
    top, total = norm.unbind(-1)
    return out, (top + torch.log(total)).unsqueeze(-1)


def _attend(query, rows, valid, new, weights: bool, normalizer: bool):
    """One call of `ig_attend` (see attend.c): (output, weights or None, [B, Hkv, G, 2] maximum
    score and sum of exponentials about it, or None)."""
    lib = library()
    if lib is None or not can_attend(rows):
        raise ValueError("attend needs the compiled kernels and rows that can_attend accepts")
    k, v = rows
    b, hkv, n, d = k.shape
    g = query.shape[2]
    if tuple(query.shape) != (b, hkv, g, d) or query.dtype != torch.float32:
        raise ValueError(f"query must be float32 [{b}, {hkv}, G, {d}], got {query.dtype} {list(query.shape)}")
    q = query.contiguous()
    knew, vnew = (None, None) if new is None else (x.reshape(b, hkv, d).to(torch.float32).contiguous() for x in new)
    vmask = None if valid is None else valid.reshape(b, hkv, n).to(torch.uint8).contiguous()
    probs = torch.empty((b * hkv if weights else 1) * g * (n + 1), dtype=torch.float32)
    tile = torch.empty(lib.ig_attend_scratch(d), dtype=torch.float32)
    out = torch.empty(b, hkv, g, d, dtype=torch.float32)
    norm = torch.empty(b, hkv, g, 2, dtype=torch.float32) if normalizer else None
    lib.ig_attend(
        k.data_ptr(), v.data_ptr(), KEY_FORMATS[k.dtype], b, hkv, k.stride(0), k.stride(1), k.stride(2), g, n, d,
        q.data_ptr(), None if vmask is None else vmask.data_ptr(), None if knew is None else knew.data_ptr(),
        None if vnew is None else vnew.data_ptr(), probs.data_ptr(), g * (n + 1) if weights else 0, tile.data_ptr(),
        out.data_ptr(), None if norm is None else norm.data_ptr(),
    )  # fmt: skip
    return out, probs.reshape(b, hkv, g, n + 1) if weights else None, norm


def select(
    keys: torch.Tensor,
    length: int,
    query: torch.Tensor,
    valid: torch.Tensor | None,
    aggregation: str,
    alpha: float,
    budget: float,
    budget_tokens: int | None,
    min_tokens: int,
    scales: torch.Tensor | None = None,
    block: int = 1,
    bias: torch.Tensor | None = None,
    unit_score: str = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniGen's selection in one call (the rule of `speculate.aggregate_group` followed by
    `speculate.select_positions`, or by `speculate.select_blocks` for `block` > 1; scores from
    `speculate.partial_scores`).

    keys: [B, Hkv, c, >= length] channel-major partial keys, contiguous, in a `KEY_FORMATS`
          dtype (16-bit keys are widened exactly to float32; the scores are float32 either way);
    query: [B, H, c] partial queries already multiplied by the attention scaling;
    valid: [B, Hkv, length] bool, or None when every position exists;
    scales: for quantized keys (int8 codes [B, Hkv, c, >= length], or uint8 [B, Hkv, c/2, >= length]
          holding two 4-bit codes per byte), the per-position scales [B, Hkv, 1, same capacity] float16;
          the per-channel scales are already folded into `query`;
    bias: [B, H] added to every score of a query head (for centered codes: the query against the
          channel means), or None;
    block: choose aligned units of this many positions (each scored by `unit_score`, as in
          `speculate.unit_scores`: max, mass or top2) and return every valid position of the
          chosen units.
    Returns (indices [B, Hkv, n] ascending, padding slots 0; counts [B, Hkv])."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    call = _Call(keys, length, query, valid, scales, bias)
    n = call.lib.ig_select(
        *call.head, AGGREGATIONS[aggregation], float(alpha),
        float(budget), -1 if budget_tokens is None else int(budget_tokens), int(min_tokens), int(block),
        UNIT_RULES[unit_score], *call.tail,
    )  # fmt: skip
    return call.result(n)


def top_up(
    keys: torch.Tensor,
    length: int,
    query: torch.Tensor,
    valid: torch.Tensor | None,
    aggregation: str,
    chosen: torch.Tensor,
    count: torch.Tensor,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A correction's top-up in one call (the rule of `speculate.top_up` on the group scores of
    `speculate.aggregate_group`): per (batch, KV head), the `count` [B, Hkv] best positions by
    `query` (layer i's own, scaled) among the valid ones that `chosen` [B, Hkv, length] (bool)
    does not hold, fewer where fewer are open. Arguments and result as `select`."""
    call = _Call(keys, length, query, valid, scales, bias)
    r = call.rows
    chosen_bytes = chosen.reshape(r, length).to(torch.uint8).contiguous()
    want = count.reshape(r).to(torch.int64).contiguous()
    n = call.lib.ig_top_up(
        *call.head, AGGREGATIONS[aggregation], chosen_bytes.data_ptr(), want.data_ptr(), *call.tail
    )  # fmt: skip
    return call.result(n)


class _Call:
    """The arguments `select` and `top_up` share (keys, query, valid, scratch and output
    buffers), checked and laid out as the kernels read them."""

    def __init__(
        self,
        keys: torch.Tensor,
        length: int,
        query: torch.Tensor,
        valid: torch.Tensor | None,
        scales: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        b, hkv, stored, capacity = keys.shape
        if scales is None:
            self.lib, fmt, c = _library_for(keys), KEY_FORMATS[keys.dtype], stored
        else:
            self.lib, fmt, c = _library_for_codes(keys, scales), CODE_FORMATS[keys.dtype], query.shape[-1]
            if c != (stored if keys.dtype == torch.int8 else 2 * stored):
                raise ValueError(f"a query of {c} channels for codes of {stored} rows ({keys.dtype})")
        g = query.shape[1] // hkv
        if not 0 <= length <= capacity:
            raise ValueError(f"length {length} exceeds the keys' capacity {capacity}")
        self.shape, self.rows = (b, hkv), b * hkv
        self._keep = [query.to(torch.float32).reshape(self.rows, g, c).contiguous()]
        bias_ptr = None
        if bias is not None:
            if tuple(bias.shape) != tuple(query.shape[:2]):
                raise ValueError(f"bias must be [{b}, {query.shape[1]}] (one per query head), got {list(bias.shape)}")
            self._keep.append(bias.to(torch.float32).reshape(self.rows, g).contiguous())
            bias_ptr = self._keep[-1].data_ptr()
        vmask = None
        if valid is not None:
            vmask = valid.reshape(self.rows, length).to(torch.uint8).contiguous()
            self._keep.append(vmask)
        self.out = torch.empty(self.rows, max(length, 1), dtype=torch.int64)
        self.counts = torch.empty(self.rows, dtype=torch.int64)
        f32 = torch.float32
        scratch = [torch.empty(2 * g, max(length, 1), dtype=f32), torch.empty(max(length, 1), dtype=f32)]
        scratch.append(torch.empty_like(scratch[1]))
        self._keep += scratch
        self.head = (
            keys.data_ptr(), fmt, stored * capacity, capacity, None if scales is None else scales.data_ptr(),
            self._keep[0].data_ptr(), bias_ptr, self.rows, g, c, length, None if vmask is None else vmask.data_ptr(),
        )  # fmt: skip
        self.tail = (*(t.data_ptr() for t in scratch), self.out.data_ptr(), self.counts.data_ptr())

    def result(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n == -2:
            raise MemoryError("the selection kernel could not allocate its block scratch")
        if n < 0:
            raise ValueError(f"a GQA group of more than {MAX_GROUP} query heads per KV head is not supported")
        return self.out[:, :n].reshape(*self.shape, n), self.counts.reshape(self.shape)


# ---------------------------------------------------------------------- the integer paths
def isa() -> str:
    """The instruction path the integer kernels take on this CPU (`ISA_PATHS`), or "none"."""
    lib = library()
    return ISA_PATHS[lib.ig_isa()] if lib is not None else "none"


def best_isa() -> str:
    """The best instruction path this CPU has, whatever the cap."""
    lib = library()
    return ISA_PATHS[lib.ig_isa_best()] if lib is not None else "none"


@contextlib.contextmanager
def isa_cap(name: str):
    """Run the integer kernels on at most path `name` (`ISA_PATHS`) inside the block: how the tests
    hold every path the machine has to the portable one, and how a benchmark prints both."""
    lib = _need()
    lib.ig_set_isa_cap(ISA_PATHS.index(name))
    try:
        yield
    finally:
        lib.ig_set_isa_cap(-1)


def threads() -> int:
    """Threads the kernels run on: torch's own count (they share its OpenMP pool)."""
    return max(1, torch.get_num_threads())


def _need() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C kernels are unavailable: {_why_not}")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Codes(ctypes.Structure):
    """Where packed 4-bit codes lie (select.h's ig_codes): byte strides from request 0, KV head 0,
    block id 0; `tables` [R, table_ld] int32 block ids or None (each request's codes one block)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("tables", ctypes.c_void_p),
        ("table_ld", ctypes.c_int64), ("code_request", ctypes.c_int64), ("code_head", ctypes.c_int64),
        ("code_block", ctypes.c_int64), ("scale_request", ctypes.c_int64), ("scale_head", ctypes.c_int64),
        ("scale_block", ctypes.c_int64), ("block", ctypes.c_int64), ("ld", ctypes.c_int64), ("pairs", ctypes.c_int64),
    ]  # fmt: skip

    @classmethod
    def contiguous(cls, codes: torch.Tensor, scales: torch.Tensor) -> Codes:
        """The library's buffers: codes [B, Hkv, pairs, capacity] uint8, scales [B, Hkv, 1, capacity] float16."""
        b, hkv, pairs, cap = codes.shape
        return cls(codes.data_ptr(), scales.data_ptr(), None, 0, hkv * pairs * cap, pairs * cap, 0, hkv * cap * 2,
                   cap * 2, 0, max(cap, 1), cap, pairs)  # fmt: skip


class Rule(ctypes.Structure):
    """The selection rule (select.h's ig_rule)."""

    _fields_ = [
        ("mode", ctypes.c_int64), ("unit_rule", ctypes.c_int64), ("alpha", ctypes.c_double),
        ("budget", ctypes.c_double), ("budget_tokens", ctypes.c_int64), ("min_tokens", ctypes.c_int64),
        ("unit", ctypes.c_int64), ("correction", ctypes.c_double),
    ]  # fmt: skip

    @classmethod
    def of(cls, aggregation: str, alpha: float, budget: float, budget_tokens: int | None, min_tokens: int,
           unit: int = 1, unit_score: str = "max", correction: float = 0.0) -> Rule:  # fmt: skip
        return cls(AGGREGATIONS[aggregation], UNIT_RULES[unit_score], float(alpha), float(budget),
                   -1 if budget_tokens is None else int(budget_tokens), int(min_tokens), int(unit), float(correction))  # fmt: skip


def select_codes(
    codes: Codes,
    lengths: torch.Tensor,
    spec: torch.Tensor,
    spec_bias: torch.Tensor | None,
    rule: Rule,
    own: torch.Tensor | None = None,
    own_bias: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    keep: tuple | None = None,
    threads_: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (request, KV head) row's positions over codes where they lie, in one call (select.c's
    `ig_select_codes`). lengths [R] int64; spec, own [R, Hkv, G, C] scaled partial queries with
    the channel scales folded in; biases [R, Hkv, G]; valid [R, Hkv, T] bool or None. Returns
    positions [R, Hkv, T] int64 (the chosen ascending, then the top-up's), counts and top-up counts
    [R, Hkv]. `keep`: tensors whose memory `codes` points into (held for the call)."""
    lib = _need()
    r, hkv, g, c = spec.shape
    t = int(lengths.max()) if r else 0
    out = torch.zeros(r, hkv, max(t, 1), dtype=torch.int64)  # past each row's count: 0
    counts = torch.zeros(r, hkv, dtype=torch.int64)
    extra = torch.zeros(r, hkv, dtype=torch.int64)
    args = [x.to(torch.float32).contiguous() if x is not None else None for x in (spec, spec_bias, own, own_bias)]
    vmask = None if valid is None else valid.to(torch.uint8).contiguous()
    lengths = lengths.to(torch.int64).contiguous()
    n = lib.ig_select_codes(
        ctypes.byref(codes), r, hkv, g, c, lengths.data_ptr(), _ptr(vmask), 0 if vmask is None else vmask.shape[-1],
        *(_ptr(a) for a in args), ctypes.byref(rule), out.data_ptr(), out.shape[-1], counts.data_ptr(),
        extra.data_ptr(), threads_ or threads(),
    )  # fmt: skip
    if n < 0:
        raise ValueError(f"the selection kernel refused its arguments (code {n})")
    return out, counts, extra


class KVRows(ctypes.Structure):
    """Where K and V rows lie (attend.h's ig_kv_rows), element strides."""

    _fields_ = [
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("table_ld", ctypes.c_int64),
        ("request", ctypes.c_int64), ("head", ctypes.c_int64), ("block_stride", ctypes.c_int64),
        ("row", ctypes.c_int64), ("block", ctypes.c_int64), ("format", ctypes.c_int64),
    ]  # fmt: skip

    @classmethod
    def contiguous(cls, k: torch.Tensor, v: torch.Tensor) -> KVRows:
        """Rows [B, Hkv, capacity, d] (k and v laid out alike, channels contiguous)."""
        b, hkv, cap, d = k.shape
        return cls(k.data_ptr(), v.data_ptr(), None, 0, k.stride(0), k.stride(1), 0, k.stride(2), max(cap, 1),
                   KEY_FORMATS[k.dtype])  # fmt: skip


def attend_rows(
    rows: KVRows,
    query: torch.Tensor,
    lengths: torch.Tensor,
    positions: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
    threads_: int | None = None,
) -> torch.Tensor:
    """Attention of each (request, KV head) row's query heads over its chosen positions (or every
    position below lengths[r]) and its new position, reading the rows where `rows` says they lie.
    query [R, Hkv, G, d] float32 already scaled; positions [R, Hkv, n] int64 with counts [R, Hkv];
    new (k, v) [R, Hkv, d]. Returns [R, Hkv, G, d] float32."""
    lib = _need()
    r, hkv, g, d = query.shape
    q = query.to(torch.float32).contiguous()
    pos = None if positions is None else positions.to(torch.int64).contiguous()
    cnt = None if counts is None else counts.to(torch.int64).contiguous()
    knew, vnew = (None, None) if new is None else (x.to(torch.float32).contiguous() for x in new)
    out = torch.empty(r, hkv, g, d, dtype=torch.float32)
    lengths = lengths.to(torch.int64).contiguous()
    rc = lib.ig_attend_rows(
        ctypes.byref(rows), r, hkv, g, d, q.data_ptr(), _ptr(pos), _ptr(cnt), 0 if pos is None else pos.shape[-1],
        lengths.data_ptr(), _ptr(knew), _ptr(vnew), out.data_ptr(), threads_ or threads(),
    )  # fmt: skip
    if rc < 0:
        raise ValueError(f"the attention kernel refused its arguments (code {rc})")
    return out


class PagedStep(ctypes.Structure):
    """One decode layer over an engine's pages (paged.c's ig_paged_step): filled by the vLLM
    runtime, run by `paged_decode`."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("R", "H", "Hkv", "d", "C", "pairs", "bs")),
        ("rows", ctypes.c_void_p), ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("q_row", ctypes.c_int64), ("k_row", ctypes.c_int64), ("v_row", ctypes.c_int64),
        ("out_row", ctypes.c_int64), ("io_format", ctypes.c_int64), ("slots", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("table_ld", ctypes.c_int64),
        ("store", ctypes.c_void_p), ("store_format", ctypes.c_int64), ("page", ctypes.c_void_p),
        ("page_row", ctypes.c_int64), ("proj", ctypes.c_void_p), ("mu", ctypes.c_void_p), ("sigma", ctypes.c_void_p),
        ("stats_stride", ctypes.c_int64), ("stats_head", ctypes.c_int64), ("spec", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p), ("rot", ctypes.c_int64), ("neox", ctypes.c_int64), ("scaling", ctypes.c_double),
        ("rule", Rule),
        ("positions", ctypes.c_void_p), ("counts", ctypes.c_void_p), ("extra", ctypes.c_void_p),
        ("ldp", ctypes.c_int64), ("work", ctypes.c_void_p), ("threads", ctypes.c_int64), ("write_kv", ctypes.c_int64),
        ("attended", ctypes.c_int64),
    ]  # fmt: skip


def paged_work(r: int, h: int, hkv: int, d: int, c: int) -> int:
    """Floats of scratch `paged_decode` needs for r requests (PagedStep.work)."""
    return 4 * r * h * d + 2 * r * hkv * d + 2 * r * h * c + 2 * r * h


def paged_decode(step: PagedStep) -> None:
    rc = _need().ig_paged_decode(ctypes.byref(step))
    if rc < 0:
        raise ValueError(f"the paged decode kernel refused its arguments (code {rc})")
