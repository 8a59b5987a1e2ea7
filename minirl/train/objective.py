"""The MiniRL objective and its ablations, as small pure functions over tensors.

Symbols follow the paper (Zheng et al., "Stabilizing RL with LLMs", arXiv 2512.01374):
    μ_θold   rollout-engine policy (vLLM, bf16 / FP8) that sampled y        -> `rollout_logp`
    π_θold   training-engine recompute of that policy before any update      -> `old_logp`
    π_θ      training-engine policy being optimised                          -> `logp`
    A(x,y)   sequence advantage, one per response                            -> `adv`
    M_t      decoupled clip mask                                             -> `clip_mask(...)`

Shapes: B responses in the (mini-)batch, T response positions (right-padded).
`mask_BT` is 1.0 on real response tokens and 0.0 on padding; prompt tokens never appear here
(the trainer gathers response positions only).

Every loss is written to be *minimised* and returns (loss, metrics); metrics are computed under
no_grad and are plain floats keyed by fixed names.

Deliberately left out, as in the paper: no KL penalty, no entropy bonus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

from minirl.train.cuts import edge_of

if TYPE_CHECKING:  # for annotations only: the batch module needs nothing from here
    from minirl.train.batch import Batch

ISMode = Literal["truncate", "mask", "off"]
LossName = Literal["minirl", "grpo", "cispo"]


def valid_mask(mask_BT: torch.Tensor, rollout_logp_BT: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose rollout log-prob is not finite (an engine glitch) from the mask.

    They then count neither in the numerator nor in any per-response length."""
    return mask_BT * torch.isfinite(rollout_logp_BT).to(mask_BT.dtype)


def nonfinite_tokens(mask_BT: torch.Tensor, rollout_logp_BT: torch.Tensor) -> int:
    """How many response tokens have a log μ that is not finite: what `valid_mask` would drop.
    Counted before any loss, so a batch the engine broke is never trained on in silence."""
    return int((mask_BT.bool() & ~torch.isfinite(rollout_logp_BT)).sum())


def group_advantages(rewards_PG: torch.Tensor, *, std_scale: bool = False, eps: float = 1e-6,
                     trains_PG: torch.Tensor | None = None) -> torch.Tensor:
    """A(x, y_i) = R(x, y_i) − mean_j R(x, y_j) over the G responses of the same prompt x.

    rewards_PG: [P prompts, G responses]. The paper's MiniRL uses the plain mean baseline;
    `std_scale=True` divides by the group std (GRPO). A group whose rewards are all equal
    gets A = 0 either way. `trains_PG` (bool): the responses that are samples of the model; the
    others (an episode the environment's fault ended) get A = 0 and no place in the mean or std,
    so a group's advantages are those of its samples alone.

    >>> group_advantages(torch.tensor([[1., 0., 0., 1.]]))
    tensor([[ 0.5000, -0.5000, -0.5000,  0.5000]])
    >>> group_advantages(torch.tensor([[1., 0., 9., 1.]]), trains_PG=torch.tensor([[True, True, False, True]]))
    tensor([[ 0.3333, -0.6667,  0.0000,  0.3333]])
    """
    if trains_PG is None or bool(trains_PG.all()):
        adv = rewards_PG - rewards_PG.mean(dim=-1, keepdim=True)
        if std_scale:
            adv = adv / (rewards_PG.std(dim=-1, keepdim=True, unbiased=False) + eps)
        return adv
    w = trains_PG.to(rewards_PG.dtype)
    n = w.sum(dim=-1, keepdim=True).clamp(min=1.0)
    mean = (rewards_PG * w).sum(dim=-1, keepdim=True) / n
    adv = (rewards_PG - mean) * w
    if std_scale:
        adv = adv / ((adv**2).sum(dim=-1, keepdim=True) / n).sqrt().add(eps)
    return adv


def is_weight(
    logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    *,
    cap: float = 5.0,
    mode: ISMode = "truncate",
) -> torch.Tensor:
    """Token IS weight w_t = sg[π_θ(y_t) / μ_θold(y_t)], the *full* ratio against the rollout engine.

    mode "truncate" (TIS): min(w_t, cap).  "mask": w_t, but tokens with w_t > cap get 0.
    "off": 1 (no training–inference correction; the paper's collapse ablation).
    Always detached: the weight scales the gradient of log π_θ, it is not differentiated.

    >>> is_weight(torch.log(torch.tensor([[0.5, 0.9]])), torch.log(torch.tensor([[0.25, 0.1]])))
    tensor([[2., 5.]])
    """
    with torch.no_grad():
        if mode == "off":
            return torch.ones_like(logp_BT)
        # Clamp the log-ratio before exp so a wildly off token cannot overflow to inf·0 = nan.
        w = torch.exp(torch.clamp(logp_BT - rollout_logp_BT, max=50.0))
        if mode == "truncate":
            return torch.clamp(w, max=cap)
        if mode == "mask":
            return torch.where(w > cap, torch.zeros_like(w), w)
        raise ValueError(f"unknown IS mode {mode!r} (use truncate, mask or off)")


def sampler_logp(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    behind_BT: torch.Tensor | None,
) -> torch.Tensor:
    """log π_θold(y_t) with θ_old the weights that *sampled* y_t, the anchor of M_t's ratio (Eq. 7).

    The trainer recomputes π_old at the weights it trains. Synchronously those sampled the batch;
    sampling k updates ahead (rollout.max_staleness), a token `behind` was sampled by older weights,
    which the trainer no longer holds, and the engine's log μ_θold of them stands in (it differs
    from the trainer's by the training–inference gap alone, KL ~1e-3 here). Anchored at π_old
    instead (decoupled PPO's proximal policy), r_t ≡ 1 at N = 1 and nothing bounds how far an update
    moves a token since its stale sampler drew it, and the async bar's gain fell short
    (docs/results/async.md). Fresh tokens, and a μ that is not finite, keep π_old.

    >>> sampler_logp(torch.tensor([[-1., -2.]]), torch.tensor([[-1.5, -3.]]), torch.tensor([[0., 1.]]))
    tensor([[-1., -3.]])
    """
    if behind_BT is None:
        return old_logp_BT
    stale = (behind_BT > 0) & torch.isfinite(rollout_logp_BT)
    return torch.where(stale, rollout_logp_BT, old_logp_BT)


def clip_mask(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
) -> torch.Tensor:
    """Decoupled clip mask M_t on the staleness ratio r_t = π_θ / π_θold (paper Eq. 7):

        M_t = 0  if A > 0 and r_t > 1 + ε_high
        M_t = 0  if A < 0 and r_t < 1 − ε_low
        M_t = 1  otherwise

    On-policy (θ = θ_old) r_t ≡ 1, so M_t ≡ 1.
    """
    with torch.no_grad():
        r = torch.exp(logp_BT - old_logp_BT)
        a = adv_B[:, None]
        drop = ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low))
        return (~drop).to(logp_BT.dtype)


@torch.no_grad()
def clip_causes(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    anchor_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    behind_BT: torch.Tensor | None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
) -> dict[str, float]:
    """Why the decoupled clip M_t dropped a token, as shares of the step's response tokens.

    The clip's ratio factors as r_t = π_θ/θ_old = (π_θ/π_old) · (π_old/θ_old), θ_old the anchor
    (`sampler_logp`: μ for a token sampled behind, π_old else). A token is out of the band
    [1 − ε_low, 1 + ε_high] in its advantage's direction either because the anchor's gap alone
    already puts it there (π_old/θ_old: for a stale token anchored at its sampler, the lag *and* the
    training–inference mismatch, which no setting separates per token) or because the update moved
    π_θ there since π_old (N > 1 mini-batches). Shares of all response tokens, so that they merge
    over micro-batches and ranks like every other loss metric:

        loss/clip_frac_stale, loss/clip_frac_fresh        clipped tokens sampled behind / not (sum: clip_frac)
        loss/clip_frac_mismatch, loss/clip_frac_movement  clipped by π_old/θ_old alone / by π_θ/π_old (sum: clip_frac)
        loss/stale_frac                                   tokens sampled behind the trained weights
        loss/mismatch_out_of_band                         tokens whose π_old/μ is out of the band: what an
                                                          anchor at μ would clip before any update (at
                                                          k = 0 the precision gap alone: its floor)
        loss/mismatch_outside_10pct                       tokens whose π_old/μ is outside [0.9, 1.1], either
                                                          way, whatever the advantage: the sampler's bias
                                                          as TRL #7269 counts it (a cut the trainer does
                                                          not renormalize over puts most tokens there)

    Exactly the clipped tokens of the MiniRL and GRPO losses; CISPO clips no gradient (its weight is
    clamped instead): there the same shares say where the clamp binds in the advantage's direction.
    """
    mask = valid_mask(mask_BT, rollout_logp_BT) > 0
    n = float(mask.sum().clamp(min=1))
    a = adv_B[:, None]

    def out(log_ratio: torch.Tensor) -> torch.Tensor:  # clip_mask's own test, so the shares add up to its count
        r = torch.exp(log_ratio)
        return mask & (((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low)))

    clipped = out(logp_BT - anchor_BT)
    by_gap = clipped & out(old_logp_BT - anchor_BT)
    stale = (behind_BT > 0) & mask if behind_BT is not None else torch.zeros_like(mask)
    mu = torch.where(mask, rollout_logp_BT, old_logp_BT)
    share = lambda x: float(x.sum()) / n  # noqa: E731
    return {
        "loss/clip_frac_stale": share(clipped & stale),
        "loss/clip_frac_fresh": share(clipped & ~stale),
        "loss/clip_frac_mismatch": share(by_gap),
        "loss/clip_frac_movement": share(clipped & ~by_gap),
        "loss/stale_frac": share(stale),
        "loss/mismatch_out_of_band": share(out(old_logp_BT - mu)),
        "loss/mismatch_outside_10pct": share(mask & ((old_logp_BT - mu).exp() - 1).abs().gt(0.1)),
    }


def aggregate(tok_BT: torch.Tensor, mask_BT: torch.Tensor, *, length_norm: bool = False) -> torch.Tensor:
    """Reduce a per-token quantity to a scalar.

    MiniRL (default): Σ_t within each response, then the mean over the B responses that have a token
    to train (a row masked whole, an episode the environment's fault ended, is no response of the
    model: it neither adds nor dilutes).
    length_norm=True: (1/|y_i|) Σ_t first (GRPO-style; an ablation that scored lower, F2).
    """
    tokens_B = mask_BT.sum(dim=-1)
    per_resp_B = (tok_BT * mask_BT).sum(dim=-1)
    if length_norm:
        per_resp_B = per_resp_B / tokens_B.clamp(min=1.0)
    return per_resp_B.sum() / (tokens_B > 0).sum().clamp(min=1)


def minirl_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    tis_cap: float = 5.0,
    is_mode: ISMode = "truncate",
    length_norm: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """MiniRL (paper Eq. 7), to minimise:

        −J = −(1/B) Σ_i Σ_t M_t · sg[π_θ/μ_θold] · A_i · log π_θ(y_t | x, y_<t)
    """
    mask = valid_mask(mask_BT, rollout_logp_BT)
    rollout_logp = torch.where(mask > 0, rollout_logp_BT, logp_BT.detach())
    w = is_weight(logp_BT, rollout_logp, cap=tis_cap, mode=is_mode)
    m = clip_mask(logp_BT, old_logp_BT, adv_B, eps_low=eps_low, eps_high=eps_high)
    loss = -aggregate(m * w * adv_B[:, None] * logp_BT, mask, length_norm=length_norm)
    return loss, _ratio_metrics(logp_BT, old_logp_BT, rollout_logp, mask, w, m)


def grpo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO as the paper writes it (appendix), to minimise:

        −(1/G) Σ_i (1/|y_i|) Σ_t min(r_t A_i, clip(r_t, 1−ε_low, 1+ε_high) A_i),  r_t = π_θ/π_θold

    Pass std-scaled advantages (`group_advantages(..., std_scale=True)`). No correction of the
    training–inference discrepancy (μ is ignored except for metrics).
    """
    mask = valid_mask(mask_BT, rollout_logp_BT)
    r = torch.exp(logp_BT - old_logp_BT)
    a = adv_B[:, None]
    surr = torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
    loss = -aggregate(surr, mask, length_norm=True)
    with torch.no_grad():
        clipped = ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low))
    rollout_logp = torch.where(mask > 0, rollout_logp_BT, logp_BT.detach())
    return loss, _ratio_metrics(logp_BT, old_logp_BT, rollout_logp, mask, torch.ones_like(r), (~clipped).float())


def cispo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO as the paper writes it (appendix), to minimise:

        −(1/Σ_i |y_i|) Σ_i Σ_t sg[clip(r_t, 1−ε_low, 1+ε_high)] · A_i · log π_θ(y_t),  r_t = π_θ/π_θold
    """
    mask = valid_mask(mask_BT, rollout_logp_BT)
    with torch.no_grad():
        w = torch.clamp(torch.exp(logp_BT - old_logp_BT), 1 - eps_low, 1 + eps_high)
    loss = -(w * adv_B[:, None] * logp_BT * mask).sum() / mask.sum().clamp(min=1.0)
    rollout_logp = torch.where(mask > 0, rollout_logp_BT, logp_BT.detach())
    return loss, _ratio_metrics(logp_BT, old_logp_BT, rollout_logp, mask, w, torch.ones_like(w))


LOSSES = {"minirl": minirl_loss, "grpo": grpo_loss, "cispo": cispo_loss}


def policy_loss(name: LossName, *args: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch by recipe name (`loss.name`)."""
    return LOSSES[name](*args, **kwargs)


def train_inference_kl(rollout_logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """D_KL(μ_θold ‖ π_θold) estimated on sampled tokens: mean_t [log μ(y_t) − log π_old(y_t)]."""
    mask = valid_mask(mask_BT, rollout_logp_BT)
    diff = torch.where(mask > 0, rollout_logp_BT - old_logp_BT, torch.zeros_like(old_logp_BT))
    return float(diff.sum() / mask.sum().clamp(min=1.0))


def train_inference_kl_k3(rollout_logp_BT: torch.Tensor, logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """D_KL(μ ‖ π) on tokens sampled from μ with the k3 estimator: mean_t [(r − 1) − log r],
    r = π(y_t)/μ(y_t). Unbiased like the k1 mean of log μ − log π, but never negative per token and
    of far lower variance when μ ≈ π: at 1e-4 nats over ~10^3 tokens k1's noise is as large as
    the KL itself (`minirl doctor` uses k3; runs log the paper's k1)."""
    mask = valid_mask(mask_BT, rollout_logp_BT)
    log_r = torch.where(mask > 0, logp_BT - rollout_logp_BT, torch.zeros_like(logp_BT))
    k3 = torch.expm1(log_r) - log_r
    return float((k3 * mask).sum() / mask.sum().clamp(min=1.0))


def _ratio_metrics(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    w_BT: torch.Tensor,
    m_BT: torch.Tensor,
) -> dict[str, float]:
    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1.0)
        sel = mask_BT > 0
        w_sel = w_BT[sel]
        full_w = torch.exp(logp_BT - rollout_logp_BT)[sel]
        q = torch.tensor([0.5, 0.9, 0.99], device=full_w.device)
        qs = torch.quantile(full_w.float(), q) if full_w.numel() else torch.ones(3)
        return {
            "loss/is_weight_mean": float(w_sel.mean()) if w_sel.numel() else 1.0,
            "loss/is_weight_max": float(full_w.max()) if full_w.numel() else 1.0,
            "loss/is_weight_p50": float(qs[0]),
            "loss/is_weight_p90": float(qs[1]),
            "loss/is_weight_p99": float(qs[2]),
            "loss/clip_frac": float(((1 - m_BT) * mask_BT).sum() / n),
            "loss/ratio_mean": float((torch.exp(logp_BT - old_logp_BT) * mask_BT).sum() / n),
            "loss/tokens": float(n),
        }


@torch.no_grad()
def entropy_from_logits(logits_BTV: torch.Tensor, *, chunk_tokens: int = 4096, temperature: float = 1.0,
                        kept_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy H_t = −Σ_v p_v log p_v per position of the distribution the engine samples: p =
    softmax(logits / T) over the whole vocabulary, or over the sampler's kept set where it cut
    (`kept_BT` > 0: that many of the most likely tokens), [B, T], in float32 a chunk of positions at a
    time (never a whole fp32 copy of the logits)."""
    B, T, V = logits_BTV.shape
    x_NV = logits_BTV.reshape(B * T, V)
    kept_N = None if kept_BT is None else kept_BT.reshape(B * T)
    out = []
    for s in range(0, B * T, chunk_tokens):
        x = x_NV[s : s + chunk_tokens].float()
        x = x if temperature == 1.0 else x / temperature
        edge = None if kept_N is None else edge_of(x, kept_N[s : s + chunk_tokens])
        if edge is None:
            logp = torch.log_softmax(x, dim=-1)
            out.append(-(logp.exp() * logp).sum(dim=-1))
        else:  # 0 · log 0 = 0 outside the kept set
            logp = torch.log_softmax(x.masked_fill(x < edge, float("-inf")), dim=-1)
            p = logp.exp()
            out.append(-(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1))
    return torch.cat(out).view(B, T)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0))


__all__ = [
    "aggregate",
    "cispo_loss",
    "clip_causes",
    "clip_mask",
    "entropy_from_logits",
    "group_advantages",
    "grpo_loss",
    "is_weight",
    "masked_mean",
    "minirl_loss",
    "overlong_penalty",
    "policy_loss",
    "sampler_logp",
    "train_inference_kl",
    "valid_mask",
]


def sequence_rewards(scores: list[float], truncated: list[bool], truncated_reward: str) -> torch.Tensor:
    """R(x, y) per response. A response cut at the length limit is graded as written ("grade") or
    scores 0 whatever it says ("zero"); the recipe declares which (`loss.truncated_reward`)."""
    if truncated_reward == "zero":
        return torch.tensor([0.0 if cut else s for s, cut in zip(scores, truncated)])
    return torch.tensor(scores, dtype=torch.float32)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment R_length(y), added to R(x, y) per response: 0 while
    |y| ≤ L_max − L_cache, then −penalty · (|y| − (L_max − L_cache)) / L_cache, down to −penalty at
    |y| = L_max (L_max = rollout.max_tokens, L_cache = `buffer`; 0 turns it off). A long response is
    told it is long before it is cut, rather than only when cut (`truncated_reward`)."""
    if not buffer:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_tokens - buffer)).clamp(0, buffer)
    return -penalty * over / buffer


def minibatch_indices(B: int, G: int, N: int, *, seed: int) -> list[torch.Tensor]:
    """Split B prompts × G responses (rows grouped by prompt) into N mini-batches of whole groups,
    in a seeded random order. Every row lands in exactly one mini-batch."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).view(N, B // N)
    return [(prompts[:, None] * G + torch.arange(G)[None, :]).flatten() for prompts in order]


def loss_for(loss) -> Callable[[torch.Tensor, "Batch"], tuple[torch.Tensor, dict]]:
    """The recipe's policy loss (a `LossConfig`) as the trainer calls it: (log π_θ [B, T], batch)
    → (loss, metrics)."""
    kw = dict(eps_low=loss.eps_low, eps_high=loss.eps_high, tis_cap=loss.tis_cap, is_mode=loss.is_mode,
              length_norm=loss.length_norm)
    anchor_sampler = loss.clip_against == "sampler"

    def fn(logp_BT: torch.Tensor, b: "Batch"):
        # on-policy (N = 1) the batch has no π_θold yet: it is this forward's π_θ, held fixed
        old = b.old_logp_BT if b.old_logp_BT is not None else logp_BT.detach()
        # tokens sampled behind the trained weights: clipped against their sampler
        anchor = sampler_logp(old, b.rollout_logp_BT, b.behind_BT) if anchor_sampler else old
        value, m = policy_loss(loss.name, logp_BT, anchor, b.rollout_logp_BT, b.adv_B, b.mask_BT, **kw)
        m.update(clip_causes(logp_BT.detach(), old, anchor, b.rollout_logp_BT, b.adv_B, b.mask_BT, b.behind_BT,
                             eps_low=loss.eps_low, eps_high=loss.eps_high))
        return value, m

    return fn


def merge_metrics(parts: list[dict]) -> dict:
    """Micro-batch metrics as one: token-weighted means ("loss/tokens" is each part's count), max of maxima."""
    n = [p.get("loss/tokens", 1.0) for p in parts]
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k == "loss/tokens":
            out[k] = sum(vals)
        else:
            out[k] = sum(v * w for v, w in zip(vals, n)) / max(sum(n), 1e-12)
    return out
