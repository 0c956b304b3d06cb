"""The vLLM plugin's runtime (no vLLM needed): vLLM's paged layout (a block table, slots, a page of
partial-key codes) in, attention out, against dense attention and against the library's own
in-memory selection on the same keys."""

from __future__ import annotations

import math

import pytest
import torch

import infinigen
from conftest import tiny_model
from infinigen.integrations.vllm.runtime import Adapter, PageCodes, Runtime, StepRequests, page_bytes
from infinigen.integrations.vllm.settings import PluginSettings, PluginSettingsError, parse
from infinigen.models import get_adapter
from infinigen.speculate import all_valid

BLOCK = 8
BLOCKS = 40


def _rotary(model):
    hf = get_adapter(model)

    def apply(layer, positions, q):
        t = q.shape[0]
        cos, sin = model.model.rotary_emb(q.view(1, t, -1), positions[None])
        heads = q.view(1, t, -1, hf.head_dim).transpose(1, 2)
        return hf._rope(heads, (cos, sin)).transpose(1, 2).reshape(t, -1)

    return apply


def _rope_table(model, positions: int = 128):
    """The model's rotary table as vLLM keeps one (cos then sin, half a head each), float32."""
    hf = get_adapter(model)
    x = torch.zeros(1, positions, hf.head_dim)
    cos, sin = model.model.rotary_emb(x, torch.arange(positions)[None])
    half = hf.head_dim // 2
    table = torch.cat([cos[0, :, :half], sin[0, :, :half]], -1).to(torch.float32).contiguous()
    return lambda layer: (table, hf.head_dim, True)


class Harness:
    """Two requests in vLLM's paged form, driven through the runtime layer by layer (rope: the
    kernel applies the rotary table to the speculated queries, as inside vLLM, else torch does)."""

    def __init__(self, policy: str, rope: bool = False, **settings):
        self.model = tiny_model("llama")
        cfg = infinigen.InfiniGenConfig(policy=policy, **settings)
        hf = get_adapter(self.model)
        self.hkv, self.h, self.d, self.layers = hf.num_kv_heads, hf.num_heads, hf.head_dim, hf.num_layers
        self.scale = hf.head_dim**-0.5
        artifact = None
        if policy == "infinigen":
            with infinigen.attach(self.model, cfg) as session:
                artifact = session.artifact
        adapter = Adapter(
            self.layers, self.h, self.hkv, self.d, self.scale, _rotary(self.model),
            _rope_table(self.model) if rope else None,
        )  # fmt: skip
        self.rt = Runtime(PluginSettings(cfg), adapter, artifact, BLOCK, BLOCKS * BLOCK, torch.float32)
        self.pages = torch.zeros(self.layers, BLOCKS, self.hkv, BLOCK, page_bytes(10), dtype=torch.uint8)
        gen = torch.Generator().manual_seed(3)
        self.tables = torch.randperm(BLOCKS, generator=gen)[:16].view(2, 8)  # scattered blocks
        self.gen = gen
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each layer's last input
        self.k = [[[] for _ in range(2)] for _ in range(self.layers)]
        self.v = [[[] for _ in range(2)] for _ in range(self.layers)]

    def slots(self, r: int, positions: range) -> list[int]:
        return [int(self.tables[r, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]

    def step(self, lengths: list[int], new: list[int]):
        """One step: request r adds new[r] tokens, reaching lengths[r]. Returns per layer the
        queries, outputs and the step's requests."""
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        slots = sum((self.slots(r, range(lengths[r] - new[r], lengths[r])) for r in range(2)), [])
        step = StepRequests(starts, lengths, self.tables, torch.tensor(slots))
        n = starts[-1]
        positions = torch.cat([torch.arange(lengths[r] - new[r], lengths[r]) for r in range(2)])
        out = []
        for layer in range(self.layers):
            x = torch.randn(n, 64, generator=self.gen)
            self.rt.saw_input(layer, positions, x)
            self.seen[layer] = (x, positions)
            q = torch.randn(n, self.h, self.d, generator=self.gen) * 3
            k = torch.randn(n, self.hkv, self.d, generator=self.gen) * 3
            v = torch.randn(n, self.hkv, self.d, generator=self.gen)
            for r in range(2):
                self.k[layer][r].append(k[starts[r] : starts[r + 1]])
                self.v[layer][r].append(v[starts[r] : starts[r + 1]])
            o = torch.empty(n, self.h, self.d)
            self.rt.forward(layer, q, k, v, self.pages[layer], step, o)
            out.append((q, o, starts))
        return out

    def history(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.k[layer][r]), torch.cat(self.v[layer][r])


def _attend(q, k, v, scale, keep=None):
    """q [H, d] over k, v [T, Hkv, d] (keep [Hkv, T] bool or None), float32."""
    hkv = k.shape[1]
    g = q.shape[0] // hkv
    s = torch.einsum("hgd,thd->hgt", q.view(hkv, g, -1), k) * scale
    if keep is not None:
        s = s.masked_fill(~keep[:, None, :], -math.inf)
    return torch.einsum("hgt,thd->hgd", torch.softmax(s, -1), v).reshape(q.shape[0], -1)


def _prefill_then_decode(h: Harness):
    h.step([37, 50], [37, 50])
    return h.step([38, 51], [1, 1])


def test_full_fetch_attends_every_row_as_dense_attention_does():
    h = Harness("full")
    prefill = h.step([37, 50], [37, 50])
    for layer, (q, o, starts) in enumerate(prefill):  # a prompt attends itself causally
        k, v = h.history(layer, 1)
        for t in (0, 20, 49):
            keep = (torch.arange(50) <= t).expand(h.hkv, 50)
            torch.testing.assert_close(
                o[starts[1] + t], _attend(q[starts[1] + t], k, v, h.scale, keep), rtol=1e-4, atol=1e-5
            )
    for _ in range(3):
        lengths = [len(torch.cat(h.k[0][r])) + 1 for r in range(2)]
        for layer, (q, o, starts) in enumerate(h.step(lengths, [1, 1])):
            for r in range(2):
                k, v = h.history(layer, r)
                torch.testing.assert_close(o[starts[r]], _attend(q[starts[r]], k, v, h.scale), rtol=1e-4, atol=1e-5)
    assert h.rt.counters.rows_attended == h.rt.counters.rows_context


def test_a_prompt_in_chunks_attends_its_earlier_chunks_as_one_prefill_does():
    h = Harness("full")
    h.step([20, 30], [20, 30])
    later = h.step([37, 50], [17, 20])  # chunked prefill: both requests continue their prompts
    for layer, (q, o, starts) in enumerate(later):
        k, v = h.history(layer, 1)
        for t in (0, 19):
            keep = (torch.arange(50) <= 30 + t).expand(h.hkv, 50)
            torch.testing.assert_close(
                o[starts[1] + t], _attend(q[starts[1] + t], k, v, h.scale, keep), rtol=1e-4, atol=1e-5
            )
    assert h.rt.store.bytes_read == 0  # no decode step yet


def test_infinigen_over_the_whole_context_is_dense():
    h = Harness("infinigen", budget=1.0)
    for layer, (q, o, starts) in enumerate(_prefill_then_decode(h)):
        for r in range(2):
            k, v = h.history(layer, r)
            torch.testing.assert_close(o[starts[r]], _attend(q[starts[r]], k, v, h.scale), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("steps, rope, correction", [(1, False, 0.0), (4, False, 0.0), (4, True, 0.0), (3, True, 0.06)])
def test_infinigen_in_pages_attends_what_the_library_selects_from_the_same_keys(steps, rope, correction):
    """The page's codes and the block table give the selection the library makes from the keys
    in memory (its own partial-key state, appended as transformers' cache does), also over the
    codes the decode steps wrote themselves, with the rotary table applied in the kernel, and with
    the own query's top-up (the correction) read from the same codes in the same pass."""
    h = Harness("infinigen", rope=rope, budget=0.25, correction=correction)
    decode = _prefill_then_decode(h)
    for i in range(1, steps):
        decode = h.step([38 + i, 51 + i], [1, 1])
    sel, attended = h.rt.selector, 0
    for layer in range(2, h.layers):  # the speculated layers
        q, o, starts = decode[layer]
        for r in range(2):
            k, v = h.history(layer, r)
            past = len(k) - 1
            state = sel.new_state(layer)
            prompt = past - (steps - 1)  # the prompt's keys measure the codes' statistics, as at a prefill
            for a, b in [(0, prompt), *((t, t + 1) for t in range(prompt, past))]:
                sel.on_append(state, layer, k[a:b].transpose(0, 1)[None], torch.ones(1, b - a, dtype=torch.bool))
            x, positions = h.seen[layer - 1]
            spec = sel.query(layer, x[starts[r] : starts[r] + 1][None], positions[starts[r] : starts[r] + 1])[:, :, 0]
            valid = all_valid(1, h.hkv, past)
            chosen = sel.select(state, layer, spec, past, valid)
            keep = torch.zeros(h.hkv, past + 1, dtype=torch.bool)
            for j in range(h.hkv):
                keep[j, chosen.indices[0, j][chosen.valid[0, j]]] = True
            extra = sel.correct(state, layer, q[starts[r] : starts[r] + 1], past, valid, chosen)
            if correction:
                assert extra is not None and int(extra.counts.sum()) > 0
                for j in range(h.hkv):
                    keep[j, extra.indices[0, j][extra.valid[0, j]]] = True
            keep[:, past] = True  # its own position
            attended += int(keep.sum())
            torch.testing.assert_close(o[starts[r]], _attend(q[starts[r]], k, v, h.scale, keep), rtol=1e-4, atol=1e-5)
            assert int(chosen.counts.max()) <= math.ceil(0.25 * past)
    assert attended < (0.4 + correction) * 2 * h.hkv * (h.layers - 2) * (50 + steps)


def test_the_page_codes_read_back_as_they_were_written():
    codes = PageCodes(10, 4)
    page = torch.zeros(6, 2, 4, page_bytes(10), dtype=torch.uint8)
    c = torch.randint(0, 255, (2, 5, 7), dtype=torch.uint8)
    s = torch.rand(2, 1, 7).to(torch.float16)
    blocks = torch.tensor([4, 1])
    slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(7)])
    codes.write(page, slots, c, s)
    got_c, got_s = codes.read(page, blocks[None], 7)
    assert torch.equal(got_c[0], c) and torch.equal(got_s[0], s)


@pytest.mark.parametrize(
    "text, words",
    [
        ("policy=dense", "does not run inside vLLM"),
        ("policy=infinigen,tier=disk", "tier=ram"),
        ("policy=infinigen,speculate_from=previous", "fitted"),
        ("budget=2", "budget"),
        ("nonsense", "KEY=VALUE"),
    ],
)
def test_settings_it_cannot_honour_are_refused_in_one_line(text, words):
    with pytest.raises(PluginSettingsError) as err:
        parse(text)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_settings_parse_as_the_command_line_does():
    s = parse("policy=infinigen, budget=0.2")
    assert s.config.budget == 0.2 and s.keeps_partial_keys and s.selects
    assert not parse("policy=full").keeps_partial_keys
