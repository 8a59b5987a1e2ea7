"""One PNG per run: the curves people look at first (reward, entropy, KL, IS weights, clipping,
parity; staleness where the run samples ahead; turns and tool calls of a multi-turn run), with the guard's rollbacks (red dashed) and skipped updates (orange dotted) on every panel."""

from __future__ import annotations

import math
from pathlib import Path

from minirl.disk.store import metric_rows

PANELS = [
    ("rollout/reward_mean", "reward (mean over responses)"),
    ("train/entropy", "token entropy H(π_old)"),
    ("train/kl_mu_pi_old", "KL(μ_old ‖ π_old)"),
    ("loss/is_weight_max", "max IS weight π/μ"),
    ("loss/clip_frac", "clip fraction"),
    ("sync/parity_abs_dlogp", "|Δ log p| vLLM vs trainer after sync"),
]
# a run with rollout.max_staleness ≥ 1: how many updates behind each step's batch was, and who waited
STALENESS = ("rollout/staleness_mean", "staleness: updates behind (mean)")
IDLE = ("timing/engine_idle_frac", "idle share of the wall time: engine, trainer")
# a multi-turn run (env.name): engine calls and tool calls per episode
TURNS = ("episode/turns", "per episode: turns, tool calls")
IDLE_ALSO = {"timing/engine_idle_frac": ("timing/trainer_idle_frac", "trainer"),  # drawn on the same panel
             "episode/turns": ("episode/tool_calls", "tool calls")}


def plot_metrics(metrics_jsonl: Path, out_png: Path, *, upto: int | None = None) -> Path:
    """The figure of a run's metrics.jsonl (rows up to step `upto`, if given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = metric_rows(metrics_jsonl, upto=upto)
    marks = [(r["step"], "tab:red", "--", "rollback") for r in rows if r.get("guard/action") in ("rollback", "stop")]
    marks += [(r["step"], "tab:orange", ":", "skipped update") for r in rows if r.get("guard/action") == "skip"]
    panels = PANELS + [p for p in (STALENESS, IDLE, TURNS) if any(p[0] in r for r in rows)]
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(13 * cols / 3, 6.5), constrained_layout=True)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if pts:
            ax.plot(*zip(*pts), lw=1.2, label=("turns" if key == TURNS[0] else "engine") if key in IDLE_ALSO else None)
        if key in IDLE_ALSO:
            other, label = IDLE_ALSO[key]
            if more := [(r["step"], r[other]) for r in rows if isinstance(r.get(other), (int, float))]:
                ax.plot(*zip(*more), lw=1.2, label=label)
            ax.legend(fontsize=8)
        if key == "rollout/reward_mean":  # held-out scores of eval.every, on the same scale
            for hk in sorted({k for r in rows for k in r if k.startswith("heldout/avg@")}):
                hpts = [(r["step"], r[hk]) for r in rows if isinstance(r.get(hk), (int, float))]
                ax.plot(*zip(*hpts), "o-", color="tab:green", ms=3, lw=1.0, label=f"held-out {hk.split('/')[1]}")
                ax.legend(fontsize=8)
        for step, color, style, label in marks:
            ax.axvline(step, color=color, ls=style, lw=1.0, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if marks:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        axes.flat[0].legend(unique.values(), unique.keys(), fontsize=8)
    fig.suptitle(f"minirl run: {Path(metrics_jsonl).parent.name}")
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
