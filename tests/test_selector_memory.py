"""What the selection keeps with the compute: reported by `summary()["selector_bytes"]`, and not
inflated by the growth of its buffers (an 8K prefill must not hold room for 16K positions)."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.growing import GROWTH_MIN, GrowingTensor
from infinigen.models import get_adapter


def test_a_grown_buffer_holds_under_a_quarter_of_room_and_keeps_its_data():
    buf, reference, grows = GrowingTensor(dim=-1), [], 0
    buf.append(torch.arange(1000.0).reshape(1, 1000))
    reference.append(torch.arange(1000.0).reshape(1, 1000))
    for step in range(3000):
        before = buf.full.data_ptr()
        x = torch.full((1, 1), float(step))
        buf.append(x)
        reference.append(x)
        grows += buf.full.data_ptr() != before
        assert buf.full.shape[-1] <= max(1.25 * buf.length, buf.length + GROWTH_MIN)
    assert torch.equal(buf.data, torch.cat(reference, dim=-1))
    assert grows <= 8  # 1000 -> 1250 -> 1562 -> 1952 -> 2440 -> 3050 -> 3812 -> 4765: amortized O(1)
    assert buf.nbytes == buf.full.numel() * 4


def _selector_bytes(cfg: InfiniGenConfig, prompt: int, new: int) -> tuple[int, list[int]]:
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(5))
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        model.generate(input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=new, do_sample=False)
        s = cache.summary()
    return s["selector_bytes"], [p["layer"] for p in s["per_layer"] if p["role"] == "select"]


@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("kv_dtype, width", [(None, 4), ("float16", 2), ("bfloat16", 2)])
def test_infinigen_reports_its_partial_keys_with_room_under_a_quarter(ratio, kv_dtype, width):
    """The partial keys hold r*d channels of every cached position of every speculated layer, at
    the KV's storage width (the tiny model computes in fp32: 4 bytes when the KV is kept as computed)."""
    prompt, new = 150, 40
    cfg = InfiniGenConfig(
        budget=0.25, partial_ratio=ratio, calibration_tokens=64, kv_dtype=kv_dtype, partial_format="kv"
    )
    held, speculated = _selector_bytes(cfg, prompt, new)
    a = get_adapter(tiny_model("llama"))
    per_position = a.num_kv_heads * round(ratio * a.head_dim) * width
    needed = len(speculated) * (prompt + new - 1) * per_position  # the last token is never fed back
    assert speculated and needed <= held <= len(speculated) * per_position * max(
        1.25 * (prompt + new - 1), prompt + new - 1 + GROWTH_MIN
    )


def test_fetch_all_keeps_nothing_for_selection():
    held, speculated = _selector_bytes(InfiniGenConfig(policy="full"), 60, 5)
    assert held == 0 and not speculated
