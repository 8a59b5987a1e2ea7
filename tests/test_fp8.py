"""FP8 rollout-weight emulation through torchao."""

import torch

from minirl.fp8 import fp8_roundtrip
from minirl.models import TINY
from minirl.train import Trainer


def test_fp8_roundtrip_rounds_projections_only():
    sd = Trainer(TINY, lr=1e-3, seed=0).hf_state_dict()
    q = fp8_roundtrip(sd)
    assert q.keys() == sd.keys()
    changed = {k for k in sd if not torch.equal(sd[k], q[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
              "model.layers.0.input_layernorm.weight"):
        assert torch.equal(sd[k], q[k]), k
    k = "model.layers.1.mlp.experts.5.down_proj.weight"
    rel = float((sd[k] - q[k]).norm() / sd[k].norm())
    assert 0.005 < rel < 0.06, rel  # e4m3 has 3 mantissa bits: a few % relative error
    assert q[k].dtype == sd[k].dtype


def test_fp8_roundtrip_is_idempotent():
    sd = Trainer(TINY, lr=1e-3, seed=1).hf_state_dict()
    once = fp8_roundtrip(sd)
    twice = fp8_roundtrip(once)
    for k in once:
        torch.testing.assert_close(twice[k], once[k], rtol=0, atol=1e-6)
