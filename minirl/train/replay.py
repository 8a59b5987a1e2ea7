"""Routing Replay for the TorchTitan MoE router (paper §3.2).

    R2: replay the experts the *training engine* chose for the rollout tokens under π_θold
        (recorded while computing π_old, replayed in every mini-batch).
    R3: replay the experts the *inference engine* chose while sampling (captured from vLLM).

Only the discrete top-k selection is replayed. Gate weights are recomputed from the current router
scores over the replayed experts (the router's own score function, then its route normalisation
and scale), so the router keeps its gradient. Replay state is held per forward call, not consumed,
so activation-checkpoint recompute sees the same indices.

Routes are stored compactly: uint8 when the model has ≤ 256 experts, else int16, shaped
[n_layers, B, T, K] (T = positions fed to the model, i.e. L − 1 for a batch of length L).
A shape mismatch is an error, never a silent misalignment.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minirl.train.objective import train_inference_kl


def route_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


class RoutingReplay:
    """Installed once on a TorchTitan model. Replays while routes are set; records while recording."""

    def __init__(self, model: torch.nn.Module):
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)]
        self.recording = False
        self._recorded: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._replay: torch.Tensor | None = None  # [n_layers, B, T, K]
        for i, router in enumerate(self.routers):
            router.forward = functools.partial(self._forward, i, router, router.forward)

    @property
    def active(self) -> bool:
        """Replaying or recording: routes are in the batch's [B, T] layout now."""
        return self.recording or self._replay is not None

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    # ----- recording ----------------------------------------------------------------------------
    def start_recording(self) -> None:
        self.recording, self._recorded = True, [[] for _ in self.routers]

    def stop_recording(self) -> torch.Tensor:
        """Routes of everything forwarded since start_recording, [n_layers, B, T, K], on the CPU
        (one copy for the whole batch, not one per layer and forward)."""
        self.recording = False
        return torch.stack([torch.cat(chunks, dim=0) for chunks in self._recorded]).cpu()

    # ----- replay -------------------------------------------------------------------------------
    def set_replay(self, routes_NBTK: torch.Tensor | None) -> None:
        if routes_NBTK is not None and routes_NBTK.shape[0] != self.num_layers:
            raise ValueError(f"routes cover {routes_NBTK.shape[0]} MoE layers, the model has {self.num_layers}")
        self._replay = routes_NBTK

    def _forward(self, i: int, router, original, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        out = self._replayed(i, router, x_BLD) if self._replay is not None else original(x_BLD, expert_bias_E)
        if self.recording:  # what the experts actually received, replayed or chosen
            self._recorded[i].append(out[1].detach().to(route_dtype(router.num_experts)))  # stays on the device
        return out

    def _replayed(self, i: int, router, x_BLD: torch.Tensor):
        ids_BLK = self._replay[i].to(device=x_BLD.device, dtype=torch.long)
        if ids_BLK.shape[:2] != x_BLD.shape[:2] or ids_BLK.shape[2] != router.top_k:
            raise ValueError(
                f"layer {i}: replayed routes {tuple(ids_BLK.shape)} do not fit tokens {tuple(x_BLD.shape[:2])} "
                f"× top-k {router.top_k}"
            )
        # The router's own scoring, as in TokenChoiceTopKRouter.forward, minus the top-k choice.
        with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
            scores_BLE = router.gate(x_BLD)
        scores_BLE = torch.sigmoid(scores_BLE) if router.score_func == "sigmoid" else F.softmax(scores_BLE, dim=-1)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)
        if router.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_BLK * router.route_scale, ids_BLK, scores_BLE


def route_agreement(a_NBTK: torch.Tensor, b_NBTK: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of (masked) tokens whose top-k *set* is the same in a and b, [n_layers]."""
    a = torch.sort(a_NBTK.long(), dim=-1).values
    b = torch.sort(b_NBTK.long(), dim=-1).values
    same_NBT = (a == b).all(dim=-1).float()
    return (same_NBT * mask_BT).sum(dim=(1, 2)) / mask_BT.sum().clamp(min=1.0)


def tokens_with_a_flip(a_NBTK: torch.Tensor, b_NBTK: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """The share of (masked) tokens whose top-k set differs between a and b in at least one layer:
    what a route flip does to a response is set by the token's worst layer, not the mean one."""
    a = torch.sort(a_NBTK.long(), dim=-1).values
    b = torch.sort(b_NBTK.long(), dim=-1).values
    flipped_BT = (a != b).any(dim=-1).any(dim=0).float()
    return float((flipped_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0))


def rollout_routes(comps, batch, n_layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """The rollout engine's routes laid out like the batch, [n_layers, B, L-1, K].

    Positions past a sequence's end (padding) get experts 0..K-1: they are masked out of the loss
    and, attention being causal, cannot affect real positions."""
    B, T = batch.mask_BT.shape
    dtype = route_dtype(num_experts)
    out = torch.arange(top_k, dtype=dtype).expand(n_layers, B, T, top_k).clone()
    for i, c in enumerate(comps):
        r = torch.from_numpy(c.routes).to(dtype).permute(1, 0, 2)  # [layers, n, K]
        if r.shape[0] != n_layers or r.shape[2] != top_k:
            raise RuntimeError(f"rollout routes {tuple(r.shape)} do not match {n_layers} MoE layers × top-{top_k}")
        out[:, i, : r.shape[1]] = r
    return out


def diagnostics(trainer, batch, routes_NBTK: torch.Tensor, *, total=dict) -> dict:
    """R3's replayed routes against the trainer's own routing under π_old (`train.replay_diagnostics`):
    their agreement, by layer and overall, the tokens where any layer flips, and KL(μ‖π_old) as it
    would be without the replay; of multi-turn episodes, the agreement over the environment's tokens
    too (their rows from the next turn's prefill), over every rank's: `total` sums a dict of counts
    over the ranks (the key is then on every rank's row or on none)."""
    own_logp, _, own_routes = trainer.logprobs(batch, record_routes=True)
    agree = route_agreement(routes_NBTK, own_routes, batch.mask_BT)
    env = environment_positions(batch)
    n = float(env.sum())
    env_counts = total({"agreeing": float(route_agreement(routes_NBTK, own_routes, env).mean()) * n, "positions": n})
    return {
        "replay/route_agreement": float(agree.mean()),
        "replay/tokens_with_a_flip": tokens_with_a_flip(routes_NBTK, own_routes, batch.mask_BT),
        **{f"replay/route_agreement_l{i}": float(a) for i, a in enumerate(agree)},
        **({"replay/route_agreement_env": env_counts["agreeing"] / env_counts["positions"]}
           if env_counts["positions"] else {}),
        "train/kl_mu_pi_old_noreplay": train_inference_kl(batch.rollout_logp_BT, own_logp, batch.mask_BT),
    }


def environment_positions(batch) -> torch.Tensor:
    """[B, L-1]: 1 where a position an episode fed is an environment's token (mask 0 after the prompt);
    none in a single-turn batch. Token p's own mask is the batch's at p − 1 (what predicts it)."""
    B, T = batch.mask_BT.shape
    before = torch.cat([torch.ones(B, 1), batch.mask_BT[:, :-1]], dim=1)
    p = torch.arange(T)
    inside = (p >= batch.prompt_len_B[:, None]) & (p < batch.seq_len_B[:, None] - 1)
    return ((before == 0) & inside).float()
