"""A cost model of one decode step: dense, full fetch and InfiniGen on hardware we do not have.

Everything it prints is *modelled*. Per layer, a decode step is a roofline of three resources:

- the compute device reads the layer's weights and does 2·B·params FLOPs (linear layers);
- attention reads the KV it attends (all of it for dense; the fetched rows for InfiniGen) from
  the compute device's memory;
- the slow tier moves what the step fetches over its link (PCIe from pinned host RAM; an SSD),
  issued one layer ahead, so a layer costs max(compute, transfer) — FlexGen's overlap for full
  fetch, InfiniGen's prefetch for the selected rows;

plus a fixed per-layer overhead (kernel launches, the framework; measured on this machine,
assumed for the named GPUs). InfiniGen adds its speculation: the partial query times the
partial keys (r·d channels of every cached position) and the top-k over the scores, on the
compute device, and a host-side gather of the scattered rows before the copy. What InfiniGen
fetches is not modelled but *measured*: the selection fraction (and, for a disk, the bytes read
per row asked for, amplification and RAM block cache included) come from `bench decode` runs.

Hardware numbers are spec-sheet peaks times stated efficiencies; the output says which.

A policy is modelled from what it means (`infinigen.config.POLICIES`), not from its name: KV
with the compute costs as dense; an offloading policy without a selector reads every row over
the link (int4 storage: its packed bytes); InfiniGen speculates and gathers its measured
fraction; any other selector reads its budget (`Workload.budgets`). A selector that chooses
without a query (by position or history: H2O, StreamingLLM) keeps the same rows from step to
step but for the newest, so they are read as one range at the link's speed; a query-aware one
gathers scattered rows, and one that needs the layer's own query cannot start its fetch before
the layer (no overlap). What a baseline spends choosing (scores, page bounds) is left to the
fixed per-layer overhead. An upper bound that reads every key to choose (the oracle) is refused:
its speed means nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from infinigen.config import POLICIES as SPECS
from infinigen.config import PolicySpec
from infinigen.select import SELECTORS
from infinigen.speculate import channel_count

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One machine: a compute device and a slow tier behind a link.

    flops: achievable FLOP/s of the linear layers (fp16/bf16 tensor cores on a GPU; fp32 on a
    CPU); mem_bw: achievable bytes/s of the compute device's memory; mem_gb: its capacity (what
    a dense cache must fit in; None: host RAM, ample); link_bw: achievable bytes/s from the slow
    tier to the compute (sequential, large transfers); gather_bw: bytes/s of a scattered-row
    fetch (host-side gather into staging then the link, or random disk reads); kv_compute_bytes:
    bytes per KV element where attention reads it (fp16 on a GPU; fp32 in this project's CPU path);
    overhead_s: fixed seconds per layer and step (launches, framework), per policy;
    spec_on_compute: whether InfiniGen's speculation runs on the compute device (a GPU) or on a
    prefetch thread next to the transfer (this project's CPU path); offload_flops /
    offload_mem_bw: what the compute gets under an offloading policy when it gives up a core to
    the prefetch and I/O threads (CPU; None: unchanged); block_bytes: the read unit of a block
    device (a scattered fetch then moves whole blocks: the measured amplification applies)."""

    name: str
    description: str
    flops: float
    mem_bw: float
    mem_gb: float | None
    link_bw: float
    gather_bw: float
    kv_compute_bytes: int = 2
    overhead_s: dict | None = None
    source: str = "spec sheet"
    spec_on_compute: bool = True
    offload_flops: float | None = None
    offload_mem_bw: float | None = None
    block_bytes: int | None = None

    def overhead(self, policy: str, batch: int = 1) -> float:
        """Fixed seconds per layer and step, plus (where calibrated) per extra batch row."""
        table = self.overhead_s or {}
        per_row = table.get(f"{policy}/row", 0.0)
        return table.get(policy, table.get("default", 0.0)) + per_row * (batch - 1)


@dataclass(frozen=True)
class ModelShape:
    """The shapes a decode step's cost depends on (weights in `weight_bytes` per parameter)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    weight_bytes: int = 2

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attn + mlp

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    def kv_row_bytes(self, store_bytes: int = 2) -> int:
        """Bytes of one position's K and V for all KV heads of one layer."""
        return 2 * self.kv_heads * self.head_dim * store_bytes


# Spec-sheet peaks (dense fp16 tensor FLOPs, memory and PCIe bandwidth per direction) times
# efficiencies typical of decode kernels: 50 % of peak FLOPs, 80 % of memory bandwidth, 80 % of
# PCIe. Host-side gather of 256-512-byte rows into pinned staging: 20 GB/s (torch's index_select
# on a server's cores); it runs before the copy (this project's pinned tier), so a scattered
# fetch runs at 1 / (1/20 + 1/link) GB/s. GPU overhead per layer (assumed): 0.25 ms
# for eager PyTorch (about 25 kernel launches), 0.05 ms more for a policy's own bookkeeping, and
# 0.1 ms of fixed cost per speculation (a few more launches and the host-side sizing).
_GPU_OVERHEAD = {"default": 0.3e-3, "dense": 0.25e-3, "speculation": 0.1e-3}


def _gpu(name, description, tflops, mem_gbs, mem_gb, pcie_gbs, source) -> Hardware:
    link = 0.8 * pcie_gbs * GB
    gather = 1 / (1 / (20 * GB) + 1 / link)
    return Hardware(
        name, description, 0.5 * tflops * TFLOPS, 0.8 * mem_gbs * GB, mem_gb, link, gather,
        kv_compute_bytes=2, overhead_s=_GPU_OVERHEAD, source=source,
    )  # fmt: skip


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu(
            "h100-pcie5",
            "H100 PCIe 80GB, pinned host RAM over PCIe 5.0 x16",
            756,
            2000,
            80,
            64,
            "NVIDIA H100 datasheet: 756 TFLOPS fp16 dense, 2.0 TB/s; PCIe 5.0 x16 64 GB/s",
        ),
        _gpu(
            "a100-pcie4",
            "A100 PCIe 80GB, pinned host RAM over PCIe 4.0 x16",
            312,
            1935,
            80,
            32,
            "NVIDIA A100 datasheet: 312 TFLOPS fp16 dense, 1.935 TB/s; PCIe 4.0 x16 32 GB/s",
        ),
        _gpu(
            "rtx4090",
            "RTX 4090 24GB, pinned host RAM over PCIe 4.0 x16",
            165,
            1008,
            24,
            32,
            "Ada whitepaper: 165 TFLOPS fp16 (fp32 accumulate), 1008 GB/s; PCIe 4.0 x16",
        ),
        _gpu(
            "a6000-pcie3",
            "RTX A6000 48GB, pinned host RAM over PCIe 3.0 x16 (the InfiniGen paper's machine)",
            155,
            768,
            48,
            15.75,
            "A6000 datasheet: 154.8 TFLOPS fp16 dense, 768 GB/s; PCIe 3.0 x16 15.75 GB/s",
        ),
        replace(
            _gpu(
                "a100-nvme4",
                "A100 PCIe 80GB, KV on an NVMe PCIe 4.0 SSD",
                312,
                1935,
                80,
                32,
                "A100 datasheet; NVMe Gen4 SSD: 7 GB/s sequential, ~1M random 4 KiB IOPS",
            ),
            link_bw=0.9 * 7 * GB,  # sequential read (full fetch)
            gather_bw=0.9 * 4.0 * GB,  # 4 KiB random reads at high queue depth, x amplification
            block_bytes=4096,
        ),
    )  # fmt: skip
}

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
        ModelShape("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, gated_mlp=False),
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, weight_bytes=4),
    )
}

SPECULATED = "infinigen"  # the selector whose speculation and measured fraction the model costs


def unmodelled(spec: PolicySpec) -> str | None:
    """Why the model cannot cost a policy of this meaning (None: it can)."""
    if spec.bound:
        return "it is an upper bound that reads every key to choose, not a system whose speed means anything"
    return None


# Every policy the model costs, in `infinigen.config.POLICIES`' order.
POLICIES = tuple(name for name, spec in SPECS.items() if unmodelled(spec) is None)
INT4_BYTES_PER_ROW = 0.28  # group-wise 4-bit with fp16 scale and zero per 64: 36 of 128 bytes per 64 values
PAPER_H2O_BUDGET = 0.2  # the InfiniGen paper runs H2O at 20 % of the context


@dataclass
class Workload:
    """What InfiniGen fetches, measured: `fraction` of the context per speculated layer and the
    bytes moved per byte of rows asked for (`amplification`: whole disk blocks, minus what a RAM
    cache served; 1 for pinned host RAM). `dense_layers` are never speculated; `partial_ratio`
    sizes the partial keys; `budgets` is what another selector keeps, by its name (one not named
    keeps its policy's default budget)."""

    fraction: float
    amplification: float = 1.0
    dense_layers: int = 2
    partial_ratio: float = 0.3
    budgets: dict[str, float] = field(default_factory=lambda: {"h2o": PAPER_H2O_BUDGET})
    store_bytes: int = 2
    source: str = ""

    def share(self, policy: str) -> float:
        """The fraction of the context `policy` reads in a speculated layer (1: every row)."""
        spec = spec_of(policy)
        if spec.selector is None:
            return 1.0
        if spec.selector == SPECULATED:
            return self.fraction
        return self.budgets.get(spec.selector, spec.default_budget)


def spec_of(policy: str) -> PolicySpec:
    """What `policy` means, refused in one sentence when the model cannot cost it."""
    spec = SPECS.get(policy)
    if spec is None:
        raise ValueError(f"unknown policy {policy!r}; modelled: {', '.join(POLICIES)}")
    why = unmodelled(spec)
    if why is not None:
        raise ValueError(f"policy {policy!r} is not modelled: {why}")
    return spec


@dataclass
class Prediction:
    hardware: str
    model: str
    policy: str
    context: int
    batch: int
    tokens_per_s: float | None
    step_ms: float | None
    tier_bytes_per_token: float
    bound: str
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _linear_seconds(hw: Hardware, m: ModelShape, batch: int, params: int) -> float:
    return max(params * m.weight_bytes / hw.mem_bw, 2 * batch * params / hw.flops)


def offloading(hw: Hardware) -> Hardware:
    """The compute device as an offloading policy sees it (one core fewer on a CPU)."""
    return replace(hw, flops=hw.offload_flops or hw.flops, mem_bw=hw.offload_mem_bw or hw.mem_bw)


def _attention_seconds(hw: Hardware, m: ModelShape, batch: int, rows: float) -> float:
    """Attention over `rows` cached positions: read K and V in the compute dtype, 4·d FLOPs per
    (query head, position)."""
    nbytes = batch * rows * m.kv_row_bytes(hw.kv_compute_bytes)
    flops = 4 * batch * m.heads * rows * m.head_dim
    return max(nbytes / hw.mem_bw, flops / hw.flops)


def _speculation_seconds(hw: Hardware, m: ModelShape, batch: int, context: int, w: Workload) -> float:
    """Partial scores over every cached position (r·d channels of K̃, in the compute dtype) and a
    top-k pass over the [B, heads, T] scores (read twice, fp32)."""
    channels = channel_count(w.partial_ratio, m.head_dim)
    nbytes = batch * context * m.kv_heads * channels * hw.kv_compute_bytes + 2 * batch * m.heads * context * 4
    flops = 2 * batch * m.heads * context * channels
    return max(nbytes / hw.mem_bw, flops / hw.flops)


def kv_bytes(m: ModelShape, batch: int, context: int, store_bytes: int = 2) -> float:
    return m.layers * batch * context * m.kv_row_bytes(store_bytes)


def resident_bytes(hw: Hardware, m: ModelShape, policy: str, context: int, batch: int, w: Workload) -> float:
    """What must stay in the compute device's memory: the weights, plus for dense every layer's KV;
    for a selecting policy the first `dense_layers` layers' KV (kept with the compute), for
    InfiniGen also the partial keys of every speculated layer (r·d of each key, the compute
    dtype); for every offloading policy two layers' transfer buffers. (A baseline's own state,
    scores or page bounds, is small beside these and not counted.)"""
    spec = spec_of(policy)
    weights = (m.layer_params * m.layers + m.head_params) * m.weight_bytes
    per_layer = batch * context * m.kv_row_bytes(hw.kv_compute_bytes)
    if spec.placement == "compute":
        return weights + m.layers * per_layer
    kept = w.dense_layers if spec.selector is not None else 0
    share = w.share(policy)
    partial = 0.0
    if spec.selector == SPECULATED:
        channels = channel_count(w.partial_ratio, m.head_dim)
        partial = (m.layers - kept) * batch * context * m.kv_heads * channels * hw.kv_compute_bytes
    return weights + kept * per_layer + partial + 2 * share * per_layer


def predict(hw: Hardware, m: ModelShape, policy: str, context: int, batch: int, w: Workload) -> Prediction:
    """Tokens/s of one decode step at `context` cached positions (see the module docstring)."""
    spec = spec_of(policy)
    on_compute = spec.placement == "compute"
    need = resident_bytes(hw, m, policy, context, batch, w)
    if hw.mem_gb is not None and need > hw.mem_gb * GB:
        what = "weights + KV" if on_compute else "weights + resident KV, partial keys and buffers"
        return Prediction(hw.name, m.name, policy, context, batch, None, None, 0.0, "-",
                          f"does not fit: {what} = {need / GB:.0f} GB > {hw.mem_gb} GB")  # fmt: skip
    spec_hw = hw
    if not on_compute:
        hw = offloading(hw)
    lin = _linear_seconds(hw, m, batch, m.layer_params)
    head = _linear_seconds(hw, m, batch, m.head_params)
    over = hw.overhead(policy, batch)
    row = m.kv_row_bytes(w.store_bytes)
    step = head
    tier = 0.0
    if on_compute:
        step += m.layers * (lin + _attention_seconds(hw, m, batch, context) + over)
        bound = "memory"
    else:
        links = 0
        query_from = SELECTORS[spec.selector].query_from if spec.selector is not None else None
        for i in range(m.layers):
            compute = lin + over
            transfer = nbytes = 0.0
            overlapped = True
            if spec.selector is not None and i < w.dense_layers:
                compute += _attention_seconds(hw, m, batch, context)  # kept with the compute
            elif spec.selector == SPECULATED:
                rows = w.fraction * context
                nbytes = batch * rows * row * w.amplification
                transfer = nbytes / hw.gather_bw
                compute += _attention_seconds(hw, m, batch, rows)
                # The speculation for layer i runs during layer i - 1: on the compute device, or
                # (CPU path) on the prefetch thread before the fetch it sizes.
                speculation = _speculation_seconds(spec_hw, m, batch, context, w) + hw.overhead("speculation")
                if hw.spec_on_compute:
                    compute += speculation
                else:
                    transfer += speculation
            elif spec.selector is not None:
                rows = w.share(policy) * context
                nbytes = batch * rows * row
                # Chosen without a query (by position or history): the same rows step after step,
                # kept together and read as one range; chosen by a query: scattered rows, gathered.
                transfer = nbytes / (hw.link_bw if query_from is None else hw.gather_bw)
                overlapped = query_from != "own"  # the layer's own query comes with the layer
                compute += _attention_seconds(hw, m, batch, rows)
            else:
                nbytes = batch * context * (row * INT4_BYTES_PER_ROW if spec.fmt == "int4" else row)
                transfer = nbytes / hw.link_bw
                compute += _attention_seconds(hw, m, batch, context)
            tier += nbytes
            links += transfer > compute
            step += max(compute, transfer) if overlapped else compute + transfer
        bound = "link" if links > m.layers / 2 else "compute"
    return Prediction(hw.name, m.name, policy, context, batch, batch / step, 1000 * step, tier / batch, bound)


def prefill_seconds(hw: Hardware, m: ModelShape, batch: int, prompt: int, offload: bool) -> float:
    """A prompt's prefill: linear FLOPs and causal attention FLOPs at the device's rate; an
    offloading policy also writes the prompt's KV to the tier (overlapped with the compute)."""
    flops = 2 * batch * prompt * (m.layer_params * m.layers + m.head_params)
    flops += 2 * batch * m.layers * m.heads * prompt * prompt * m.head_dim  # QK and PV, causal half
    compute = flops / hw.flops + m.layers * hw.overhead("dense")
    write = kv_bytes(m, batch, prompt) / hw.link_bw if offload else 0.0
    return max(compute, write)


def generation_seconds(
    hw: Hardware, m: ModelShape, policy: str, batch: int, prompt: int, new: int, w: Workload, points: int = 8
) -> float | None:
    """Prefill plus `new` decode steps, the step cost integrated over the growing context."""
    total = prefill_seconds(hw, m, batch, prompt, offload=spec_of(policy).placement == "offload")
    for j in range(points):
        ctx = prompt + int((j + 0.5) * new / points)
        p = predict(hw, m, policy, ctx, batch, w)
        if p.step_ms is None:
            return None
        total += (new / points) * p.step_ms / 1000
    return total
