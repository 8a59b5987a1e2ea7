"""One PNG per run: the curves people look at first (reward, entropy, KL, IS weights, clipping, parity)."""

from __future__ import annotations

import json
import math
from pathlib import Path

PANELS = [
    ("rollout/acc", "train accuracy"),
    ("train/entropy", "token entropy H(π_old)"),
    ("train/kl_mu_pi_old", "KL(μ_old ‖ π_old)"),
    ("loss/is_weight_max", "max IS weight π/μ"),
    ("loss/clip_frac", "clip fraction"),
    ("sync/parity_abs_dlogp", "|Δ log p| vLLM vs trainer after sync"),
]


def plot_metrics(metrics_jsonl: Path, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if pts:
            ax.plot(*zip(*pts), lw=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"minirl run: {Path(metrics_jsonl).parent.name}")
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
