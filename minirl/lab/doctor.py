"""`minirl doctor`: where a training–inference mismatch comes from, measured source by source on
one fixed batch of rollouts (the recipe's B prompts × G responses, drawn with fixed seeds).

    precision   KL(μ‖π) with rollouts at each precision level: fp32, bf16, fp8 weights alone, fp8
                W8A8 (weights and per-token activations, as FP8 serving computes), and beyond the
                paper e5m2 W8A8 and NVFP4 W4A4; each engine samples its own batch, as a run would measure it;
                per response, the spread of log π(y)/μ(y), the mechanism that decides whether
                "without IS" is off-policy at all; for an MoE also with the engine's routes replayed (a
                route that flips is a precision effect too, but a lumpy one), and with only the
                *weights* rounded to bf16 / fp8 in an fp32 engine (the same tokens)
    engine      at equal precision (fp32 vLLM vs the fp32 TorchTitan forward): what kernels add
    routing     MoE: per layer, the share of tokens whose top-k experts differ between vLLM and
                the trainer; KL(μ‖π) without and with R3 (vLLM's routes replayed in the trainer)
    staleness   KL(π_θ‖π_θold) after 1, 2, 4 and 8 mini-batch updates of the recipe's loss,
                without replay, with R2 and with R3 (estimated on the batch as
                mean_t [r·log r − (r − 1)], r = π_θ/π_θold, tokens drawn from μ ≈ π_θold);
                sampling ahead (rollout.max_staleness = k ≥ 1): the same KL over the distribution
                of how many updates behind the trained tokens were, read from the newest run that
                sampled ahead at this k (`rollout/staleness_tokens`), else the controller's
                steady state (every token k steps behind); a step counted as N mini-batch updates
    truncation  where the recipe's rollout cuts its sampler (top-p, top-k, min-p), every level samples
                with the cut and the trainer's π is renormalized over each position's kept set, as a run
                trains; at the run's precision KL(μ‖π) is also taken with π over the whole vocabulary:
                what the cut adds when a trainer does not renormalize (loss.renormalize_kept = false)

KL(μ‖π) is estimated with k3 (`objective.train_inference_kl_k3`): unbiased like the run's k1
(mean of log μ − log π, the paper's) and far less noisy at these sizes; k1 is kept in the JSON
(`k1/…`). With `seeds` > 1 each figure is a mean ± spread (standard deviation) over seeds.
The trainer is fp32 (the CPU setting); vLLM's bf16 is its compute and weight dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minirl.config.precisions import NAMES, PRECISIONS
from minirl.data.prompts import response_text
from minirl.disk import atomic, store
from minirl.models import sizing
from minirl.rollout import make_engine
from minirl.rollout.engine import Truncation
from minirl.rollout.fp8 import fp8_roundtrip
from minirl.setup.preflight import check_model_folder
from minirl.setup.run_inputs import prepare_run
from minirl.train import objective
from minirl.train.batch import build_batch
from minirl.train.objective import loss_for, minibatch_indices
from minirl.train.replay import rollout_routes, route_agreement, tokens_with_a_flip
from minirl.train.trainer import Trainer

STALENESS_UPDATES = (1, 2, 4, 8)


def staleness_mix(ws, k: int) -> tuple[dict[int, float], str]:
    """The share of trained tokens by steps behind the trained weights at rollout.max_staleness = k,
    and where it comes from: the newest run of the workspace that sampled ahead at k (its rows'
    token histograms, summed), else the controller's steady state once the engine is ahead."""
    for run in ws.runs_newest_first():
        hists = [r["rollout/staleness_tokens"] for r in store.metric_rows(run / store.METRICS)
                 if len(r.get("rollout/staleness_tokens") or ()) == k + 1]
        total = [sum(col) for col in zip(*hists)]
        if sum(total):
            return ({lag: c / sum(total) for lag, c in enumerate(total) if c},
                    f"run {run.name}: {len(hists)} steps, {sum(total)} tokens")
    return {k: 1.0}, "no run sampled ahead at this k yet: the controller's steady state, every token k steps behind"


def kl_behind(fig: dict, mode: str, mix: dict[int, float], updates_per_step: int) -> float:
    """KL(π_θ‖π_θold) a token's lag adds, averaged over `mix` (steps behind → share): the KL after
    j = lag × N updates, linear between the measured j (0 at 0) and beyond 8 along the last segment.

    >>> fig = {f"staleness/off/{j}": 0.1 * j for j in (1, 2, 4, 8)}
    >>> round(kl_behind(fig, "off", {0: 0.5, 3: 0.5}, 1), 3), round(kl_behind(fig, "off", {2: 1.0}, 8), 3)
    (0.15, 1.6)
    """
    xs = (0, *STALENESS_UPDATES)
    ys = (0.0, *(fig[f"staleness/{mode}/{j}"] for j in STALENESS_UPDATES))

    def at(j: float) -> float:
        i = next((i for i in range(1, len(xs)) if j <= xs[i]), len(xs) - 1)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (j - xs[i - 1]) / (xs[i] - xs[i - 1])

    return sum(share * at(lag * updates_per_step) for lag, share in mix.items())


def diagnose(ws, rec, folder: Path, *, seeds: int = 3,
             progress: Callable[[str], None] = lambda what: None) -> dict:
    """Every figure of the doctor, per seed and aggregated, plus the advice lines."""
    inputs = prepare_run(ws, rec, resume=False)
    shape = check_model_folder(folder)
    moe = shape.is_moe
    trainer = Trainer(shape, lr=rec.train.lr, weight_decay=rec.train.weight_decay, grad_clip=rec.train.grad_clip,
                      pack_prompts=rec.train.pack_prompts)
    trainer.load_hf(folder)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    weights = trainer.hf_state_dict()
    rounded = {"bf16": {k: v.to(torch.bfloat16).float() for k, v in weights.items()}, "fp8": fp8_roundtrip(weights),
               "e5m2": fp8_roundtrip(weights, fmt="e5m2"), "nvfp4": fp8_roundtrip(weights, fmt="nvfp4")}
    progress("starting vLLM (fp32, bf16, and bf16 with activations rounded to e4m3, e5m2 and NVFP4)")
    # one engine a level, side by side, never asleep, each on one GPU at most
    kw = dict(seed=rec.train.seed, max_model_len=sizing.max_model_len(rec), capture_routes=moe,
              max_num_seqs=sizing.max_num_seqs(rec), sleep_level=0, tensor_parallel=1)
    level = lambda p: make_engine(folder, dataclasses.replace(rec.rollout, precision=p), **kw)  # noqa: E731
    # fp8-weights is the bf16 engine holding FP8-rounded weights; every other level an engine of its own
    engines = {p: level(p) for p in NAMES if p != "fp8-weights"}
    # the rollout precision levels (minirl/config/precisions.py), mildest first: the engine that samples at
    # each and the weights it holds
    fmt = {"w8": "fp8", "w8a8": "fp8"}  # the FP8 levels round the weights to e4m3
    holds = {p: rounded[fmt.get(PRECISIONS[p].emulate, PRECISIONS[p].emulate)] if PRECISIONS[p].rounds else weights
             for p in NAMES}
    levels = tuple((p, engines["bf16" if p == "fp8-weights" else p], holds[p]) for p in NAMES)
    bench = _Bench(trainer, rec, shape, inputs, start)
    B, r = rec.train.prompts_per_step, rec.rollout
    k = rec.rollout.max_staleness
    mix, mix_source = staleness_mix(ws, k) if k else ({0: 1.0}, "")
    per_seed = []
    for seed in range(seeds):
        progress(f"seed {seed + 1}/{seeds}")
        problems = inputs.train[seed * B : (seed + 1) * B] if len(inputs.train) >= (seed + 1) * B else inputs.train[:B]
        prompts = [p.prompt_ids for p in problems]
        fig, batches = _precision_levels(bench, levels, prompts, seed)
        fig.update(_weights_alone(bench, engines["fp32"], weights, rounded, prompts, *batches["fp32"][:3]))
        groups, batch, pi, routes, own, r3_lp = batches[r.precision]  # the run's own precision
        fig.update(_cut_and_routes(bench, batch, pi, routes, own, r3_lp))
        fig.update(_staleness(bench, problems, groups, batch, routes, seed))
        if k:
            fig["staleness/behind"] = kl_behind(fig, rec.train.replay if moe else "off", mix, rec.train.minibatches)
        per_seed.append(fig)
    inputs.grading.close()
    summary = _aggregate(per_seed)
    cuts = bench.cuts
    return {"checkpoint": str(folder), "seeds": seeds, "batch": f"{B} prompts × {rec.train.group_size} responses",
            "moe": moe, "rollout_precision": r.precision, "temperature": r.temperature,
            "cuts": {"top_p": cuts.top_p, "top_k": cuts.top_k, "min_p": cuts.min_p} if cuts.cuts else None,
            "minibatches": rec.train.minibatches,
            "replay": rec.train.replay, "is_mode": rec.loss.is_mode, "figures": summary, "per_seed": per_seed,
            "max_staleness": k, "staleness_mix": mix, "staleness_source": mix_source,
            "advice": advice(summary, moe=moe, rec=rec, mix=mix, mix_source=mix_source)}


@dataclasses.dataclass
class _Bench:
    """What every measurement of a seed shares: the trainer, put back at the checkpoint (`start`) after
    each measurement that updates it, the recipe, the model's shape and the run's inputs."""

    trainer: Trainer
    rec: Any
    shape: Any
    inputs: Any
    start: dict

    @functools.cached_property
    def cuts(self) -> Truncation:
        return Truncation.of(self.rec.rollout)

    @functools.cached_property
    def pad(self) -> int:
        return self.inputs.tokenizer.pad_token_id

    def restart(self) -> None:
        self.trainer.model.load_state_dict(self.start)
        self.trainer.optim.state.clear()


def _precision_levels(bench: _Bench, levels, prompts: list, seed: int) -> tuple[dict, dict]:
    """Precision, as a run measures it: each rollout precision samples its own batch and the trainer scores
    it, KL(μ‖π) and the spread over responses; for an MoE also with the engine's routes replayed (precision
    without route flips). Returns the figures and, per level, (groups, batch, π, routes, the trainer's own
    routes, π with the routes replayed)."""
    trainer, r, G, moe = bench.trainer, bench.rec.rollout, bench.rec.train.group_size, bench.shape.is_moe
    fig, batches = {}, {}
    for name, engine, w in levels:
        engine.load_weights(w.items())
        groups = engine.generate(prompts, n=G, temperature=r.temperature, max_tokens=r.max_tokens,
                                 seed=1000 + seed, **bench.cuts.kw)
        batch = _batch(prompts, groups, G, bench.pad, temperature=r.temperature)
        pi, _, own = trainer.logprobs(batch, record_routes=moe)  # own: the trainer's routes, where they flip
        rr = pi_r3 = None
        fig[f"kl/{name}"] = objective.train_inference_kl_k3(batch.rollout_logp_BT, pi, batch.mask_BT)
        fig[f"k1/{name}"] = objective.train_inference_kl(batch.rollout_logp_BT, pi, batch.mask_BT)
        fig.update({f"{k}/{name}": v for k, v in per_response(batch.rollout_logp_BT, pi, batch.mask_BT).items()})
        if moe:
            rr = rollout_routes([c for g in groups for c in g], batch, trainer.replay.num_layers, bench.shape.top_k,
                                bench.shape.num_experts)
            pi_r3, _, _ = trainer.logprobs(batch, routes=rr)
            fig[f"kl_r3/{name}"] = objective.train_inference_kl_k3(batch.rollout_logp_BT, pi_r3, batch.mask_BT)
            fig[f"routing/tokens_with_a_flip/{name}"] = tokens_with_a_flip(rr, own, batch.mask_BT)
        batches[name] = (groups, batch, pi, rr, own, pi_r3)
    return fig, batches


def _weights_alone(bench: _Bench, fp32_engine, weights: dict, rounded: dict, prompts: list, groups, batch,
                   pi) -> dict:
    """Weights alone: the fp32 sample's tokens scored by the fp32 engine holding bf16- and FP8-rounded
    weights; the engine holds the checkpoint's weights again after."""
    G = bench.rec.train.group_size
    if bench.rec.rollout.temperature != 1.0 or bench.cuts.cuts:  # `score` reads vLLM's prompt log-probs: T = 1, uncut
        pi = bench.trainer.logprobs(dataclasses.replace(batch, temperature=1.0, kept_BT=None))[0]
    resps = [list(c.token_ids) for g in groups for c in g]
    prompts_flat = [p for p in prompts for _ in range(G)]
    fig = {}
    for name in ("bf16", "fp8"):
        fp32_engine.load_weights(rounded[name].items())
        mu = _as_batch(prompts_flat, resps, fp32_engine.score(prompts_flat, resps), bench.pad)
        fig[f"kl/weights_{name}"] = objective.train_inference_kl_k3(mu.rollout_logp_BT, pi, batch.mask_BT)
    fp32_engine.load_weights(weights.items())
    return fig


def _cut_and_routes(bench: _Bench, batch, pi, routes, own, r3_lp) -> dict:
    """On the run's own precision: what a cut sampler adds where π is taken over the whole vocabulary, and
    for an MoE the routes' per-layer disagreement and KL(μ‖π) without and with R3."""
    fig = {}
    if bench.cuts.cuts:  # π over the whole vocabulary, as a trainer that ignores the cut takes it
        whole = bench.trainer.logprobs(dataclasses.replace(batch, kept_BT=None))[0]
        fig["kl/uncut_pi"] = objective.train_inference_kl_k3(batch.rollout_logp_BT, whole, batch.mask_BT)
    if bench.shape.is_moe:
        agree = route_agreement(routes, own, batch.mask_BT)
        fig["routing/disagree_per_layer"] = [float(1 - a) for a in agree]
        fig["routing/disagree"] = float(1 - agree.mean())
        fig["kl/run_no_replay"] = objective.train_inference_kl_k3(batch.rollout_logp_BT, pi, batch.mask_BT)
        fig["kl/run_r3"] = objective.train_inference_kl_k3(batch.rollout_logp_BT, r3_lp, batch.mask_BT)
    return fig


def _staleness(bench: _Bench, problems: list, groups, batch, routes, seed: int) -> dict:
    """KL(π_θ‖π_θold) after 1, 2, 4 and 8 mini-batch updates of the recipe's loss on the run's precision's
    batch, graded and given its group advantages: without replay, and for an MoE with R2 and R3. The
    trainer is back at the checkpoint after."""
    trainer, rec, G = bench.trainer, bench.rec, bench.rec.train.group_size
    tok = bench.inputs.tokenizer
    scores = bench.inputs.grading.grade([(p.record, _text(c.token_ids, tok, tok.eos_token_id))
                                         for p, g in zip(problems, groups) for c in g])
    adv = objective.group_advantages(torch.tensor([s.score for s in scores], dtype=torch.float32).view(-1, G),
                                     std_scale=rec.loss.adv_std).flatten()
    batch = _with_adv(batch, adv)
    loss_fn = loss_for(rec.loss)
    fig = {}
    for mode in ("off", "r2", "r3") if bench.shape.is_moe else ("off",):
        bench.restart()
        replay = routes if mode == "r3" else None
        old, _, recorded = trainer.logprobs(batch, routes=replay, record_routes=mode == "r2")
        replay = recorded if mode == "r2" else replay
        b = batch.with_old_logp(old)
        order = minibatch_indices(len(problems), G, max(STALENESS_UPDATES), seed=seed)
        for j, idx in enumerate(order, start=1):
            trainer.forward_backward(b.select(idx), loss_fn, routes=replay[:, idx] if replay is not None else None)
            trainer.optim_step()
            if j in STALENESS_UPDATES:
                now, _, _ = trainer.logprobs(b, routes=replay)
                fig[f"staleness/{mode}/{j}"] = _kl_from_old(now, old, batch.mask_BT)
    bench.restart()
    return fig


def per_response(mu_BT: torch.Tensor, pi_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """The gap over whole responses, what the first-order approximation depends on: the spread
    (SD over responses) of log π(y)/μ(y) = Σ_t log π/μ, its prediction √(2·L·KL) from the mean
    length L and the per-token KL, and L itself. The paper's long responses have 4.5–8; at ≥ 1
    "without IS" is no longer nearly on-policy (docs/lab.md).

    >>> m = torch.ones(2, 3); f = per_response(torch.zeros(2, 3), torch.tensor([[.1, .1, .1], [-.1, -.1, -.1]]), m)
    >>> round(f["response_sd"], 3), f["length"]
    (0.424, 3.0)
    """
    log_ratio = ((pi_BT - mu_BT) * mask_BT).sum(-1)
    length = float(mask_BT.sum(-1).mean())
    kl = objective.train_inference_kl_k3(mu_BT, pi_BT, mask_BT)
    return {"response_sd": float(log_ratio.std()) if len(log_ratio) > 1 else 0.0, "length": length,
            "response_sd_predicted": math.sqrt(2 * length * max(kl, 0.0))}


def _batch(prompts, groups, G: int, pad: int, *, temperature: float):
    comps = [c for g in groups for c in g]
    return build_batch([p for p in prompts for _ in range(G)], [c.token_ids for c in comps],
                       [c.logprobs for c in comps], None, pad_id=pad, temperature=temperature,
                       kept=[c.kept for c in comps])


def _as_batch(prompts, resps, logps, pad: int):
    return build_batch(prompts, resps, logps, None, pad_id=pad)


def _with_adv(batch, adv: torch.Tensor):
    return dataclasses.replace(batch, adv_B=adv)


def _text(ids, tok, eos: int) -> str:
    return response_text(ids, lambda x: tok.decode(x, skip_special_tokens=False), eos)


def _kl_from_old(now_BT: torch.Tensor, old_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """KL(π_θ ‖ π_θold) from tokens of π_θold: mean_t [r·log r − (r − 1)], r = π_θ/π_θold (unbiased,
    as E[r − 1] = 0 under π_θold, and never negative per token)."""
    d = (now_BT - old_BT) * mask_BT
    r = torch.exp(d)
    return float(((r * d - (r - 1)) * mask_BT).sum() / mask_BT.sum().clamp(min=1.0))


def _aggregate(per_seed: list[dict]) -> dict:
    """{key: {"mean", "spread"}} (lists element by element)."""
    out = {}
    for k, v in per_seed[0].items():
        if isinstance(v, list):
            cols = list(zip(*(s[k] for s in per_seed)))
            out[k] = [{"mean": statistics.fmean(c), "spread": statistics.pstdev(c)} for c in cols]
        else:
            vals = [s[k] for s in per_seed]
            out[k] = {"mean": statistics.fmean(vals), "spread": statistics.pstdev(vals)}
    return out


def advice(f: dict, *, moe: bool, rec, mix: dict[int, float] | None = None, mix_source: str = "") -> list[str]:
    """The paper's rules, each with the figure that triggered it; with rollout.max_staleness ≥ 1, the
    staleness of `mix` (steps behind → share of tokens, from `mix_source`)."""
    m = lambda k: f[k]["mean"]  # noqa: E731
    out = []
    p = rec.rollout.precision
    sd = m(f"response_sd/{p}")
    out.append(f"per response, log π(y)/μ(y) spreads by {sd:.2f} at {p} rollouts (L = {m(f'length/{p}'):.0f} tokens; "
               f"√(2·L·KL) predicts {m(f'response_sd_predicted/{p}'):.2f}): "
               + ("at ≥ 1 the first-order approximation loosens and the IS correction matters most (the paper's "
                  "long responses: 4.5–8)." if sd >= 1 else "under 1, rollouts are near-typical samples of the trainer's "
                  "policy and \"without IS\" is nearly on-policy (the paper's long responses: 4.5–8)."))
    if m("kl/fp8") > m("kl/bf16"):
        on = rec.loss.is_mode != "off"
        out.append(f"fp8 rollouts (W8A8) raise KL(μ‖π) from {m('kl/bf16'):.2e} (bf16) to {m('kl/fp8'):.2e}: keep the token IS "
                   f"correction on{' (it is)' if on else ' (it is off: set loss.is_mode = truncate)'}.")
    if "kl/uncut_pi" in f:
        gap, whole = m(f"kl/{p}"), m("kl/uncut_pi")
        on = rec.loss.renormalize_kept
        added = max(whole - gap, 0.0)
        out.append(f"the sampler's cut (top-p {rec.rollout.top_p:g}, top-k {rec.rollout.top_k}, min-p "
                   f"{rec.rollout.min_p:g}) adds {added:.2e} to KL(μ‖π) at {p} rollouts where π is taken over the "
                   f"whole vocabulary ({whole:.2e} against {gap:.2e} over the kept set, "
                   f"{added / max(whole, 1e-30):.0%} of it): "
                   + ("the trainer renormalizes over the kept set (loss.renormalize_kept = true)." if on else
                      "this run does not (loss.renormalize_kept = false): its ratio carries the kept mass."))
    if m("kl/fp32") < 0.5 * m("kl/bf16"):
        out.append(f"at equal precision vLLM and TorchTitan agree to {m('kl/fp32'):.1e}: the gap is precision, not "
                   f"kernels (bf16 weights alone give {m('kl/weights_bf16'):.1e}).")
    else:
        out.append(f"even at fp32 the engines differ by {m('kl/fp32'):.1e} (bf16: {m('kl/bf16'):.1e}): kernels add a "
                   "gap of their own; keep the IS correction on.")
    if moe:
        worst = max(range(len(f["routing/disagree_per_layer"])), key=lambda i: f["routing/disagree_per_layer"][i]["mean"])
        if m("kl/run_r3") < m("kl/run_no_replay"):
            out.append(f"MoE: routes differ on {m('routing/disagree'):.1%} of tokens (layer {worst} most); R3 lowers "
                       f"KL(μ‖π) from {m('kl/run_no_replay'):.2e} to {m('kl/run_r3'):.2e}: use R3 (--replay r3), above "
                       f"all off-policy (N ≥ 4; this recipe has N = {rec.train.minibatches}).")
        else:
            out.append(f"MoE: routes differ on {m('routing/disagree'):.1%} of tokens, but R3 does not lower KL(μ‖π) "
                       f"here ({m('kl/run_no_replay'):.2e} → {m('kl/run_r3'):.2e}).")
        s8 = {mode: m(f"staleness/{mode}/8") for mode in ("off", "r2", "r3")}
        best = min(s8, key=s8.get)
        # R2 replays π_θold's own routes, so it holds staleness lowest by construction; R3 replays
        # the rollout's, which is what also removes the mismatch above: the two lines answer two questions
        why = {"r2": " (R2 replays π_θold's own routes; R3, which also removes the rollout mismatch above, "
                     f"stays {s8['r3'] / max(s8['off'], 1e-30):.0%} of no replay)",
               "r3": "", "off": ""}[best]
        out.append(f"staleness after 8 mini-batch updates: KL(π_θ‖π_θold) {s8['off']:.2e} without replay, "
                   f"{s8['r2']:.2e} with R2, {s8['r3']:.2e} with R3 (growing with N from "
                   f"{m('staleness/off/1'):.2e} after 1); lowest on staleness alone: {best.upper()}{why}.")
    else:
        out.append(f"staleness after 8 mini-batch updates: KL(π_θ‖π_θold) {m('staleness/off/8'):.2e} "
                   f"(after 1: {m('staleness/off/1'):.2e}); dense model: no routing to replay.")
    if "staleness/behind" in f:
        k, N, gap = rec.rollout.max_staleness, rec.train.minibatches, m(f"kl/{p}")
        behind, shares = m("staleness/behind"), " / ".join(f"{(mix or {}).get(lag, 0.0):.0%}" for lag in range(k + 1))
        verdict = (f"{behind / max(gap, 1e-30):.1f}× the precision gap KL(μ‖π) {gap:.2e} at {p}: the IS weight (capped at "
                   f"C = {rec.loss.tis_cap:g}) and clipping must absorb it; lower k if loss/is_weight_max and the "
                   "guard's KL climb" if behind > gap else
                   f"under the precision gap KL(μ‖π) {gap:.2e} at {p}: sampling ahead costs less than the precision does")
        out.append(f"sampling ahead (rollout.max_staleness = {k}): trained tokens {shares} steps behind (0…{k}; "
                   f"{mix_source}); at N = {N} update(s) a step the policy moves KL(π_θ‖π_θold) ≈ {behind:.2e} between "
                   f"the weights that sampled a token and θ_old, {verdict}.")
    return out


def write(report: dict, out_dir: Path) -> tuple[Path, Path]:
    """doctor-<time>.json and .png in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / time.strftime("doctor-%Y%m%d-%H%M%S")
    atomic.write_text(stem.with_suffix(".json"), json.dumps(report, indent=2))
    return stem.with_suffix(".json"), plot(report, stem.with_suffix(".png"))


def plot(report: dict, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = report["figures"]
    panels = 3 if report["moe"] else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), constrained_layout=True,
                             gridspec_kw={"width_ratios": [1.5] + [1] * (panels - 1)})
    names = [*NAMES, "weights_bf16", "weights_fp8"]
    labels = ["fp32", "bf16", "fp8\nweights", "fp8\nW8A8", "e5m2\nW8A8", "nvfp4\nW4A4", "bf16 w.\n(fp32 vLLM)",
              "fp8 w.\n(fp32 vLLM)"]
    kl = [f[f"kl/{n}"]["mean"] for n in names]
    bars = axes[0].bar(labels, [max(v, 1e-16) for v in kl], yerr=[f[f"kl/{n}"]["spread"] for n in names],
                color=["tab:green", "tab:blue", "tab:red", "tab:cyan", "tab:pink", "tab:purple"])
    axes[0].set_yscale("log")  # fp32 and bf16 sit orders of magnitude below fp8 and nvfp4
    axes[0].tick_params(axis="x", labelsize=7)
    axes[0].bar_label(bars, labels=[f"{v:.1e}" for v in kl], fontsize=6)
    axes[0].set_title("KL(μ‖π) by rollout precision", fontsize=10)
    for mode in ("off", "r2", "r3") if report["moe"] else ("off",):
        ys = [f[f"staleness/{mode}/{n}"]["mean"] for n in STALENESS_UPDATES]
        axes[1].plot(STALENESS_UPDATES, ys, marker="o", label={"off": "no replay"}.get(mode, mode.upper()))
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("mini-batch updates")
    axes[1].set_title("staleness KL(π_θ‖π_θold)", fontsize=10)
    axes[1].legend(fontsize=8)
    if report["moe"]:
        d = [x["mean"] for x in f["routing/disagree_per_layer"]]
        axes[2].bar(range(len(d)), d)
        axes[2].set_xticks(range(len(d)))  # whole layers, not fractional ticks
        axes[2].set_xlabel("MoE layer")
        axes[2].set_title(f"routes differing (vLLM {report['rollout_precision']} vs trainer)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
