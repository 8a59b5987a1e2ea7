"""Run under torchrun by tests/test_parallel.py: one MiniRL update of the tiny model, this rank
taking its share of a fixed batch; rank 0 saves the loss and the whole updated weights."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fixed_batch(shared: bool = False):
    """8 rows; shared: two prompts of 4 responses each (one group per rank: packed, packing.py)."""
    from minirl.train.batch import build_batch

    g = torch.Generator().manual_seed(7)
    B = 8
    prompts = [[int(x) for x in torch.randint(3, 30, (3,), generator=g)] + [16] for _ in range(B)]
    if shared:
        prompts = [prompts[i // 4 * 4] for i in range(B)]
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] + [2] for n in (1, 3, 2, 4, 1, 2, 3, 2)]
    mu = [[float(-torch.rand(1, generator=g)) - 1.0 for _ in r] for r in resps]
    adv = [0.5, -0.5, 1.0, -1.0, 0.25, -0.25, 0.75, -0.75]
    return build_batch(prompts, resps, mu, adv, pad_id=0)


def fixed_routes(batch, n_layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """R3 stand-in: rollout-engine routes, a fixed random top-k set per token and layer."""
    g = torch.Generator().manual_seed(11)
    B, T = batch.mask_BT.shape
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n_layers * B * T)]
                       ).view(n_layers, B, T, top_k).to(torch.uint8)


def one_update(trainer, batch, replay: str, routes=None) -> tuple[float, dict[str, torch.Tensor]]:
    """π_old (recording routes for R2), then one MiniRL update replaying the routes; returns the
    loss and the (clipped) gradients it applied, whole."""
    from torch.distributed.tensor import DTensor

    from minirl.train.objective import minirl_loss

    old, _, recorded = trainer.logprobs(batch, routes=routes if replay == "r3" else None, record_routes=replay == "r2")
    use = recorded if replay == "r2" else routes if replay == "r3" else None
    b = batch.with_old_logp(old)
    loss, _ = trainer.forward_backward(
        b, lambda lp, x: minirl_loss(lp, x.old_logp_BT, x.rollout_logp_BT, x.adv_B, x.mask_BT), routes=use)
    trainer.clip_grads()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.apply_update()
    return loss, grads


def one_process_init() -> dict[str, torch.Tensor]:
    """The initial weights of `Trainer(TINY, seed=0)` in one process (sharded ranks draw theirs
    shard by shard, so a comparison starts both from these)."""
    from minirl.models.shapes import TINY
    from minirl.models.titan import titan_config

    torch.manual_seed(0)
    model = titan_config(TINY).build()
    model.init_states()
    return model.state_dict()


LORA = {"rank": 4, "alpha": 8.0, "targets": ("q", "k", "v", "o", "experts")}


def lora_init() -> dict[str, torch.Tensor]:
    """One process's LoRA trainer (seed 0) with every B drawn non-zero, so both A and B get
    gradients: the start both sides of a comparison load."""
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=1e-2, seed=0, lora=LORA, shard=False)
    tr.model.load_state_dict(one_process_init(), strict=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if ".lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return tr.model.state_dict()


def final_folder(trainer, out: Path, tokenizer: Path, *, main: bool) -> dict:
    """The end of a run (run/final_weights.py) on this rank, a decoder layer a bucket, measured: the
    bytes of whole tensors that gathering shards made (`DTensor.full_tensor`) alive at once at most,
    and in all, each freed when its last reference goes."""
    import weakref

    from torch.distributed.tensor import DTensor

    from minirl.run import final_weights

    seen = {"live": 0, "peak": 0, "total": 0}

    def freed(n: int) -> None:
        seen["live"] -= n

    whole = DTensor.full_tensor

    def counted(self, *args, **kw):
        t = whole(self, *args, **kw)
        n = t.numel() * t.element_size()
        seen["live"] += n
        seen["total"] += n
        seen["peak"] = max(seen["peak"], seen["live"])
        weakref.finalize(t, freed, n)
        return t

    DTensor.full_tensor = counted
    try:
        final_weights.write(trainer, out, main=main, tokenizer_dir=tokenizer, bucket_bytes=1)
    finally:
        DTensor.full_tensor = whole
    return {"peak": seen["peak"], "total": seen["total"], "live_after": seen["live"]}


def main() -> None:
    """Every case --cases FILE lists ({name: [flags]}), each saved to OUT/NAME.pt: one launch, one
    process group for them all (a launch was most of a case's time here)."""
    import json

    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    for name, flags in json.loads(Path(a.cases).read_text()).items():
        one_case(flags, str(Path(a.out) / f"{name}.pt"))
        dist.barrier()
    # both ranks leave together: a rank tearing gloo down while its peer still works aborted once
    # in a full-suite run ("terminate called without an active exception", SIGABRT at exit)
    dist.barrier()
    dist.destroy_process_group()


def one_case(flags: list[str], out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from minirl.models.shapes import TINY
    from minirl.rollout.sync import gather as sync_gather
    from minirl.train.parallel import full_state_dict
    from minirl.train.trainer import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--replay", default="off")
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument("--shared-prompts", action="store_true")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--head-chunk", type=int, default=None)
    ap.add_argument("--offload", action="store_true", help='train.offload = "optimizer"')
    ap.add_argument("--final-folder", default=None, help="then the end of a run: its HF folder, written here")
    ap.add_argument("--tokenizer", default=None, help="the tokenizer files the final folder takes")
    a = ap.parse_args(flags)
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(TINY, lr=1e-2, seed=0, ep=a.ep, param_dtype=a.param_dtype, lora=LORA if a.lora else None,
                      head_chunk=a.head_chunk, offload="optimizer" if a.offload else "none")
    set_model_state_dict(trainer.model, lora_init() if a.lora else one_process_init(),
                         options=StateDictOptions(full_state_dict=True))
    batch = fixed_batch(a.shared_prompts)
    routes = fixed_routes(batch, TINY.n_layers, TINY.top_k, TINY.num_experts)
    rows = torch.arange(len(batch)).chunk(world)[rank]
    loss, grads = one_update(trainer, batch.select(rows), a.replay, routes[:, rows])
    weights = full_state_dict(trainer.model)
    merged = {k: sync_gather(v) for k, v in trainer.weights().items()}  # as the weight sync reads them
    # Adam's first moments, whole, as they wait between updates (in host memory when offloaded)
    names = {p: n for n, p in trainer.model.named_parameters()}
    moments = {names[p]: s["exp_avg"].full_tensor() for p, s in trainer.optim.state.items()}
    end = final_folder(trainer, Path(a.final_folder), Path(a.tokenizer), main=rank == 0) if a.final_folder else None
    if rank == 0:
        layout = {n: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(map(str, p.placements)), tuple(p.to_local().shape))
                  for n, p in trainer.model.named_parameters() if "layers.0.moe.routed_experts.inner_experts." in n}
        torch.save({"loss": loss, "grads": grads, "weights": weights, "merged": merged, "expert_layout": layout,
                    "moments": moments, "end": end, "moment_placements": sorted({str(s["exp_avg"].placements)
                                                                     for s in trainer.optim.state.values()}),
                    "shard_dtypes": sorted({str(p.to_local().dtype) for p in trainer.model.parameters()})}, out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # the results are written and both ranks left gloo: exit without C++'s static destructors, where a
    # thread still joinable aborted rank 1 again once after the barrier above (2026-11-29, exit −6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
