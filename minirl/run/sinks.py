"""Where each step's metrics go besides `metrics.jsonl`: TensorBoard and Weights & Biases.

Chosen in the recipe's [metrics] section. Every number of a metrics row goes to each sink under
its own namespaced name (`rollout/…`, `train/…`, `loss/…`, `timing/…`, `guard/…`, `sync/…`) at
its step; lists (per-mini-batch values) and strings stay in the JSONL. The recipe is the run's
config, the summary its summary, and the guard's rollbacks and skipped updates are events: a text
entry under `guard/events` in TensorBoard, a row of the `guard/events` table in W&B. A step's samples
(samples.py) are a text entry under `samples` in TensorBoard and the `samples` table in W&B (a row a response).

The writers are the libraries' own: torch's `SummaryWriter` (TorchTitan's `TensorBoardLogger`
wraps the same writer but cannot purge the steps a resumed run redoes) and `wandb.init/log`
(TorchTitan's `WandBLogger` takes project, name and tags from environment variables only). W&B
honours `WANDB_MODE` (offline runs write `wandb/offline-run-*` in the run folder, with no network).

A resumed run (after a rollback-free restart, `--resume`) continues the same TensorBoard folder,
purging events past the checkpoint it resumed from, and the same W&B run (`resume="allow"`, id
from the run folder); W&B keeps the first value it got for a step, so steps redone after a kill
show their first attempt there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from minirl.run import samples


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row (not `step`, not lists, not strings), as floats."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def event_text(row: dict[str, Any]) -> str | None:
    """One line for a guard action (rollback, stop, skip) in this row, else None."""
    action = row.get("guard/action")
    if not action or action == "step":
        return None
    back = f"; back to step {row['guard/rollback_to_step']}" if "guard/rollback_to_step" in row else ""
    return f"step {row['step']}: {action} ({row.get('guard/reason') or 'no reason given'}){back}"


class Sinks:
    """The enabled sinks of one run; `log` a row per step, `close` with the summary."""

    def __init__(self, cfg, *, run_dir: Path, recipe: dict, resumed_at: int | None = None):
        self.tb = self.wandb_run = None
        self.events: list[list] = []
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), max_queue=1000,
                                    purge_step=resumed_at + 1 if resumed_at is not None else None)
            if resumed_at is None:
                self.tb.add_text("recipe", "```\n" + json.dumps(recipe, indent=1) + "\n```", 0)
        if cfg.wandb:
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.wandb_project, entity=cfg.wandb_entity or None, name=cfg.wandb_name or run_dir.name,
                tags=[t.strip() for t in cfg.wandb_tags.split(",") if t.strip()], config=recipe,
                dir=str(run_dir), id=f"minirl-{run_dir.name}", resume="allow",
                settings=wandb.Settings(silent=True, console="off"),
            )

    def log(self, row: dict[str, Any], sample_records: list[dict] = ()) -> None:
        step, values = int(row["step"]), scalars(row)
        text = event_text(row)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            if text:
                self.tb.add_text("guard/events", text, step)
            if sample_records:
                self.tb.add_text("samples", samples.markdown(sample_records), step)
            self.tb.flush()  # a killed run keeps every step it logged, as metrics.jsonl does
        if self.wandb_run is not None:
            import wandb

            extra = {}
            if text:
                self.events.append([step, row["guard/action"], row.get("guard/reason") or "",
                                    row.get("guard/rollback_to_step", -1)])
                extra["guard/events"] = wandb.Table(columns=["step", "action", "reason", "back_to_step"],
                                                    data=list(self.events))
            if sample_records:
                table = samples.flat(sample_records)
                extra["samples"] = wandb.Table(columns=list(table[0]), data=[list(r.values()) for r in table])
            self.wandb_run.log({**values, **extra}, step=step)

    def close(self, summary: dict | None = None) -> None:
        if self.tb is not None:
            if summary:
                self.tb.add_text("summary", "```\n" + json.dumps(summary, indent=1) + "\n```",
                                 int(summary.get("steps", 0)))
            self.tb.close()
        if self.wandb_run is not None:
            if summary:
                self.wandb_run.summary.update(_flat(summary))
            self.wandb_run.finish()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif not (isinstance(v, float) and math.isnan(v)):
            out[key] = v
    return out
