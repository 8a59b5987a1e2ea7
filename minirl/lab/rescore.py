"""A study's last checkpoints served again at another rollout precision (`minirl lab STUDY --rescore P`).

A run's held-out score is measured by its own rollout engine: the policy μ that engine serves, not
the trainer's π. Two arms can part there because one learned the policy its engine serves and the
other the trainer's: without IS the gradient takes the engine's samples as the trainer's own, so it
climbs μ's reward; with IS it climbs π's. At fp32 the engine serves π itself (KL(μ‖π) ~1e-13), so
every run's last checkpoint evaluated there says which arm learned the better policy, whatever
serves it later. Exploratory: chosen after a study's runs, so it never changes a verdict.

Each evaluation is `minirl eval heldout` in a process of its own (an engine's memory ends with it),
with the workspace recipe's sampling seed for every run, so paired arms share their random numbers.
Scores go to `rescore/PRECISION.json` beside the study's state, one writer at a time; an evaluation
recorded there for the same run is never redone, so an interrupted rescore resumes.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from minirl.disk import atomic
from minirl.disk.store import complete_checkpoints
from minirl.lab import verdicts as v
from minirl.run.runlock import RunLock

if TYPE_CHECKING:
    from minirl.lab.runner import Lab


def rescore(lab: Lab, runs: dict[str, Path], precision: str, *,
            on_run: Callable[[str, int, int], None] = lambda *a: None) -> dict[str, dict]:
    """Each run's last checkpoint scored on the held-out split with `precision` rollouts; `runs`:
    the study's run keys and folders. Returns every score recorded, by key."""
    folder = lab.out / "rescore"
    path = folder / f"{precision}.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    todo = [(k, Path(r)) for k, r in runs.items() if done.get(k, {}).get("run") != str(r)]
    if not todo:
        return done
    lock = RunLock(folder, what="lab rescore")
    for i, (key, run) in enumerate(todo):
        on_run(f"rescore at {precision}: {key}", i, len(todo))
        ckpts = complete_checkpoints(run)
        if not ckpts:
            raise RuntimeError(f"lab rescore: {run} has no finished checkpoint to evaluate")
        log = folder / "logs" / f"{precision}-{key.replace('/', '-').replace(' ', '_')}.log"
        t0 = time.time()
        child = lab.minirl(["eval", "heldout", "-w", str(lab.ws_root), "--checkpoint", str(ckpts[-1]),
                            "--set", f"rollout.precision={precision}"], log)
        result = _result(lab.ws_root / "evals", ckpts[-1], precision, since=t0)
        if child.returncode != 0 or result is None:
            raise RuntimeError(f"lab rescore of {key} failed (exit {child.returncode}); see {log}")
        metric = f"avg@{result['k']}"
        done[key] = {"run": str(run), "checkpoint": ckpts[-1].name, "metric": metric, "score": result[metric],
                     "file": result["results_file"]}
        atomic.write_text(path, json.dumps(done, indent=1))
    on_run("done", len(todo), len(todo))
    lock.release()
    return done


def _result(evals: Path, checkpoint: Path, precision: str, *, since: float) -> dict | None:
    """The results `minirl eval` wrote for `checkpoint` at `precision` after `since` (its file is
    named by a hash of its settings: found by what it records, not by rebuilding the name)."""
    found = []
    for f in evals.glob("heldout-*.json"):
        if f.stat().st_mtime < since:
            continue
        d = json.loads(f.read_text())
        if Path(d["checkpoint"]).resolve().is_relative_to(checkpoint.resolve()) and d["rollout_precision"] == precision:
            found.append((f.stat().st_mtime, d))
    return max(found, key=lambda x: x[0])[1] if found else None


def _pairs(here: dict[str, list[dict]], scores: dict[str, dict]) -> dict[str, dict[int, tuple[float, float]]]:
    """Per arm, per rescored seed: (the own engine's last evaluation, the rescored score)."""
    out = {}
    for name, runs in here.items():
        if got := {r["seed"]: (r["last"], scores[r["key"]]["score"]) for r in runs if r["key"] in scores}:
            out[name] = got
    return out


def plot(here: dict[str, list[dict]], scores: dict[str, dict], level: str, precision: str, out: Path,
         name: str) -> Path | None:
    """Each rescored run as a line from its own engine's score to the rescored one, per arm, with
    the arm's mean drawn thick: where arms part on one engine and meet on the other."""
    pairs = _pairs(here, scores)
    if not pairs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 4.2), constrained_layout=True)
    for i, (arm, got) in enumerate(pairs.items()):
        color, dx = f"C{i}", 0.04 * (i - (len(pairs) - 1) / 2)  # arms side by side, not on top
        for own, at in got.values():
            ax.plot([dx, 1 + dx], [own, at], color=color, lw=0.8, alpha=0.5, marker="o", ms=3)
        means = [statistics.fmean(x[j] for x in got.values()) for j in (0, 1)]
        ax.plot([dx, 1 + dx], means, color=color, lw=2.5, label=f"{arm} (mean of {len(got)})")
    ax.set_xticks([0, 1], [f"own engine ({level})", f"served at {precision}"])
    ax.set_xlim(-0.3, 1.3)
    ax.set_ylabel("held-out score of the last checkpoint")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("the same checkpoints, two engines", fontsize=10)
    path = out / f"{name}-rescore-{precision}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report_lines(comparisons, level: str, here: dict[str, list[dict]], scores: dict[str, dict],
                 precision: str) -> list[str]:
    """The report's exploratory section: per arm the last held-out score its own engine gave and
    the same checkpoint's at `precision`; per score comparison of the study, the paired difference
    on each. `here`: the arms' runs at the study's level (studies.arm_results, with their keys)."""
    lines = [f"## Exploratory: the last checkpoints served at {precision}", "",
             f"Each run's last checkpoint evaluated again on the held-out split with {precision} rollouts "
             f"(`minirl lab … --rescore {precision}`: `minirl eval heldout --set rollout.precision={precision}`, "
             f"one sampling seed for every run), beside the last evaluation its own engine ({level}) gave at that "
             f"step. A run's own score is the policy its engine serves; at fp32 the engine serves the trainer's "
             f"π itself. Chosen after the runs: exploratory, p-values unadjusted, never a verdict.", "",
             f"| arm | seeds | last held-out, own engine | at {precision} | {precision} − own |", "|---|---|---|---|---|"]
    pairs = _pairs(here, scores)
    for name, got in pairs.items():
        own, at = [x[0] for x in got.values()], [x[1] for x in got.values()]
        lines.append(f"| {name} | {len(got)} | {statistics.fmean(own):.3f} ({', '.join(f'{x:.3f}' for x in own)}) | "
                     f"{statistics.fmean(at):.3f} ({', '.join(f'{x:.3f}' for x in at)}) | "
                     f"{statistics.fmean(y - x for x, y in zip(own, at)):+.3f} |")
    if not pairs:
        return lines[:2] + ["Not rescored yet."]
    table = []
    for cmp in comparisons:
        if cmp.kind != "score" or cmp.a not in pairs or cmp.b not in pairs:
            continue
        seeds = sorted(pairs[cmp.a].keys() & pairs[cmp.b].keys())
        if len(seeds) < 2:
            continue
        cells = [v.paired_scores([pairs[cmp.a][s][j] for s in seeds], [pairs[cmp.b][s][j] for s in seeds])
                 for j in (0, 1)]
        cells = [e.text().removeprefix(f"{e.what} ") for e in cells]
        table.append(f"| {cmp.finding} | {cmp.b} − {cmp.a} | {cells[0]} | {cells[1]} |")
    if not table:
        return [*lines, "", "Paired differences: from two rescored pairs on."]
    return [*lines, "", f"| | B − A | own engines ({level}, last evaluation) | at {precision} |", "|---|---|---|---|",
            *table]
