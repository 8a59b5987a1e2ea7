"""`minirl lab STUDY`: one study per question of the paper, its arms run over K paired seeds, its
verdicts computed by the rules of verdicts.py, fixed before any run.

    is          F1, F3: MiniRL against "without IS", R3 against R3 without IS; a placebo pair
                with fp32 rollouts (μ = π up to kernels: the two are one algorithm there)
    offpolicy   F4, F5: N = 4 mini-batches of 16 prompts (the on-policy batch's size): no clip,
                clip, clip + R2, clip + R3, and R2 / R3 without clipping
    lengthnorm  F2: MiniRL against MiniRL with length normalisation
    coldstart   F6: MiniRL from cold starts stopped at two dev accuracies

Pairing: seed i of every arm uses `train.seed = i`, so it draws the same prompts in the same
order and the same sampling seeds; arms run seed by seed (every arm's seed 0, then seed 1, …), so
an interrupted study still holds whole pairs. One run at a time, resumable (lab.Lab's state).
The verdicts name their test, effect, interval and p-value, or the seeds' power to have seen the
paper's effect (verdicts.verdict).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minirl import atomic
from minirl import verdicts as v
from minirl.lab import NO_CLIP, NO_IS, Cell, Lab, Plan, rows_of


@dataclass(frozen=True)
class Comparison:
    finding: str
    claim: str  # the paper's, in one line
    a: str  # arm names: the effect is B − A
    b: str
    kind: str  # "collapse": Fisher on collapse rates (and log-rank on time); "score": paired held-out scores
    sign: int  # the paper's direction of B − A: +1, −1, or 0 for a placebo (no difference expected)
    expect: tuple[float, float] = (0.0, 0.8)  # collapse rates (A, B) the paper's claim implies, for power
    effect: float = 0.1  # the score difference the power is stated for


@dataclass(frozen=True)
class Study:
    name: str
    question: str
    arms: tuple[tuple[str, tuple[str, ...], float], ...]  # (name, recipe sets, cold start's dev accuracy or 0)
    comparisons: tuple[Comparison, ...]
    steps: int = 150
    quick_steps: int = 20


OFF = ("train.minibatches=4", "train.prompts_per_step=64")  # N = 4 mini-batches of 16 prompts
STUDIES = {s.name: s for s in [
    Study("is", "does the token IS correction keep on-policy training stable (F1, F3)?",
          arms=(("MiniRL", (), 0.0), ("w/o IS", NO_IS, 0.0), ("R3", ("train.replay=r3",), 0.0),
                ("R3 w/o IS", ("train.replay=r3", *NO_IS), 0.0),
                ("placebo: MiniRL, fp32 rollouts", ("rollout.precision=fp32",), 0.0),
                ("placebo: w/o IS, fp32 rollouts", ("rollout.precision=fp32", *NO_IS), 0.0)),
          comparisons=(
              Comparison("F1", "without IS correction on-policy training collapses", "MiniRL", "w/o IS", "collapse", 1),
              Comparison("F1", "MiniRL ends higher than without IS", "w/o IS", "MiniRL", "score", 1),
              Comparison("F3", "R3 without IS collapses", "R3", "R3 w/o IS", "collapse", 1),
              Comparison("F3", "R3 brings no gain on-policy", "MiniRL", "R3", "score", 0),
              Comparison("placebo", "fp32 rollouts: MiniRL and w/o IS are one algorithm",
                         "placebo: MiniRL, fp32 rollouts", "placebo: w/o IS, fp32 rollouts", "score", 0))),
    Study("offpolicy", "does off-policy training need clipping and routing replay (F4, F5)?",
          arms=(("no clip", (*OFF, *NO_CLIP), 0.0), ("clip", OFF, 0.0), ("clip + R2", (*OFF, "train.replay=r2"), 0.0),
                ("clip + R3", (*OFF, "train.replay=r3"), 0.0), ("R2, no clip", (*OFF, *NO_CLIP, "train.replay=r2"), 0.0),
                ("R3, no clip", (*OFF, *NO_CLIP, "train.replay=r3"), 0.0)),
          comparisons=(
              Comparison("F4", "without clipping off-policy training collapses", "clip", "no clip", "collapse", 1),
              Comparison("F4", "replay without clipping does not save it", "clip + R3", "R3, no clip", "collapse", 1),
              Comparison("F5", "at N = 4, R3 ends higher than R2", "clip + R2", "clip + R3", "score", 1))),
    Study("lengthnorm", "does length normalisation cost accuracy (F2)?",
          arms=(("MiniRL", (), 0.0), ("length norm", ("loss.length_norm=true",), 0.0)),
          comparisons=(Comparison("F2", "length normalisation ends lower", "MiniRL", "length norm", "score", -1),)),
    Study("coldstart", "do different cold starts end alike (F6)?",
          arms=(("cold start @10%", (), 0.1), ("cold start @40%", (), 0.4)),
          comparisons=(Comparison("F6", "cold starts end alike", "cold start @10%", "cold start @40%", "score", 0),)),
]}


def plan(study: Study, *, seeds: int, quick: bool) -> Plan:
    """The study's arms as cells of a lab plan (one folder per study: runs are never shared)."""
    cells = [Cell(f"study {study.name}", name, sets, cold_start=acc) for name, sets, acc in study.arms]
    steps = study.quick_steps if quick else study.steps
    return Plan(steps=steps, eval_every=max(5, steps // 6), seeds=seeds, offpolicy_n=(4,), cold_start_targets=(),
                cells=cells)


def run(lab: Lab, study: Study, p: Plan, *, on_run: Callable[[str, int, int], None] = lambda *a: None,
        progress: Callable[[str], None] = lambda s: None) -> None:
    """Every arm's seed 0, then every arm's seed 1, …: pairs complete in order."""
    todo = [(c, s) for s in range(p.seeds) for c in p.cells]
    for i, (cell, seed) in enumerate(todo):
        on_run(f"{study.name}: {cell.variant} (seed {seed})", i, len(todo))
        lab.run_cell(cell, seed, p, progress=progress)
    on_run("done", len(todo), len(todo))


def arm_results(lab: Lab, p: Plan) -> dict[str, list[dict]]:
    """Per arm, per seed run so far: collapse step (verdicts.collapse_step), held-out start and end."""
    out: dict[str, list[dict]] = {}
    for c in p.cells:
        for s in range(p.seeds):
            key = f"{c.id}/s{s}"
            if key not in lab.state["runs"]:
                continue
            run = Path(lab.state["runs"][key])
            summary = json.loads((run / "summary.json").read_text())
            metric = summary["heldout"]["metric"]
            start, end = summary["heldout"]["start"][metric], summary["heldout"]["end"][metric]
            rows = rows_of(run)
            out.setdefault(c.variant, []).append({
                "seed": s, "collapse": v.collapse_step(rows, heldout_start=start), "start": start, "final": end,
                "steps": rows[-1]["step"] if rows else 0, "rows": rows})
    return out


def decide(study: Study, res: dict[str, list[dict]]) -> list[tuple[Comparison, str]]:
    """Each comparison's verdict on the seeds both arms have (paired by seed)."""
    out = []
    for cmp in study.comparisons:
        a, b = ({r["seed"]: r for r in res.get(arm, [])} for arm in (cmp.a, cmp.b))
        seeds = sorted(a.keys() & b.keys())
        if not seeds:
            out.append((cmp, "not run yet"))
            continue
        n = len(seeds)
        if cmp.kind == "collapse":
            ca, cb = [a[s]["collapse"] is not None for s in seeds], [b[s]["collapse"] is not None for s in seeds]
            evidence = v.collapse_rates(ca, cb)
            steps = max(max(a[s]["steps"], b[s]["steps"]) for s in seeds)
            timing = v.time_to_collapse([a[s]["collapse"] for s in seeds], [b[s]["collapse"] for s in seeds],
                                        steps=steps)
            text = v.verdict(evidence, claim_sign=cmp.sign, power=v.power_collapse(n, *cmp.expect))
            text += f"; time to collapse: {timing.text()} (log-rank)"
        else:
            fa, fb = [a[s]["final"] for s in seeds], [b[s]["final"] for s in seeds]
            evidence = v.paired_scores(fa, fb)
            sd = statistics.stdev(y - x for x, y in zip(fa, fb)) if n > 1 else math.inf
            text = v.verdict(evidence, claim_sign=cmp.sign, power=v.power_paired(n, cmp.effect, sd),
                             placebo=cmp.finding == "placebo")
        out.append((cmp, text))
    return out


PANELS = (("rollout/reward_mean", "reward"), ("train/entropy", "token entropy"),
          ("train/kl_mu_pi_old", "KL(μ_old ‖ π_old)"), ("heldout", "held-out avg@k"))


def plot(study: Study, res: dict[str, list[dict]], out: Path) -> Path:
    """The study at a glance: reward, entropy, KL(μ_old‖π_old) and held-out per arm (mean over
    seeds, min–max band), and the share of each arm's seeds not yet collapsed (survival)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 4.0), constrained_layout=True)
    for arm, runs in res.items():
        color = None
        for ax, (key, _) in zip(axes, PANELS):
            if key == "heldout":
                series = [[(0, r["start"])] + [(x["step"], x[h]) for x in r["rows"] for h in x if h.startswith("heldout/avg@")]
                          for r in runs]
            else:
                series = [[(x["step"], x[key]) for x in r["rows"]] for r in runs]
            n = min(len(s) for s in series)
            if n == 0:
                continue
            steps = [t for t, _ in series[0][:n]]
            vals = [[s[i][1] for s in series] for i in range(n)]
            line, = ax.plot(steps, [sum(v) / len(v) for v in vals], lw=1.3, label=arm, color=color)
            color = line.get_color()
            if len(series) > 1:
                ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15)
        last = max((r["steps"] for r in runs), default=0)
        grid = range(0, last + 1)
        alive = [sum(r["collapse"] is None or r["collapse"] > t for r in runs) / len(runs) for t in grid]
        axes[-1].step(list(grid), alive, where="post", color=color, lw=1.3, label=arm)
    for ax, title in zip(axes, [t for _, t in PANELS] + ["not collapsed (share of seeds)"]):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[-1].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"minirl lab {study.name}: {study.question}")
    path = out / f"study-{study.name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(study: Study, p: Plan, res: dict[str, list[dict]], out: Path) -> Path:
    lines = [f"# minirl lab {study.name}", "", f"{study.question}", "",
             f"{len(p.cells)} arms × {p.seeds} paired seed(s), {p.steps} steps each, the guard observing only; "
             f"held-out avg@k every {p.eval_every} steps. Collapsed: the rule of `minirl/verdicts.py` (reward under "
             f"{v.COLLAPSE_REWARD_FRAC} × its best window with the entropy out of [{v.ENTROPY_LOW}, {v.ENTROPY_HIGH}] × "
             f"its start, or held-out under {v.COLLAPSE_HELDOUT_FRAC} × its start). α = {v.ALPHA}.", "",
             "## Verdicts", "", "| | the paper | B − A | verdict |", "|---|---|---|---|"]
    for cmp, text in decide(study, res):
        lines.append(f"| {cmp.finding} | {cmp.claim} | {cmp.b} − {cmp.a} | {text} |")
    lines += ["", "## Arms", "", "| arm | seeds | collapsed | held-out start | final (per seed) |", "|---|---|---|---|---|"]
    for c in p.cells:
        runs = res.get(c.variant, [])
        if runs:
            finals = ", ".join(f"{r['final']:.3f}" for r in runs)
            lines.append(f"| {c.variant} | {len(runs)} | {sum(r['collapse'] is not None for r in runs)}/{len(runs)} | "
                         f"{sum(r['start'] for r in runs) / len(runs):.3f} | {finals} |")
    if res:
        lines += ["", "## Figure", "", f"![the study]({plot(study, res, out).name})"]
    path = out / "report.md"
    atomic.write_text(path, "\n".join(lines) + "\n")
    return path
