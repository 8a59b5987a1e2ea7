"""`minirl lab`: the paper's stability grid (F1–F6 of arXiv 2512.01374) in miniature.

On a workspace of the long-response task (`minirl init --task scratchpad`), with FP8-emulated
rollouts (the paper's stress test) and the guard observing only (`guard.enabled = false`), so a
collapse runs its course. Cells:

- on-policy (N = 1): MiniRL; without IS correction; + length normalisation; + R3; R3 without IS;
- off-policy (N = 2, 4, 8; --quick: 4), mini-batches of 8 prompts: no clipping and no replay;
  clipping only; clipping + R2; clipping + R3;
- cold starts (F6): MiniRL from the workspace's cold start and from others stopped at other
  dev accuracies (built once, into the lab folder).

Each (cell, seed) is one `minirl run` in its own process, one at a time; the lab's state file
records every finished one with its settings, so an interrupted sweep resumes where it stopped
(a cell whose settings changed is run again) and the cold starts are reused. The report (report.md, one PNG per regime) is computed from the runs' metrics by code:
collapse by the guard's own criteria applied offline, peak and final held-out accuracy, and the
trajectories; the findings table F1–F6 follows from those numbers by the rules in `findings`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from minirl import atomic
from minirl import recipe as recipe_mod
from minirl.guard import Guard
from minirl.preflight import complete_checkpoints
from minirl.rollout.seeding import SAMPLING
from minirl.runlock import RunLock
from minirl.status import PROCESS_FILE
from minirl.status import read as run_status  # a run's state, as `minirl status` reads it
from minirl.workspace import init_workspace

NO_IS = ("loss.is_mode=off", "loss.allow_uncorrected=true")
NO_CLIP = ("loss.eps_low=1", "loss.eps_high=1e9")  # M_t ≡ 1: r_t never falls below 0 nor above 1e9


@dataclass(frozen=True)
class Cell:
    regime: str  # "on-policy" | "off-policy N=4" | "cold starts"
    variant: str
    sets: tuple[str, ...] = ()
    cold_start: float = 0.0  # dev accuracy an extra cold start stops at (F6); 0 = the workspace's own

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.regime}-{self.variant}".lower()).strip("-")


@dataclass(frozen=True)
class Plan:
    steps: int
    eval_every: int
    seeds: int
    offpolicy_n: tuple[int, ...]
    cold_start_targets: tuple[float, ...]  # dev accuracies of the extra cold starts (F6)
    mb_prompts: int = 8  # prompts per off-policy mini-batch (× G = 8 responses); N of them per step
    cells: list[Cell] = field(default_factory=list)


def plan(*, quick: bool, seeds: int | None = None) -> Plan:
    ns = (4,) if quick else (2, 4, 8)
    targets = (0.1,) if quick else (0.1, 0.4)
    # 8 prompts a mini-batch: with 4 (tried, to make a quick N = 4 step as cheap as an on-policy
    # one) every off-policy variant, clip + R3 included, fell to reward 0 within 5 steps
    mb = 8
    cells = [
        Cell("on-policy", "MiniRL"),
        Cell("on-policy", "MiniRL w/o IS", NO_IS),
        Cell("on-policy", "MiniRL + length norm", ("loss.length_norm=true",)),
        Cell("on-policy", "MiniRL + R3", ("train.replay=r3",)),
        Cell("on-policy", "MiniRL + R3 w/o IS", ("train.replay=r3", *NO_IS)),
    ]
    for n in ns:
        off = (f"train.minibatches={n}", f"train.prompts_per_step={mb * n}")
        cells += [
            Cell(f"off-policy N={n}", "no clip, no replay", (*off, *NO_CLIP)),
            Cell(f"off-policy N={n}", "clip", off),
            Cell(f"off-policy N={n}", "clip + R2", (*off, "train.replay=r2")),
            Cell(f"off-policy N={n}", "clip + R3", (*off, "train.replay=r3")),
        ]
    cells += [Cell("cold starts", f"cold start @{t:.0%}", cold_start=t) for t in targets]
    return Plan(steps=30 if quick else 150, eval_every=10 if quick else 25, seeds=seeds or 1,
                offpolicy_n=ns, cold_start_targets=targets, mb_prompts=mb, cells=cells)


# ----- running -----------------------------------------------------------------------------------
def common_sets(p: Plan, seed: int) -> list[str]:
    """What every cell shares: the stress test (FP8 rollouts), the guard observing only and the schedule."""
    return ["rollout.precision=fp8", "guard.enabled=false", f"train.steps={p.steps}", f"eval.every={p.eval_every}",
            f"train.seed={seed}"]


def resumable_sets(p: Plan) -> list[str]:
    """Checkpoints often enough that a run cut short (a session's end, a kill) loses at most a
    tenth of itself: the next sweep continues it from the newest (Lab.run_cell), the only one
    kept. Not part of what makes a run its cell's: where a run saves changes nothing it computes."""
    return [f"checkpoint.every={max(1, p.steps // 10)}", "checkpoint.keep=1"]


def _legacy_free(recorded: list[str], p: Plan) -> list[str]:
    """A run recorded before resumable_sets carried "no checkpoints but the last" among its cell's
    settings; it is the same cell's run as one recorded since."""
    return [x for x in recorded if x not in (f"checkpoint.every={p.steps + 1}", "checkpoint.keep=1")]


GUARD_CHECKPOINT_EVERY = 5  # the guard check's checkpoints: the rollback target is at most this many steps back
# the guard check: the recipe's guard, acting, with checkpoints close enough to roll back to
GUARDED = ("guard.enabled=true", f"checkpoint.every={GUARD_CHECKPOINT_EVERY}", "checkpoint.keep=2")


class Lab:
    def __init__(self, ws_root: Path, out: Path):
        self.ws_root, self.out = Path(ws_root), Path(out)
        self.state_path = self.out / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"runs": {}}

    def _save(self) -> None:
        atomic.write_text(self.state_path, json.dumps(self.state, indent=1))

    def hold(self) -> None:
        """Be this grid's one writer until the process ends (runlock.py): a second `minirl lab` on
        it is refused in one line. The report alone (`--report-only`) needs no lock."""
        self._lock = RunLock(self.out, what="lab grid")

    def cold_start_model(self, target: float, progress) -> Path:
        """A second cold start of the workspace's own task and data, stopped at another dev accuracy
        (F6); built once, beside the grids' folders, and reused by both grids and every later sweep."""
        name = f"acc{round(100 * target)}"
        root = self.out.parent / "coldstarts" / name
        if not (root / "minirl.toml").exists():
            task = recipe_mod.load(self.ws_root / "minirl.toml").cold_start.task
            progress(f"cold start {name} (dev accuracy {target:.0%}, {task})")
            init_workspace(root, task=task, force=True, overrides=[f"cold_start.target_acc={target}"])
        return root / "model" / "coldstart"

    def minirl(self, args: list[str], log: Path, *, on_start: Callable[[int], None] = lambda pid: None,
               append: bool = False) -> subprocess.Popen:
        """`minirl ARGS` in a process of its own (an engine's memory and threads end with it), its
        output to `log`; on_start(pid) once it runs; returned finished."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a" if append else "w") as f:
            child = subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=f, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1], env={**os.environ, "COLUMNS": "160"})
            on_start(child.pid)
            child.wait()
        return child

    def _recorded(self, sets: list[str]) -> list[str]:
        """What makes a run this cell's: its sets on top of the workspace recipe as it reads now (a
        recipe changed since, say the learning rate the lr study chose, runs the cell again; its
        comments do not) and the sampling scheme."""
        resolved = json.dumps(recipe_mod.load(self.ws_root / "minirl.toml").to_dict(), sort_keys=True)
        return [*sets, f"#recipe={hashlib.sha256(resolved.encode()).hexdigest()[:16]}", f"#sampling={SAMPLING}"]

    def _identity(self, cell: Cell, seed: int, p: Plan, guarded: bool) -> tuple[str, list[str]]:
        """(key in state.json, settings recorded) of (cell, seed): what makes a run this cell's."""
        key = f"{'guard-check/' if guarded else ''}{cell.id}/s{seed}"
        return key, self._recorded([*common_sets(p, seed), *cell.sets, *(GUARDED if guarded else ())])

    def finished(self, cell: Cell, seed: int, p: Plan, *, guarded: bool = False) -> Path | None:
        """The run folder of (cell, seed) where it finished with the settings it would run with now."""
        key, recorded = self._identity(cell, seed, p, guarded)
        done = self.state["runs"].get(key)
        if done and (Path(done) / "summary.json").exists() and \
                _legacy_free(self.state.get("sets", {}).get(key, []), p) == recorded:
            return Path(done)
        return None

    def _cut_short(self, key: str, recorded: list[str]) -> Path | None:
        """The run of `key` that a sweep began with today's settings and that ended before the
        sweep could record it (the session's end, a kill, a crash), where it has a checkpoint."""
        began = self.state.get("in_flight") or {}
        if began.get("key") != key or began.get("sets") != recorded:
            return None
        run = Path(began["run"]) if began.get("run") else run_of_process(self.ws_root, began["pid"], since=began["since"])
        return run if run is not None and complete_checkpoints(run) else None

    def run_cell(self, cell: Cell, seed: int, p: Plan, *, progress, guarded: bool = False) -> Path:
        """One (cell, seed): a `minirl run` of its own; returns its run folder. `guarded`: the same
        run with the guard acting (rollbacks to checkpoints every GUARD_CHECKPOINT_EVERY steps); it
        may end as `collapsed` (exit 3), which is then its result."""
        key, recorded = self._identity(cell, seed, p, guarded)
        sets = [*common_sets(p, seed), *cell.sets, *resumable_sets(p), *(GUARDED if guarded else ())]
        if done := self.finished(cell, seed, p, guarded=guarded):
            return done  # the same cell with the same settings: reused
        if cell.cold_start:
            sets.append(f"model.path={self.cold_start_model(cell.cold_start, progress)}")
        log = self.out / "logs" / f"{key.replace('/', '-')}.log"
        args = ["run", str(self.ws_root), *[x for s in sets for x in ("--set", s)]]
        if cut_short := self._cut_short(key, recorded):  # same seed, prompts and sampling seeds from its checkpoint on
            if _ended(cut_short, guarded):  # it ended before the sweep could record it: nothing left to run
                progress(f"{key}: run {cut_short.name} had ended; recorded")
                return self._record(key, recorded, cut_short)
            progress(f"{key}: continuing run {cut_short.name} from its newest checkpoint")
            args += ["--resume", str(cut_short)]
        t0 = time.time()

        def began(pid: int) -> None:
            self.state["in_flight"] = {"key": key, "sets": recorded, "pid": pid, "since": t0,
                                       **({"run": str(cut_short)} if cut_short else {})}
            self._save()

        child = self.minirl(args, log, on_start=began, append=cut_short is not None)
        rc = child.returncode
        run = run_of_process(self.ws_root, child.pid, since=t0)
        if rc not in ((0, 3) if guarded else (0,)) or run is None or not (run / "summary.json").exists():
            if cut_short and rc == 2:  # its checkpoint refused (damaged): the next sweep begins the run again
                self.state.pop("in_flight", None)
                self._save()
            raise RuntimeError(f"lab cell {key} failed (exit {rc}); see {log}")
        return self._record(key, recorded, run)

    def _record(self, key: str, recorded: list[str], run: Path) -> Path:
        self.state["runs"][key] = str(run)
        self.state.setdefault("sets", {})[key] = recorded
        self.state.pop("in_flight", None)
        self._save()
        return run

    def guard_check(self, p: Plan, *, progress: Callable[[str], None] = lambda s: None) -> dict | None:
        """Issue #9's point 5: the cell that collapsed most reliably under the guard's criteria (as
        observed), run again from the same seed with the guard acting. None when no cell collapsed."""
        res = results(self, p)
        cell = most_reliable_collapse(res, p.cells)
        if cell is None:
            return None
        progress(f"guard check: {cell.regime}: {cell.variant}, guard acting")
        guarded = self.run_cell(cell, 0, p, progress=progress, guarded=True)
        self.state["guard_check"] = {"cell": cell.id, "observed": self.state["runs"][f"{cell.id}/s0"],
                                     "guarded": str(guarded)}
        self._save()
        return self.state["guard_check"]

    def sweep(self, p: Plan, *, on_cell: Callable[[str, int, int], None] = lambda *a: None,
              progress: Callable[[str], None] = lambda s: None) -> dict[str, list[Path]]:
        todo = [(c, s) for c in p.cells for s in range(p.seeds)]
        runs: dict[str, list[Path]] = {}
        for i, (cell, seed) in enumerate(todo):
            on_cell(f"{cell.regime}: {cell.variant} (seed {seed})", i, len(todo))
            runs.setdefault(cell.id, []).append(self.run_cell(cell, seed, p, progress=progress))
        on_cell("done", len(todo), len(todo))
        return runs


# ----- reading the runs ----------------------------------------------------------------------------
def run_of_process(ws_root: Path, pid: int, *, since: float) -> Path | None:
    """The run folder that process `pid` started after `since` (its process.json says so). Not "the
    newest folder": another lab or run in the same workspace may have started one meanwhile."""
    for run in sorted((Path(ws_root) / "runs").glob("*/" + PROCESS_FILE), reverse=True):
        try:
            rec = json.loads(run.read_text())
            if rec.get("pid") == pid and rec.get("started", 0) >= since:
                return run.parent
        except (OSError, json.JSONDecodeError):
            continue
    return None


def _ended(run: Path, guarded: bool) -> bool:
    """Whether `run` reached its real end (its summary, written last, is this attempt's, as
    `minirl status` reads it): a sweep cut short between its run's end and its record has nothing
    to resume. An interrupted or killed run resumes."""
    state = run_status(run).state
    return state == "finished" or (guarded and state == "collapsed")


def rows_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def collapse(rows: list[dict], recipe_guard: dict) -> tuple[int, str] | None:
    """The step at which the guard, had it been active, would have acted, and why: its own
    criteria (KL above max_kl, or reward down from its best with entropy out of its band, for
    `patience` steps), applied offline to the logged signals."""
    g = Guard.from_settings(recipe_guard, enabled=True, max_rollbacks=0)
    for r in rows:
        v = g.decide(kl=r["train/kl_mu_pi_old"], entropy=r["train/entropy"], reward=r["rollout/reward_mean"],
                     loss=0.0, grad_norm=0.0)
        if v.action in ("rollback", "stop"):
            return r["step"], v.reason.split("; ")[0]
    return None


def cell_result(runs: list[Path]) -> dict:
    """Per cell, over seeds: collapse (how many seeds, first step), held-out peak and final."""
    per_seed = []
    for run in runs:
        rows = rows_of(run)
        summary = json.loads((run / "summary.json").read_text())
        key = summary["heldout"]["metric"]
        curve = [summary["heldout"]["start"][key]] + [r[f"heldout/{key}"] for r in rows if f"heldout/{key}" in r]
        per_seed.append({
            "collapse": (collapse(rows, summary["recipe"]["guard"]) or (None,))[0],
            "start": curve[0], "peak": max(curve), "final": summary["heldout"]["end"][key],
            "kl": statistics.mean(r["train/kl_mu_pi_old"] for r in rows),
            "clip": statistics.mean(r["loss/clip_frac"] for r in rows),
            "is_max": max(r["loss/is_weight_max"] for r in rows),
            "entropy_end": rows[-1]["train/entropy"], "wall_s": summary.get("wall_s", 0.0), "rows": rows,
        })
    collapses = [s["collapse"] for s in per_seed if s["collapse"] is not None]
    # the guard watches KL and falling entropy; a policy can also fall apart with entropy rising
    # (seen here off-policy): a held-out score ending FELL below its start counts as collapsed too
    fell = sum(s["final"] < s["start"] - FELL for s in per_seed if s["collapse"] is None)
    mean = lambda k: statistics.mean(s[k] for s in per_seed)  # noqa: E731
    return {"seeds": len(per_seed), "collapsed": len(collapses) + fell, "fell": fell,
            "first_collapse": min(collapses, default=None),
            "start": mean("start"), "peak": mean("peak"), "final": mean("final"), "kl": mean("kl"),
            "clip": mean("clip"), "is_max": max(s["is_max"] for s in per_seed),
            "wall_s": sum(s["wall_s"] for s in per_seed), "per_seed": per_seed}


# ----- findings ----------------------------------------------------------------------------------
MARGIN = 0.03  # held-out differences below this are noise at 256 problems × 4 samples (±0.015 s.e.)
FELL = 0.1  # a run whose final held-out score is this far below its start collapsed, whatever the guard saw


def findings(res: dict[str, dict], cells: list[Cell], ns: tuple[int, ...]) -> list[tuple[str, str, str, str]]:
    """F1–F6 as (id, the paper's claim, verdict, the numbers that decide it), from the results."""
    by = {(c.regime, c.variant): res.get(c.id) for c in cells}

    def r(regime, variant):
        return by.get((regime, variant))

    def fmt(x):
        if x is None:
            return "n/a"
        how = [f"guard at step {x['first_collapse']}"] if x["first_collapse"] is not None else []
        how += [f"{x['fell']} fell > {FELL} below the start"] if x.get("fell") else []
        state = f"collapsed {x['collapsed']}/{x['seeds']} ({', '.join(how)})" if x["collapsed"] else \
            f"stable {x['seeds']}/{x['seeds']}"
        return f"{state}, held-out {x['start']:.3f} → final {x['final']:.3f}, peak {x['peak']:.3f}"

    def collapsed(x):
        return x is not None and x["collapsed"] * 2 > x["seeds"]

    def stable(x):
        return x is not None and x["collapsed"] == 0

    out = []
    on, no_is, ln = r("on-policy", "MiniRL"), r("on-policy", "MiniRL w/o IS"), r("on-policy", "MiniRL + length norm")
    r3, r3_no_is = r("on-policy", "MiniRL + R3"), r("on-policy", "MiniRL + R3 w/o IS")
    others = [x for x in (no_is, ln, r3, r3_no_is) if x]
    if on and no_is:
        best = all(on["final"] >= x["final"] - MARGIN for x in others)
        v = "reproduced" if stable(on) and collapsed(no_is) and best else \
            "not reproduced" if stable(no_is) and no_is["final"] >= on["final"] - MARGIN else "inconclusive"
        out.append(("F1", "on-policy MiniRL is stable and best; without IS it collapses", v,
                    f"MiniRL: {fmt(on)}; w/o IS: {fmt(no_is)}"))
    if on and ln:
        v = "reproduced" if stable(ln) and ln["final"] < on["final"] - MARGIN else \
            "not reproduced" if collapsed(ln) or ln["final"] > on["final"] + MARGIN else "inconclusive"
        out.append(("F2", "length normalisation stays stable but scores lower", v,
                    f"MiniRL: {fmt(on)}; + length norm: {fmt(ln)}"))
    if on and r3 and r3_no_is:
        no_gain = r3["final"] <= on["final"] + MARGIN
        v = "reproduced" if no_gain and r3["kl"] < on["kl"] and collapsed(r3_no_is) else \
            "not reproduced" if not no_gain or stable(r3_no_is) else "inconclusive"
        out.append(("F3", "on-policy R3 gives no gain (lower KL); R3 without IS still collapses", v,
                    f"MiniRL: {fmt(on)}, KL {on['kl']:.2e}; + R3: {fmt(r3)}, KL {r3['kl']:.2e}; R3 w/o IS: {fmt(r3_no_is)}"))
    f4, f5 = [], []
    for n in ns:
        reg = f"off-policy N={n}"
        none, clip, r2_, r3_ = (r(reg, v) for v in ("no clip, no replay", "clip", "clip + R2", "clip + R3"))
        if none and clip and r2_ and r3_:
            both = stable(r2_) or stable(r3_)
            dropped = collapsed(none) and collapsed(clip)
            f4.append(("reproduced" if both and dropped else "not reproduced" if not both or stable(none) else
                       "inconclusive", f"N={n}: none {fmt(none)}; clip {fmt(clip)}; clip+R2 {fmt(r2_)}; clip+R3 {fmt(r3_)}"))
            want_r2 = n == 2
            diff = r2_["final"] - r3_["final"]
            ok = (diff >= -MARGIN) if want_r2 else (diff < -MARGIN or (collapsed(r2_) and not collapsed(r3_)))
            f5.append(("reproduced" if ok else "not reproduced" if abs(diff) > MARGIN else "inconclusive",
                       f"N={n}: R2 final {r2_['final']:.3f} vs R3 {r3_['final']:.3f}"))
    for fid, claim, parts in (("F4", "off-policy needs both clipping and Routing Replay; dropping either collapses", f4),
                              ("F5", "N = 2: R2 ≥ R3; N ≥ 4: R3 > R2", f5)):
        if parts:
            verdicts = {v for v, _ in parts}
            v = verdicts.pop() if len(verdicts) == 1 else "inconclusive"
            out.append((fid, claim, v, "; ".join(t for _, t in parts)))
    starts = [x for c in cells if c.regime == "cold starts" and (x := res.get(c.id))] + ([on] if on else [])
    if len(starts) >= 2:
        finals = [x["final"] for x in starts]
        spread = max(finals) - min(finals)
        v = "reproduced" if all(stable(x) for x in starts) and spread <= 2 * MARGIN else \
            "not reproduced" if spread > 4 * MARGIN else "inconclusive"
        out.append(("F6", "once stable, different cold starts end at comparable scores", v,
                    "starts " + ", ".join(f"{x['start']:.3f}" for x in starts) + " → finals "
                    + ", ".join(f"{f:.3f}" for f in finals) + f" (spread {spread:.3f})"))
    return out


# ----- the guard against a real collapse (issue #9, point 5) ------------------------------------
def most_reliable_collapse(res: dict[str, dict], cells: list[Cell]) -> Cell | None:
    """The cell whose seeds met the guard's criteria most often (seed 0 among them: the guard check
    reruns it), the earliest first; None when no cell's seed 0 did."""
    ranked = [(sum(s["collapse"] is not None for s in x["per_seed"]), -x["per_seed"][0]["collapse"], -i, c)
              for i, c in enumerate(cells) if (x := res.get(c.id)) and x["per_seed"][0]["collapse"] is not None]
    return max(ranked, key=lambda t: t[:3])[3] if ranked else None


def guard_check_result(info: dict | None) -> dict | None:
    """The guard check's figures: where the observed run met the criteria, and what the guarded
    run did about it (rollbacks, their targets and reasons, how it ended, held-out scores)."""
    if not info or not all((Path(info[k]) / "summary.json").exists() for k in ("observed", "guarded")):
        return None
    out = {"cell": info["cell"]}
    for which in ("observed", "guarded"):
        run = Path(info[which])
        summary, rows = json.loads((run / "summary.json").read_text()), rows_of(run)
        key = summary["heldout"]["metric"]
        tail = rows[-5:]
        out[which] = {
            "run": str(run), "rows": rows, "status": summary["status"], "steps": summary["steps"],
            "heldout_start": summary["heldout"]["start"][key], "heldout_end": summary["heldout"]["end"][key],
            "reward_end": statistics.mean(r["rollout/reward_mean"] for r in tail),
            "entropy_end": statistics.mean(r["train/entropy"] for r in tail),
            "collapse": collapse(rows, summary["recipe"]["guard"]),
            "rollbacks": [{"step": r["step"], "action": r["guard/action"], "reason": r.get("guard/reason", ""),
                           "to": r.get("guard/rollback_to_step")}
                          for r in rows if r.get("guard/action") in ("rollback", "stop")],
            "patience": summary["recipe"]["guard"]["patience"], "wall_s": summary.get("wall_s", 0.0),
        }
    return out


def plot_guard_check(check: dict, path: Path) -> Path:
    """Reward, entropy and KL of the collapsing cell observed (grey) and with the guard acting
    (blue), rollbacks as red dashed lines, the observed run's trip as ×."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    obs, grd = check["observed"], check["guarded"]
    for ax, key, title in zip(axes, ("rollout/reward_mean", "train/entropy", "train/kl_mu_pi_old"),
                              ("reward", "token entropy", "KL(μ_old ‖ π_old)")):
        for run, color, label in ((obs, "0.55", "guard observing only"), (grd, "tab:blue", "guard acting")):
            ax.plot([r["step"] for r in run["rows"]], [r[key] for r in run["rows"]], color=color, lw=1.3, label=label)
        if obs["collapse"]:
            row = next(r for r in obs["rows"] if r["step"] == obs["collapse"][0])
            ax.plot([row["step"]], [row[key]], "x", color="0.3", ms=9, label="criteria met (observed)")
        for rb in grd["rollbacks"]:  # labelled once per action
            ax.axvline(rb["step"], color="tab:red" if rb["action"] == "rollback" else "black", ls="--", lw=1.0,
                       label=f"{rb['action']} (guard)" if rb is next(x for x in grd["rollbacks"]
                                                                 if x["action"] == rb["action"]) else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"minirl lab: the guard against a real collapse ({check['cell']}; status {grd['status']})")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def guard_check_lines(check: dict | None, *, any_collapse: bool) -> list[str]:
    if check is None:
        why = ("Not run yet: it is the sweep's last stage." if any_collapse else
               "No cell's seed 0 met the guard's criteria: there was no real collapse to run the guard against.")
        return ["## The guard against a real collapse", "", why, ""]
    obs, grd = check["observed"], check["guarded"]
    seen = (f"met the guard's criteria at step {obs['collapse'][0]} ({obs['collapse'][1]}; patience "
            f"{obs['patience']})")
    acts = "; ".join(f"step {r['step']}: {r['action']} to step {r['to']} ({r['reason']})" for r in grd["rollbacks"])
    return ["## The guard against a real collapse", "",
            f"The cell that collapsed most reliably, `{check['cell']}` (seed 0), run again with the guard acting "
            f"(checkpoints every {GUARD_CHECKPOINT_EVERY} steps). Observing only, it {seen}.", "",
            "| | guard observing only | guard acting |", "|---|---|---|",
            f"| status | {obs['status']} after {obs['steps']} steps | {grd['status']} after {grd['steps']} steps |",
            f"| guard actions | - | {len(grd['rollbacks'])}: {acts or 'none'} |",
            f"| reward, last 5 steps | {obs['reward_end']:.3f} | {grd['reward_end']:.3f} |",
            f"| entropy, last 5 steps | {obs['entropy_end']:.3f} | {grd['entropy_end']:.3f} |",
            f"| held-out start → end | {obs['heldout_start']:.3f} → {obs['heldout_end']:.3f} | "
            f"{grd['heldout_start']:.3f} → {grd['heldout_end']:.3f} |",
            f"| wall time | {obs['wall_s'] / 60:.1f} min | {grd['wall_s'] / 60:.1f} min |", "",
            f"Runs: `{obs['run']}` (observing), `{grd['run']}` (acting). Figure: `lab-guard-check.png`.", ""]


# ----- output --------------------------------------------------------------------------------------
def plot_regimes(res: dict[str, dict], cells: list[Cell], out: Path) -> list[Path]:
    """One PNG per regime, as the paper lays its figures out: reward, entropy and KL(μ‖π_old) over
    steps, one line per variant (mean over seeds, min–max band), collapse steps marked ×."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for regime in dict.fromkeys(c.regime for c in cells):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
        for c in (c for c in cells if c.regime == regime and c.id in res):
            seeds = [s["rows"] for s in res[c.id]["per_seed"]]
            n = min(len(s) for s in seeds)
            steps = [r["step"] for r in seeds[0][:n]]
            for ax, key in zip(axes, ("rollout/reward_mean", "train/entropy", "train/kl_mu_pi_old")):
                vals = [[s[i][key] for s in seeds] for i in range(n)]
                line, = ax.plot(steps, [statistics.mean(v) for v in vals], lw=1.3, label=c.variant)
                if len(seeds) > 1:
                    ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
                for s in res[c.id]["per_seed"]:
                    if s["collapse"] is not None:
                        row = next(r for r in s["rows"] if r["step"] == s["collapse"])
                        ax.plot([s["collapse"]], [row[key]], "x", color=line.get_color(), ms=8)
        for ax, title in zip(axes, ("reward", "token entropy", "KL(μ_old ‖ π_old)")):
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"minirl lab: {regime} (FP8 rollouts; × = the guard's criteria met)")
        path = out / f"lab-{regime.replace(' ', '-').replace('=', '')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(res: dict[str, dict], p: Plan, out: Path, pngs: list[Path], check: dict | None = None) -> Path:
    lines = ["# minirl lab", "",
             f"{len(p.cells)} cells × {p.seeds} seed(s), {p.steps} steps each, FP8-emulated rollouts, guard observing "
             f"only; held-out avg@k every {p.eval_every} steps. Collapsed = the guard's criteria met (applied offline "
             f"to the logged KL, entropy and reward), or a final held-out score more than {FELL} below the start.", "",
             "## Findings", "", "| | the paper | here | the numbers |", "|---|---|---|---|"]
    for fid, claim, verdict, numbers in findings(res, p.cells, p.offpolicy_n):
        lines.append(f"| {fid} | {claim} | **{verdict}** | {numbers} |")
    lines += ["", "## Cells", "",
              "| regime | variant | collapsed | guard acts at | held-out start | peak | final | mean KL | mean clip | max IS |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in p.cells:
        x = res.get(c.id)
        if x:
            lines.append(f"| {c.regime} | {c.variant} | {x['collapsed']}/{x['seeds']} | {x['first_collapse'] or '-'} | "
                         f"{x['start']:.3f} | {x['peak']:.3f} | {x['final']:.3f} | {x['kl']:.2e} | {x['clip']:.3f} | "
                         f"{x['is_max']:.2f} |")
    wall = sum(x["wall_s"] for x in res.values())
    lines += ["", f"The runs above took {wall / 3600:.2f} h of wall time in all ({sum(x['seeds'] for x in res.values())} "
              f"runs, start-up and held-out evaluations included; the extra cold starts' builds and the guard check "
              f"not included)."]
    any_collapse = most_reliable_collapse(res, p.cells) is not None
    lines += ["", *guard_check_lines(check, any_collapse=any_collapse), "## Figures", "", *[f"- `{png.name}`" for png in pngs], ""]
    path = out / "report.md"
    atomic.write_text(path, "\n".join(lines))
    return path


def results(lab: Lab, p: Plan) -> dict[str, dict]:
    """Per cell id, its result over the seeds run so far."""
    res = {}
    for c in p.cells:
        runs = [Path(lab.state["runs"][k]) for s in range(p.seeds) if (k := f"{c.id}/s{s}") in lab.state["runs"]]
        if runs:
            res[c.id] = cell_result(runs)
    return res


def report(lab: Lab, p: Plan) -> tuple[Path, list[Path], list[tuple]]:
    res = results(lab, p)
    pngs = plot_regimes(res, p.cells, lab.out)
    check = guard_check_result(lab.state.get("guard_check"))
    if check:
        pngs.append(plot_guard_check(check, lab.out / "lab-guard-check.png"))
    return write_report(res, p, lab.out, pngs, check), pngs, findings(res, p.cells, p.offpolicy_n)
