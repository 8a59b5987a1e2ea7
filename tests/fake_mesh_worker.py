"""Run by tests/test_plan.py in a process of its own: one rank of a fake process group of any size
(TorchTitan's `fake_backend` comm mode: no GPU, no peers), the model built on the meta device and
sharded by the same `parallel.parallelize` call a run makes; prints this rank's bytes as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.utils import init_fake_mode

    from minirl.models.shapes import KNOWN_SHAPES
    from minirl.models.titan import titan_config
    from minirl.train import offload
    from minirl.train.parallel import parallelize

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on every target the model has (bf16 base)")
    a = ap.parse_args()
    init_fake_mode(a.world, rank=a.rank)
    shape = KNOWN_SHAPES[a.model]
    def adapt(model):  # what Trainer(lora=..., param_dtype="bfloat16") hands parallelize
        from minirl.models.shapes import lora_targets
        from minirl.train import lora

        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        lora.attach(model, rank=a.lora, alpha=2.0 * a.lora, targets=lora_targets("all", shape))

    model = parallelize(titan_config(shape), ep=a.ep, device=torch.device("meta"), seed=0,
                        adapt=adapt if a.lora else None)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    for p in params:  # a gradient of every parameter, as the backward leaves it, then Adam's state
        p.grad = torch.zeros_like(p)
    optim = torch.optim.AdamW(params, lr=1e-6)
    optim.step()
    nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    state = [v for s in optim.state.values() for k, v in s.items() if k != "step"]
    got = {"params": nbytes(params), "grads": nbytes(p.grad for p in params), "optim": nbytes(state),
           "dtypes": sorted({str(local(p).dtype) for p in params}), "frozen": nbytes(frozen),
           "frozen_dtypes": sorted({str(local(p).dtype) for p in frozen})}
    # train.offload = "optimizer", as Trainer.apply_update ends: gradients dropped, the moments sent
    # to the host ("meta" here: nothing to allocate). What the device still holds is whatever of the
    # old shards something still references (weakly watched): the plan says nothing
    optim.zero_grad(set_to_none=True)
    with torch.no_grad():  # to_local() under grad mode returns a fresh alias: watch the shard itself
        watched = [weakref.ref(local(t)) for t in state]
    del state
    got["watched"] = sum(r().nbytes for r in watched if r() is not None)  # all of them, before
    got["offloaded"] = offload.to_host(optim, "meta")
    got["left_on_device"] = sum(r().nbytes for r in watched if r() is not None)
    got["grads_after_step"] = nbytes(p.grad for p in params if p.grad is not None)
    print(json.dumps(got))


if __name__ == "__main__":
    main()
