"""The figure of a `tests/bench/speed.py --record` file: held-out score against RL wall time and against steps.

    .venv/bin/python tests/bench/speed_plot.py RECORD.json OUT.png

speed.py draws it itself with `--plot OUT.png`; this redraws it from the record alone. Each run is a thin
line (minirl's blue, TRL's orange), each side's median over runs at every step it scored a thick one; the
target is a dashed line, and each side's median RL time to it a dotted one. The left panel is what the ratio
in speed.md measures (time); the right one shows whether the two sides learn as much per step, so that a gap
on the left is the step's speed and not the recipe's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from speed import to_target  # tests/bench/speed.py, beside this file: the RL seconds of a run's first score ≥ target

SIDES = (("minirl", "tab:blue", "minirl"), ("trl", "tab:orange", "TRL GRPOTrainer"))


def median_curve(runs: list[dict]) -> tuple[list, list, list]:
    """At each step every run scored, the median over runs of its RL seconds and of its score."""
    common = set.intersection(*({point[0] for point in r["curve"]} for r in runs))
    at = [{point[0]: point for point in r["curve"]} for r in runs]
    steps = sorted(common)
    seconds = [statistics.median(a[s][1] for a in at) for s in steps]
    return steps, seconds, [statistics.median(a[s][2] for a in at) for s in steps]


def draw(record: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = record["target"]
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    last_steps = []  # each side's longest run
    for side, color, label in SIDES:
        runs = [r for r in record["runs"] if r["side"] == side]
        if runs:
            last_steps.append(max(r["curve"][-1][0] for r in runs))
        for r in runs:
            steps, seconds, score = zip(*r["curve"])
            by_time.plot(seconds, score, color=color, alpha=0.25, linewidth=0.8)
            by_step.plot(steps, score, color=color, alpha=0.25, linewidth=0.8)
        if runs:
            steps, seconds, score = median_curve(runs)
            seeds = f"{len(runs)} seed{'s' * (len(runs) > 1)}"
            kw = {"color": color, "linewidth": 2, "label": f"{label}: median of {seeds}"}
            by_time.plot(seconds, score, **kw)
            by_step.plot(steps, score, **kw)
        reached = [to_target(r, target) for r in runs]
        if runs and None not in reached:
            median = statistics.median(reached)
            by_time.axvline(median, color=color, linestyle=":", linewidth=1.5)
            by_time.annotate(f"{median:.0f} s", (median, 0.02), xycoords=("data", "axes fraction"), color=color,
                             xytext=(3, 0), textcoords="offset points")
    # by step, over the steps both sides ran: the faster side's longer tail would squeeze where they compare
    by_step.set_xlim(0, min(last_steps))
    for ax, xlabel in ((by_time, "RL wall time (s; held-out scoring excluded)"), (by_step, "RL steps")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_time.set_ylabel(f"held-out {record['metric']}")
    by_time.legend(loc="center right")  # the medians' time labels sit at the bottom
    by_time.set_title(f"to held-out {target} in time (dotted: each side's median)", fontsize=10)
    by_step.set_title("the same runs by step, over the steps both sides ran", fontsize=10)
    fig.suptitle(f"minirl against TRL's GRPOTrainer on the embedded default ({record['commit']})\n{record['host']}",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: speed_plot.py RECORD.json OUT.png")
    print(draw(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))


if __name__ == "__main__":
    main()
