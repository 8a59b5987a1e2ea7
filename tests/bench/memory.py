"""Benchmark: where the memory of `minirl run` goes. Prints figures, asserts nothing.

    .venv/bin/python tests/bench/memory.py WORKSPACE [--steps 300] [--set KEY=VALUE ...]

One process runs the real run (`minirl.run.lifecycle.run`, as `minirl run WORKSPACE` does, on a copy
of the workspace) and reads its own resident memory (/proc/self/status: VmRSS now, VmHWM the
peak) at each phase: the interpreter, the libraries imported, the data and tokenizer, the
trainer's model, the vLLM engine (its KV cache counted apart, from the cache's own tensors), the
first update (Adam's moments and the gradients), and the steps and held-out evaluations after
(their transient peak above the steady state, and the growth of the steady state itself).
The peak of the whole process is what `/usr/bin/time -v` calls the maximum resident set size.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def status() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = int(value.split()[0]) / 1024
    return got["VmRSS"], got["VmHWM"]


def reset_peak() -> None:
    """VmHWM back to VmRSS (Linux ≥ 4.0), so the next reading is the peak of what follows."""
    Path("/proc/self/clear_refs").write_text("5")


class Phases:
    def __init__(self):
        self.rows: list[tuple[str, float, float]] = []  # (phase, RSS after, peak during)
        self.last = status()[0]

    def mark(self, name: str) -> None:
        rss, hwm = status()
        self.rows.append((name, rss, hwm))
        self.last = rss
        reset_peak()


def main() -> None:
    import argparse
    import shutil
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    from cli.main import _prepare_env

    _prepare_env(verbose=False)  # the CLI's settings before torch loads (threads, caches; not `run`'s longer spin)
    reset_peak()
    ph = Phases()
    ph.mark("the interpreter")
    import torch  # noqa: F401

    ph.mark("import torch")
    import transformers  # noqa: F401
    import vllm  # noqa: F401

    from minirl.config import recipes
    from minirl.run import lifecycle, loop
    from minirl.setup.workspace import Workspace

    ph.mark("import vLLM, transformers, TorchTitan, minirl")

    kv_bytes = {}
    prepare, trainer_from, rollouts_from = lifecycle.prepare_run, loop.Trainer.from_recipe, loop.Rollouts.from_recipe

    def prepare_run(*args, **kw):
        out = prepare(*args, **kw)
        ph.mark("data, tokenizer, grader")
        return out

    def trainer(*args, **kw):
        out = trainer_from(*args, **kw)
        ph.mark("trainer: the model")
        return out

    def rollouts(*args, **kw):
        out = rollouts_from(*args, **kw)
        engine = out._engine
        kv_bytes["kv"] = sum(engine._llm.collective_rpc(_kv_cache_bytes))
        ph.mark("vLLM engine (weights, KV cache, buffers) and the first sync")
        return out

    lifecycle.prepare_run = prepare_run
    loop.Trainer.from_recipe = staticmethod(trainer)
    loop.Rollouts.from_recipe = staticmethod(rollouts)

    steps = {"n": 0}

    def on_event(kind: str, data: dict) -> None:
        if kind == "eval" and steps["n"] == 0:
            ph.mark("held-out evaluation at the start")
        elif kind == "step":
            steps["n"] += 1
            if steps["n"] == 1:
                ph.mark("step 1 (Adam's moments, gradients)")
        elif kind == "done":
            ph.mark(f"steps 2-{steps['n']} and the held-out evaluation at the end")

    with tempfile.TemporaryDirectory() as tmp:
        ws_dir = Path(tmp) / "ws"
        shutil.copytree(a.workspace, ws_dir, ignore=shutil.ignore_patterns("runs", "evals", "doctor", "lab"))
        ws = Workspace.open(ws_dir)
        rec = recipes.load(ws.recipe_path, [f"train.steps={a.steps}", *a.sets])
        t0 = time.time()
        summary = lifecycle.run(ws, rec, on_event=on_event)
        wall = time.time() - t0

    print(f"{'phase':62s} {'RSS after':>10s} {'added':>9s} {'peak in it':>11s}   (MiB)")
    before = 0.0
    for name, rss, hwm in ph.rows:
        print(f"{name:62s} {rss:10.0f} {rss - before:+9.0f} {hwm:11.0f}")
        before = rss
    peak = max(h for _, _, h in ph.rows)
    print(f"{'  of the engine row: its KV cache':62s} {'':10s} {kv_bytes['kv'] / 2**20:+9.0f}")
    metric = summary["heldout"]["metric"]
    print(f"peak resident memory of the process: {peak:.0f} MiB ({peak / 1024:.2f} GiB); held-out {metric} "
          f"{summary['heldout']['start'][metric]} -> {summary['heldout']['end'][metric]}; {a.steps} steps in {wall:.0f} s")
    # resident pages of mapped files (the libraries' code) count in RSS as far as the page cache
    # holds them: the same install read 78 or 122 MiB of torch's after `import torch`, fresh from
    # the disk or not; the anonymous part is the process's own
    kinds = {k: int(v.split()[0]) / 1024 for k, _, v in (ln.partition(":") for ln in
             Path("/proc/self/status").read_text().splitlines()) if k in ("RssAnon", "RssFile", "RssShmem")}
    print("of the RSS now: " + ", ".join(f"{k[3:].lower()} {v:.0f} MiB" for k, v in kinds.items()))


def _kv_cache_bytes(worker) -> int:
    """collective_rpc target: bytes of the engine's KV cache tensors."""
    caches = worker.model_runner.kv_caches
    flat = caches if isinstance(caches, list) else list(caches.values())
    seen, total = set(), 0
    for t in flat:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            key = (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total


if __name__ == "__main__":
    main()
