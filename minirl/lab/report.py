"""A study's report: its figures (trajectories per arm, the dose–response over the dial) and
report.md, with the mechanism measured, the verdicts, the lr choice and the stages that followed.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from minirl.disk import atomic
from minirl.lab import rescore
from minirl.lab import verdicts as v
from minirl.lab.runner import NO_CLIP
from minirl.lab.stages import lr_lines, lr_source
from minirl.lab.studies import (DIAL, LR_STUDY, MECHANISM_TARGET, STUDIES, Study, StudyPlan, decide, runs_summary,
                                study_level)


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


def plot_dose(study: Study, res: dict[str, dict[str, list[dict]]], mech: dict, out: Path) -> Path | None:
    """Final held-out score and collapse rate per arm against the dial, each level placed at its
    measured per-response spread of log π(y)/μ(y)."""
    levels = [lvl for lvl in DIAL if lvl in res]
    if len(levels) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = {lvl: mech["levels"][lvl]["sd"] for lvl in levels}
    fig, (score, fell) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    names = [a for a in dict.fromkeys(a for lvl in levels for a in res[lvl]) if sum(a in res[lvl] for lvl in levels) > 1]
    for name in names:  # the arms the dial moves (not the placebo's fixed fp32)
        pts = [(x[lvl], res[lvl][name]) for lvl in levels if name in res[lvl]]
        xs = [px for px, _ in pts]
        mean = [statistics.fmean(r["final"] for r in runs) for _, runs in pts]
        low = [m - min(r["final"] for r in runs) for m, (_, runs) in zip(mean, pts)]
        high = [max(r["final"] for r in runs) - m for m, (_, runs) in zip(mean, pts)]
        line = score.errorbar(xs, mean, yerr=[low, high], marker="o", capsize=3, lw=1.3, label=name)
        fell.plot(xs, [sum(r["collapse"] is not None for r in runs) / len(runs) for _, runs in pts], marker="o",
                  lw=1.3, color=line[0].get_color(), label=name)
    for ax, title in ((score, "final held-out (mean, min–max over seeds)"), (fell, "collapse rate")):
        ax.set_xscale("log")
        # slanted: levels whose spreads lie close (fp8-weights 0.37, fp8 0.41) would print over each other
        ax.set_xticks([x[lvl] for lvl in levels], [f"{lvl} ({x[lvl]:.2f})" for lvl in levels], fontsize=8,
                      rotation=30, ha="right")
        ax.minorticks_off()
        ax.axvline(MECHANISM_TARGET, color="grey", ls=":", lw=1)
        ax.set_xlabel("dial level: SD of log π(y)/μ(y) per response at the cold start")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fell.set_ylim(-0.05, 1.05)
    score.legend(fontsize=7)
    fig.suptitle(f"minirl lab {study.name}: dose–response")
    path = out / f"study-{study.name}-dose.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def staleness_lines(study: Study, arms: dict[str, list[dict]]) -> list[str]:
    """How far the policy moved within a step's N updates, in the arms that clip: the fraction of
    tokens clipped (M_t = 0) on each mini-batch, mean over steps and seeds. Mini-batch 1 is
    on-policy to π_old (r_t = 1); the last has N − 1 updates behind it. Where it stays near 0 the
    clip seldom binds and "no clip" is nearly the algorithm "clip" is: the drift F4 is about is small."""
    clips = {name for name, sets, _ in study.arms if not set(NO_CLIP) <= set(sets)}
    table = {}
    for name, runs in arms.items():
        if name not in clips:
            continue
        per_mb = [r["loss/clip_frac_per_mb"] for run in runs for r in run["rows"]
                  if len(r.get("loss/clip_frac_per_mb", [])) > 1]
        if per_mb:
            table[name] = [statistics.fmean(x) for x in zip(*per_mb)]
    if not table:
        return []
    n = max(len(x) for x in table.values())
    return ["## How off-policy the updates were", "",
            "Tokens clipped (M_t = 0) per mini-batch of a step, mean over steps and seeds, in the arms that clip "
            "(ε_low, ε_high of the recipe): mini-batch 1 is π_old itself; the last has N − 1 updates behind it. "
            "Near 0 the clip seldom binds, and removing it can change little.", "",
            "| arm | " + " | ".join(f"mini-batch {i + 1}" for i in range(n)) + " |", "|---" * (n + 1) + "|",
            *(f"| {name} | " + " | ".join(f"{x:.2e}" for x in fr) + " |" for name, fr in table.items()), ""]


def mechanism_lines(mech: dict | None, level: tuple[str, str] | None = None) -> list[str]:
    """The dial as measured before any arm ran, and how the study's level (`level`: the level and
    why, study_level; default the dial's) was chosen."""
    if mech is None:
        return ["## The mismatch dial", "", "Not measured yet: the study measures it before its first run."]
    lines = ["## The mismatch dial, measured before any arm ran", "",
             f"`minirl doctor --checkpoint coldstart --seeds {mech['seeds']}` at {mech['measured_at']} "
             f"(`{Path(mech['doctor']).name}`): per token KL(μ‖π), per response the SD of log π(y)/μ(y) over "
             f"responses of L tokens, and the √(2·L·KL) a sum of independent tokens predicts.", "",
             "| rollout precision | KL(μ‖π) per token | SD of log π(y)/μ(y) per response | √(2·L·KL) | L | "
             "tokens with a route flip |", "|---|---|---|---|---|---|"]
    chosen, why = level or (mech["level"], mech["why"])
    for lvl, m in mech["levels"].items():
        mark = " (the study's level)" if lvl == chosen else ""
        flips = "—" if m.get("route_flips") is None else f"{m['route_flips']:.1%}"
        lines.append(f"| {lvl}{mark} | {m['kl']:.2e} ± {m['kl_spread']:.1e} | {m['sd']:.3f} ± {m['sd_spread']:.2f} | "
                     f"{m['predicted']:.2f} | {m['length']:.1f} | {flips} |")
    lines += ["", f"Level: **{chosen}**, {why} (the dial's target: {MECHANISM_TARGET:g}; the paper's long "
              f"responses: 4.5–8)."]
    if mech.get("route_flips") is not None:
        lines.append(f"Routes (top-k experts) differ between engine and trainer on {mech['route_flips']:.1%} of "
                     f"tokens per layer at the workspace's own precision; a token has a route flip when its top-k "
                     f"differs in any layer (the miniature's target: ≥ 30% of response tokens).")
    return lines


def _prompted_by(declared: dict) -> str:
    if declared["from"]:
        return f"after the first stage's dose–response (`{declared['from']}`)"
    return ("with no first stage in this workspace (its dial measured for this follow-up, as a first stage would "
            "measure it; what prompted the test is on the results page)")


def _chosen_arms(declared: dict) -> str:
    return f" ({', '.join(declared['arms'])}, chosen before its first run)" if declared.get("arms") else ""


def write_report(study: Study, sp: StudyPlan, res: dict[str, dict[str, list[dict]]], mech: dict | None,
                 out: Path, *, confirmation: dict | None = None, follow_up: dict | None = None,
                 lr_choice: dict | None = None, rescored: tuple[str, dict[str, dict]] | None = None,
                 temperature: float | None = None) -> Path:
    """report.md of a study (or of its confirmation stage or a follow-up, `confirmation` or
    `follow_up` its declaration); `lr_choice`: the workspace's lr study's (chosen_lr); `rescored`:
    a precision and the runs' last checkpoints scored at it (rescore.rescore), if asked for;
    `temperature`: the workspace's rollout.temperature, which every run samples at."""
    p, here = sp.plan, res.get(sp.level, {})
    lrs = sorted({r["lr"] for arms in res.values() for runs in arms.values() for r in runs})
    stage = ": confirmation stage" if confirmation else f": follow-up at {follow_up['level']}" if follow_up else ""
    lines = [f"# minirl lab {study.name}{stage}", "", f"{study.question}", ""]
    if follow_up:
        lines += ["## Declared before its first run", "",
                  f"At {follow_up['declared_at']}, {_prompted_by(follow_up)}: "
                  f"the study's arms{_chosen_arms(follow_up)} at {follow_up['level']} on {follow_up['seeds']} "
                  f"fresh seeds per arm (train.seed "
                  f"{follow_up['first_seed']} on), decided on those alone: the dose–response's own seeds prompted "
                  f"the test and are not counted in it.", ""]
    if confirmation:
        lines += ["## Declared before its first run", "",
                  f"At {confirmation['declared_at']}, from the first stage's report (`{confirmation['from']}`): "
                  f"these comparisons were not observed for want of power, and {confirmation['seeds']} fresh seeds "
                  f"per arm (train.seed {confirmation['first_seed']} on) give the most demanding of them power {v.POWER:g} "
                  f"at the first stage's own spread. They are decided on the fresh seeds alone: the first stage "
                  f"only sized this one (pooling would look twice at α = {v.ALPHA}). A comparison reproduced here "
                  f"after failing there has had two tries: over both stages its chance of a false positive is at "
                  f"most {v.ALPHA + (1 - v.ALPHA) * v.ALPHA:.4g}.", "",
                  *(f"- {line}" for line in confirmation["why"]), ""]
    whole = STUDIES.get(study.name)
    some = (f" (of its {len(whole.arms)}, chosen with --arm before the first run)"
            if whole and len(study.arms) < len(whole.arms) and not (follow_up or confirmation) else "")
    sampled = f", sampled at T = {temperature:g} (rollout.temperature)" if temperature is not None else ""
    lines += [f"{len(study.arms)} arms{some} × {max(a.seeds for a in sp.arms)} paired seed(s) at the study's level, "
             f"{p.steps} steps each{sampled}, the guard observing only; held-out avg@k every {p.eval_every} steps; "
             f"{lr_source(study, lr_choice, lrs)}. Final held-out score: {v.ENDPOINTS[sp.endpoint]}"
             f"{' (declared before the late-third endpoint existed)' if sp.endpoint == 'last' else ''}. "
             f"Collapsed: the rule of `minirl/lab/verdicts.py` (reward under "
             f"{v.COLLAPSE_REWARD_FRAC} × its best window with the entropy out of [{v.ENTROPY_LOW}, {v.ENTROPY_HIGH}] × "
             f"its start, or held-out under {v.COLLAPSE_HELDOUT_FRAC} × its start). α = {v.ALPHA}.", "",
             *mechanism_lines(mech, study_level(study, mech) if mech else None), ""]
    if study.name == LR_STUDY:  # a choice, not a finding: no comparisons
        lines += lr_lines(here)
    else:
        lines += [f"## Verdicts at {sp.level}", "", "| | the paper | B − A | verdict |", "|---|---|---|---|"]
        lines += [f"| {cmp.finding} | {cmp.claim} | {cmp.b} − {cmp.a} | {text} |" for cmp, text, _ in decide(study, here)]
    lines += ["", f"## Arms at {sp.level}", "", "| arm | seeds | collapsed | held-out start | final (per seed) |",
              "|---|---|---|---|---|"]
    for name, runs in here.items():
        finals = ", ".join(f"{r['final']:.3f}" for r in runs)
        lines.append(f"| {name} | {len(runs)} | {sum(r['collapse'] is not None for r in runs)}/{len(runs)} | "
                     f"{statistics.fmean(r['start'] for r in runs):.3f} | {finals} |")
    if study.dose:
        levels = [lvl for lvl in DIAL if lvl in res]
        names = [a.name for a in sp.arms if not a.primary]
        lines += ["", "## Dose–response", "", "Final held-out per arm and level: mean [min, max] over seeds, and "
                  "collapses.", ""]
        if len(levels) < 2:
            lines.append("Not run yet: the other levels run after the study's own.")
        else:
            heads = [f"{lvl} (SD {mech['levels'][lvl]['sd']:.2f})" if mech and lvl in mech["levels"] else lvl
                     for lvl in levels]  # each level's measured per-response spread: the dose
            lines += ["| arm | " + " | ".join(heads) + " |", "|---" * (len(levels) + 1) + "|"]
            for name in dict.fromkeys(names):
                lines.append(f"| {name} | " + " | ".join(runs_summary(res[lvl][name]) if name in res[lvl] else "—"
                                                      for lvl in levels) + " |")
            dose_png = plot_dose(study, res, mech, out) if mech else None
            if dose_png:
                lines += ["", f"![dose–response]({dose_png.name})"]
    if stale := staleness_lines(study, here):
        lines += ["", *stale]
    if rescored and study.name != LR_STUDY:
        lines += ["", *rescore.report_lines(study.comparisons, sp.level, here, rescored[1], rescored[0])]
        if png := rescore.plot(here, rescored[1], sp.level, rescored[0], out, f"study-{study.name}"):
            lines += ["", f"![served at {rescored[0]}]({png.name})"]
    if here:
        lines += ["", "## Figure", "", f"![the study]({plot(study, here, out).name})"]
    path = out / "report.md"
    atomic.write_text(path, "\n".join(lines) + "\n")
    return path
