"""The record of every trained token, on request (`metrics.record_tokens`), and its checker (`minirl check`).

minirl's tests assert that what trains is exactly what was sampled; this lets a user check it on their
own run. Each recorded step writes a line per sample to runs/<id>/tokens.jsonl, taken from what the
trainer was given and what the engine returned, side by side:

    sampled     the ids the engine returned (an episode's: its turns and the environment's replies)
    trained     the ids at the response's positions of the trainer's batch
    env         1 where the engine sampled the token, 0 where an environment's reply put it
    loss        1 where the loss trained on the token (the batch's mask, less non-finite log μ)
    logmu       log μ of each token, as the batch holds it (the engine's, at its temperature and cut)
    logpi_old   log π_θold of each token, the trainer's (renormalized over the cut's kept set)
    version     the policy version whose weights sampled each token (null: the step's own)
    kept        where the sampler cut: how many of the most likely tokens it kept (null: no cut)
    routed      R3: positions of prompt and response with a route of the engine's, and how many there are

with the step's trained version (step − 1), the run's k (`rollout.max_staleness`) and what the guard did
with the step's update. Rank 0's share of the batch, like the samples. Crash-safe as the metrics rows:
written before the step's row, and a resumed run drops the lines past its checkpoint.

The checker reads the records and the run's recipe and says, check by check, what holds: ids trained =
ids sampled; every environment token out of the loss and every token out of the loss an environment's
(or of a sample that trains nothing: an environment's fault, or a non-finite log μ); no token more than k
updates behind its step, none ahead; log μ finite; under R3 every position routed; and the mismatch,
KL(μ‖π_old) over the tokens each step's trained weights sampled: its median step within what the run's
precision allows, 10 × the workspace's newest `minirl doctor` figure at that precision (k3, as the doctor
measures it), or without one the guard's `max_kl` (k1, as the guard reads it). The median, because a
step's KL has a heavy tail that the guard tolerates by design (on the embedded default at bf16, a step in
a few holds a group far off at one position: 2e-2 to 7e-2 against a median of 1e-4), where a trainer off the
sampler's distribution (a wrong temperature, a cut not renormalized) moves every step.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from minirl.data.written import keep_through, records

FILE = "tokens.jsonl"


def due(step: int, first: int, every: int) -> bool:
    """Whether a step is recorded: the first `first` steps, then every `every`-th (0: none)."""
    return step <= first or bool(every and step % every == 0)


def sample_lines(step: int, batch, comps: list, *, k: int, update: str) -> list[dict]:
    """A line per row of the batch the step trained on (its π_θold filled in), beside the completion
    the engine returned for it."""
    from minirl.train.objective import valid_mask  # deferred: torch (the CLI reads these files without it)

    loss = valid_mask(batch.mask_BT, batch.rollout_logp_BT)
    out = []
    for i, c in enumerate(comps):
        n_p, n = int(batch.prompt_len_B[i]), int(batch.seq_len_B[i])
        at = slice(n_p - 1, n - 1)
        out.append({
            "step": step, "sample": i, "trained_version": step - 1, "k": k, "update": update,
            "sampled": list(c.token_ids), "trained": batch.tokens_BL[i, n_p:n].tolist(),
            "env": list(c.mask) if c.mask is not None else None,
            "loss": [int(x) for x in loss[i, at].tolist()],
            "logmu": batch.rollout_logp_BT[i, at].tolist(),
            "logpi_old": batch.old_logp_BT[i, at].tolist() if batch.old_logp_BT is not None else None,
            "version": list(c.versions) if c.versions is not None else None,
            "kept": batch.kept_BT[i, at].tolist() if batch.kept_BT is not None else None,
            "routed": [int(c.routes.shape[0]), n - 1] if c.routes is not None else None,
        })
    return out


class TokenRecord:
    """The run's tokens file from its step on (a resume's lines past its checkpoint dropped first)."""

    def __init__(self, run_dir: Path, step: int, *, first: int, every: int, k: int):
        self.path = run_dir / FILE
        truncate(self.path, step)
        self.first, self.every, self.k = first, every, k
        self._f = self.path.open("a")

    def write(self, step: int, batch, comps: list, update: str) -> None:
        if due(step, self.first, self.every):
            self._f.write("".join(json.dumps(x) + "\n"
                                  for x in sample_lines(step, batch, comps, k=self.k, update=update)))
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def lines(path: Path) -> Iterator[dict]:
    """The whole lines of a tokens file (a line a kill tore is none)."""
    return records(path, body="sampled")


def truncate(path: Path, step: int) -> None:
    """Keep the whole lines of steps ≤ `step`, in one atomic rewrite."""
    keep_through(path, step, body="sampled")


# ----- the checker ----------------------------------------------------------------------------------
CHECKS = {
    "ids": "ids trained = ids sampled",
    "env": "every environment token out of the loss, every token out of it an environment's",
    "versions": "no token more than k updates behind its step, none ahead",
    "finite": "log μ finite",
    "mismatch": "the median step's KL(μ‖π_old) over its fresh tokens within the precision's bound",
    "routes": "R3: every position routed",
}


@dataclass
class Check:
    """One check over the records: how many samples (steps, for the mismatch) it looked at, and its
    failures as (step, sample, what)."""

    looked: int = 0
    failures: list[tuple[int, int | None, str]] = field(default_factory=list)
    median: float | None = None  # the mismatch's: the median step's KL
    largest: tuple[float, int] | None = None  # and the largest, with its step


def check(records: list[dict], *, bound: float, k3: bool) -> dict[str, Check]:
    """Every check of CHECKS over `records` (routes only where the run replays them); the median step's
    KL against `bound`, estimated with k3 (a doctor's figure) or k1 (the guard's)."""
    out = {name: Check() for name in CHECKS}
    fresh: dict[int, list[float]] = {}  # step → log π_old/μ of the tokens its trained weights sampled
    for x in records:
        s, i = x["step"], x["sample"]
        n = len(x["sampled"])
        env = x["env"] or [1] * n
        _look(out["ids"], s, i, x["trained"] == x["sampled"], lambda: _first_diff(x["trained"], x["sampled"]))
        trains = any(x["loss"])
        wrong = [t for t in range(n) if (env[t] == 0 and x["loss"][t]) or
                 (trains and env[t] == 1 and not x["loss"][t] and math.isfinite(x["logmu"][t]))]
        _look(out["env"], s, i, not wrong, lambda: f"token {wrong[0]}: env {env[wrong[0]]}, loss {x['loss'][wrong[0]]}")
        v = x["version"]
        if v is not None:
            lags = [x["trained_version"] - v[t] for t in range(n) if env[t]]
            bad = [g for g in lags if g > x["k"] or g < 0]
            _look(out["versions"], s, i, not bad, lambda: f"a token {bad[0]} updates behind (k = {x['k']})")
        nonfinite = [t for t in range(n) if env[t] and not math.isfinite(x["logmu"][t])]
        _look(out["finite"], s, i, not nonfinite, lambda: f"token {nonfinite[0]}: log μ {x['logmu'][nonfinite[0]]}")
        if x["routed"] is not None:
            have, need = x["routed"]
            _look(out["routes"], s, i, have >= need, lambda: f"{have} of {need} positions routed")
        if x["logpi_old"] is not None:
            fresh.setdefault(s, []).extend(x["logpi_old"][t] - x["logmu"][t] for t in range(n)  # log r, r = π_old/μ
                                           if x["loss"][t] and (v is None or v[t] == x["trained_version"]))
    kl = {s: sum(math.expm1(d) - d for d in ds) / len(ds) if k3 else -sum(ds) / len(ds)
          for s, ds in sorted(fresh.items()) if ds}
    if kl:
        mid = statistics.median(kl.values())
        c = out["mismatch"]
        c.looked, c.median = len(kl), mid
        c.largest = max((v, s) for s, v in kl.items())
        if mid > bound:
            c.failures.append((min(kl, key=lambda s: abs(kl[s] - mid)), None,
                               f"median KL {mid:.3g} over {len(kl)} steps > {bound:.3g}"))
    return out


def _look(c: Check, step: int, sample: int | None, holds: bool, what) -> None:
    c.looked += 1
    if not holds:
        c.failures.append((step, sample, what()))


def _first_diff(a: list, b: list) -> str:
    if len(a) != len(b):
        return f"{len(a)} ids trained, {len(b)} sampled"
    t = next(t for t in range(len(a)) if a[t] != b[t])
    return f"token {t}: {a[t]} trained, {b[t]} sampled"


def bound(run_dir: Path, recipe: dict) -> tuple[float, bool, str]:
    """What the run's precision allows of the median step's KL(μ‖π_old), whether it is a k3 figure (the
    doctor's) or k1 (the guard's), and where it comes from."""
    precision = recipe.get("rollout", {}).get("precision", "bf16")
    for report in sorted((run_dir.parent.parent / "doctor").glob("doctor-*.json"), reverse=True):
        try:
            kl = json.loads(report.read_text())["figures"][f"kl/{precision}"]["mean"]
        except (ValueError, KeyError, TypeError):
            continue
        return max(10 * kl, 1e-9), True, f"10 × the doctor's KL at {precision}, {kl:.2g} (k3; {report.name})"
    max_kl = recipe.get("guard", {}).get("max_kl", 0.05)
    return max_kl, False, (f"the guard's max_kl {max_kl:g} (k1): no `minirl doctor` report in the workspace, whose "
                           f"figure at {precision} would bound it closer")
