"""The GPU check's report: outcomes.jsonl and figures.jsonl (conftest.py, kit.record) and
bench.json (bench.py) in DIR become DIR/report.json and DIR/report.md.

    python tests/gpu/report.py DIR              the trainer's half (its bench is part of it)
    python tests/gpu/report.py DIR --no-bench   the rollout half (run-on-device.sh --vllm), no bench
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main(folder: Path, *, bench_expected: bool = True) -> int:
    root = Path(__file__).resolve().parents[2]
    commit = os.environ.get("MINIRL_GPU_COMMIT", "")  # a copied checkout's git may not be the one run
    try:
        commit = commit or subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    outcomes = _jsonl(folder / "outcomes.jsonl")
    figures = _jsonl(folder / "figures.jsonl")
    bench = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").exists() else None
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    report = {"commit": commit or "unknown (no git)", "counts": counts, "tests": outcomes, "figures": figures,
              "bench": bench}
    (folder / "report.json").write_text(json.dumps(report, indent=2, default=str))

    machine = (bench or {}).get("machine") or next((f for f in figures if f["name"] == "machine"), {})
    machine = {k: v for k, v in machine.items() if k != "name"}
    image = folder / "image.json"  # the first piece's check of the image (run-on-device.sh --piece 1)
    half = "trainer" if bench_expected else "rollout (vLLM)"
    md = [f"# GPU check, {half} half, commit {report['commit']}", "",
          "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
          "tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "",
          "| test | outcome | s | why |", "|---|---|---|---|"]
    md += [f"| `{o['test'].split('::', 1)[-1]}` | {o['outcome']} | {o['seconds']} | {o['reason'][:160]} |"
           for o in outcomes]
    if figures:
        md += ["", "## Figures", ""]
        for f in figures:
            md.append(f"- **{f['name']}**: " + ", ".join(f"{k} {_fmt(v)}" for k, v in f.items()
                                                         if k != "name" and not isinstance(v, dict)))
    if bench:
        md += ["", f"## Bench: {bench['rows']} rows, {bench['tokens']} tokens a step (padded to {bench['padded_len']})",
               "", "| path | step | ms/step | tokens/s | TFLOP/s | MFU | peak GiB |", "|---|---|---|---|---|---|---|"]
        for r in bench["results"]:
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
            md.append(f"| {r['path']} | {r['mode']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                      f"{r['tflops_per_s']:.1f} | {mfu} | {peak} |")
        for mode, ks in bench.get("top_kernels", {}).items():
            md += ["", f"Top kernels, one-gpu {mode} step:", "", "| ms | share | calls | kernel |", "|---|---|---|---|"]
            md += [f"| {k['ms']:.2f} | {k['share']:.1%} | {k['calls']} | `{k['name']}` |" for k in ks]
    if image.exists():
        rows = json.loads(image.read_text())["requirements"]
        md += ["", "## The image against vLLM's requirements", ""]
        for state in ("other version", "missing"):
            md.append(f"- {state}: " + (", ".join(f"{r['requirement']} (image {r['image']})" if r["image"] else
                                                  r["requirement"] for r in rows if r["state"] == state) or "none"))
    (folder / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 1 if counts.get("failed") or (bench is None and bench_expected) or not outcomes else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), bench_expected="--no-bench" not in sys.argv[2:]))
