"""What a training forward keeps for its backward, per token: run as a process of its own by
tests/test_memory_model.py (the FSDP2 path needs a process group, which must not outlive the test).

    python tests/saved_bytes.py SHAPE PATH AC      SHAPE tiny | moe (0.76B), PATH "one process" | fsdp2, AC none | full

prints {"per_token": bytes} as JSON: the storages the forward saves for backward
(torch.autograd.graph.saved_tensors_hooks), each counted once, without the weights (what a saved
tensor of a parameter's shape is: the bf16 copies autocast and FSDP2 make), at two lengths; the
difference over the difference of tokens is what a token costs, the fixed parts (caches, tables)
cancelled. The decoder alone: the output head's logits are the plan's own row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def saved(trainer, tokens_BL: torch.Tensor) -> int:
    weights = set()
    for p in trainer.model.parameters():
        shape = tuple(p.shape)
        weights |= {shape, shape[::-1], shape[:-2] + shape[-2:][::-1]}  # as saved, or transposed
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = getattr(t, "_local_tensor", t)
        if tuple(local.shape) not in weights:
            s = local.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    trainer.model.train()
    trainer.model._skip_lm_head = True
    try:
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16, enabled=not trainer.sharded)):
            trainer.model(tokens_BL)
    finally:
        trainer.model._skip_lm_head = False
    return sum(storages.values())


def main(shape_name: str, path: str, ac: str) -> dict:
    import torch.distributed as dist

    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer
    from tests.gpu import kit

    shape = {"tiny": TINY, "moe": kit.moe_shape()}[shape_name]
    if path == "fsdp2":  # TorchTitan's FSDP2 at world size 1: the cluster's code path in one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(shape, lr=1e-5, seed=0, param_dtype="bfloat16", shard=path == "fsdp2", pack_prompts=False,
                      activation_checkpoint=ac)
    lengths = (24, 56) if shape.max_seq_len <= 64 else (256, 512)
    g = torch.Generator().manual_seed(0)
    got = [saved(trainer, torch.randint(3, min(shape.vocab_size, 30), (1, n), generator=g)) for n in lengths]
    return {"per_token": (got[1] - got[0]) / (lengths[1] - lengths[0])}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
