"""Models split across devices by an `accelerate` device map: each layer's buffers live on its own
device, and the session's hooks compose with accelerate's. This machine has one device (the CPU),
so the split map places every block on "cpu" with accelerate's hooks forced on, and the per-device
bookkeeping is checked with the CPU and the allocation-free "meta" device."""

import pytest
import torch
from accelerate import dispatch_model

from conftest import greedy_with_logits, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.storage import RamTier, TransferStats
from infinigen.transfer import RowBuffers


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_a_model_dispatched_with_a_split_device_map_decodes_as_the_plain_model(policy):
    cfg = InfiniGenConfig(policy=policy, alpha=1.0, calibration_tokens=64)
    plain = tiny_model("llama")
    with attach(plain, cfg, progress=False) as session:
        ref = greedy_with_logits(plain, session.new_cache())
    split = tiny_model("llama")
    names = [f"model.layers.{i}" for i in range(split.config.num_hidden_layers)]
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({name: "cpu" for name in names})
    split = dispatch_model(split, device_map=device_map, force_hooks=True)
    assert hasattr(split.model.layers[1], "_hf_hook"), "accelerate's hooks must be in place"
    with attach(split, cfg, progress=False) as session:
        out = greedy_with_logits(split, session.new_cache())
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)


def test_row_buffers_live_on_each_layers_device():
    tier = RamTier(1, 2, 8, torch.float16, TransferStats())
    buffers = RowBuffers()
    cpu0 = buffers.pair(0, tier, 10, torch.float32, "cpu")
    meta2 = buffers.pair(2, tier, 10, torch.float32, "meta")
    cpu2 = buffers.pair(2, tier, 4, torch.float32, "cpu")
    assert cpu0[0].device.type == "cpu" and meta2[0].device.type == "meta"
    assert cpu2[0] is cpu0[0], "layers of one parity on one device share their pair"
    assert buffers.pair(1, tier, 10, torch.float32, "meta")[0] is not meta2[0]
