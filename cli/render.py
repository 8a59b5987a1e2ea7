"""Rich rendering for `minirl run`: a progress bar with a live table of the latest metrics."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from minirl.disk.store import SUMMARY
from minirl.setup.plan import HEADROOM, HOST_LINK_BYTES_S

# not on a terminal (a log, a pipe): lines are not broken at rich's default 80 columns mid-phrase
console = Console(stderr=False, highlight=False, soft_wrap=not sys.stdout.isatty())

SET_HELP = "Override a recipe value, e.g. --set train.lr=1e-4 (repeatable). Keys are [section].key of the TOML recipe."

def _tokens(row: dict) -> str:
    """The tokens the loss trained on; "trained/sampled" where it dropped any (non-finite log μ)."""
    trained, sampled = row.get("loss/tokens"), row.get("rollout/resp_tokens")
    if trained is None:
        return "-"
    if sampled is None or trained >= sampled:
        return _si(trained)
    return f"[bold red]{_si(trained)}/{_si(sampled)}[/]"


def _si(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:,.0f}"


# (metrics key, title, format: a str.format pattern, or a function of the whole row)
LIVE_KEYS = [
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/acc", "acc", "{:.3f}"),
    ("train/entropy", "entropy", "{:.3f}"),
    ("train/kl_mu_pi_old", "KL(μ‖π_old)", "{:.2e}"),  # k1, the paper's estimator: can read below 0 (doctor: k3)
    ("loss/is_weight_mean", "IS mean", "{:.3f}"),
    ("loss/is_weight_max", "IS max", "{:.2f}"),
    ("loss/clip_frac", "clip", "{:.3f}"),
    ("rollout/resp_len", "len", "{:.1f}"),
    ("loss/tokens", "tokens", _tokens),  # trained on, of those sampled (#72: never fewer in silence)
    ("rollout/logp_nonfinite_frac", "log μ NaN", "{:.1%}"),
    ("sync/parity_abs_dlogp", "parity", "{:.1e}"),  # |Δ log p| vLLM vs trainer after the last checked sync
]
# a run with rollout.max_staleness ≥ 1 writes these too: how many updates behind its batch was, what
# is ahead, and the shares of the wall time the engine had nothing to do and the trainer waited on it
ASYNC_KEYS = [("rollout/staleness_mean", "stale", "{:.2f}"), ("rollout/batches_ahead", "ahead", "{:d}"),
              ("timing/engine_idle_frac", "engine idle", "{:.0%}"), ("timing/trainer_idle_frac", "trainer idle", "{:.0%}")]
# a multi-turn run (env.name) writes these too: engine calls and tool calls per episode, the environment's
# faults, and the episodes they ended (left out of the loss)
EPISODE_KEYS = [("episode/turns", "turns", "{:.2f}"), ("episode/tool_calls", "calls", "{:.2f}"),
                ("episode/env_errors", "env errors", "{:d}"), ("episode/masked", "masked", "{:d}")]
CELL = 24  # the widest "title value" cell, and its gap: a grid of width // CELL columns


def live_keys(row: dict) -> list[tuple[str, str, object]]:
    """The cells of a run's live table: its staleness too where the run samples ahead, its episodes' where
    it runs an environment."""
    return (LIVE_KEYS + (ASYNC_KEYS if "rollout/staleness_mean" in row else [])
            + (EPISODE_KEYS if "episode/turns" in row else []))


def metrics_grid(row: dict, width: int):
    """A row's metrics as "title value" cells, as many a line as `width` holds (80 columns: 3)."""
    grid = Table.grid(padding=(0, 2))
    cells = [f"[dim]{title}[/] {_fmt(row.get(k), f, row)}" for k, title, f in live_keys(row)]
    per_line = max(1, min(len(cells), width // CELL))
    for _ in range(per_line):
        grid.add_column()
    for i in range(0, len(cells), per_line):
        grid.add_row(*cells[i : i + per_line])
    return grid


class RunView:
    def __init__(self, console: Console, *, total_steps: int, eval_key: str):
        self.console, self.eval_key = console, eval_key
        self.progress = Progress(TextColumn("RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), console=console)
        self.task = self.progress.add_task("rl", total=total_steps)
        self.last: dict = {}
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> "RunView":
        return self  # the live view starts with the run ("start"), after every input check passed

    def __exit__(self, *exc) -> None:
        if self.live.is_started:
            self.live.__exit__(*exc)

    def _render(self):
        if not self.last:
            return self.progress
        return Group(self.progress, metrics_grid(self.last, self.console.width))

    def on_event(self, kind: str, data: dict) -> None:
        if kind == "start":
            self.live.start()
            what = f"resumed at step {data['step']} from {data['resumed_from']}" if data["resumed_from"] else "new run"
            skipped = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in data["skipped_rows"].items() if n)
            self.console.print(f"[bold]{what}[/] in {data['run_dir']} (engines up in {data['startup_s']} s; "
                               f"{data['train_rows']:,} train prompts{'; skipped ' + skipped if skipped else ''})")
            parts = data.get("startup_parts") or {}
            if parts:
                self.console.print("start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
                                   + " (compile and graphs are within engine)" * ("compile" in parts))
            cache = data.get("engine_cache")
            if cache:
                self.console.print(f"vLLM compile cache: {'reused' if cache['reused'] else 'filled'} {cache['path']}"
                                   + ("" if cache["reused"] else " (the next run or eval of this model reuses it)"))
            changes = data.get("recipe_changes") or {}
            if changes:
                self.console.print("[yellow]the run's recipe changed as it resumed[/] (recorded in "
                                   "recipe_changes.jsonl): " + ", ".join(f"{k} {a!r} → {b!r}" for k, (a, b) in changes.items()))
            # the bar's clock starts here, not when the view was made, before the engine's start
            self.progress.reset(self.task, completed=data["step"])
        elif kind == "eval":
            if data["which"] == "start":  # off the RL clock, as the summary's "time: rl" counts it
                self.progress.reset(self.task, completed=self.progress.tasks[0].completed)  # the one task
            self.console.print(f"held-out {data['which']}: {self.eval_key} = [bold]{data[self.eval_key]:.3f}[/] "
                               f"over {data['problems']} problems (T={data['temperature']})")
        elif kind == "step":
            if "sync/parity_abs_dlogp" not in data:  # not checked this step: show the last check
                data = {**data, "sync/parity_abs_dlogp": self.last.get("sync/parity_abs_dlogp")}
            self.last = data
            self.progress.update(self.task, completed=data["step"])
        elif kind == "guard":
            what = {"rollback": f"rolled back to {data['to']} (lr now {data['lr']:.2e})",
                    "stop": "stopping: rollbacks used up", "skip": "skipped the update"}[data["action"]]
            self.console.print(f"[bold red]guard[/] step {data['step']}: {data['reason']}; {what}")
        elif kind == "warning":
            self.console.print(f"[bold yellow]warning:[/] {data['text']}")
        elif kind == "note":
            self.console.print(f"[dim]{data['text']}[/]")
        elif kind == "checkpoint":
            self.console.print(f"[dim]checkpoint step {data['step']}: {data['path']}[/]")
        self.live.update(self._render())

    def print_summary(self, s: dict) -> None:
        h = s["heldout"]
        key = h["metric"]
        self.console.print()
        table = Table(title=f"run summary ({s['status']})")
        table.add_column("")
        table.add_column("value", justify="right")
        table.add_row("steps", str(s["steps"]))
        table.add_row("wall time", f"{s['wall_s']:.0f} s")
        table.add_row(f"held-out {key}, cold start", f"{h['start'][key]:.3f}")
        if h["end"]:
            table.add_row(f"held-out {key}, after RL", f"{h['end'][key]:.3f}")
            table.add_row("gain", f"{h['gain_points']:+.1f} points")
        else:
            table.add_row(f"held-out {key}, after RL", "at the run's end (--resume)")
        for k, v in s["phases_s"].items():
            table.add_row(f"time: {k}", f"{v:.1f} s")
        self.console.print(table)
        self.console.print(f"summary: {Path(s['run_dir']) / SUMMARY}")
        hf = f"HF folder: {s['hf_folder']}" if s["hf_folder"] else "HF folder: `minirl export`, or at the run's end"
        self.console.print(f"checkpoint: {s['checkpoint']}  ({hf})")
        if "plot" in s:
            self.console.print(f"plot: {s['plot']}")


def _fmt(v, f, row: dict | None = None) -> str:
    if callable(f):
        return f(row or {})
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f.format(v)


def print_plan(console: Console, plan, *, recipe: str, resolved: str, launch: list[str], advice=()) -> None:
    """`minirl run --dry-run`: the resolved recipe (defaults < recipe < flags) as the TOML a run
    would record, then the plan as tables (figures per GPU)."""
    console.print(f"[bold]resolved recipe[/] (defaults < {recipe} < flags; what runs/<id>/recipe.toml would hold)")
    console.print(resolved, markup=False, highlight=False, soft_wrap=True)
    s = plan.shape
    kind = f"MoE, {s.num_experts} experts, top-{s.top_k}" if s.is_moe else "dense"
    console.print(f"[bold]plan[/] for {plan.model} ({kind}; recipe: {recipe})")
    console.print(f"  parameters {plan.params / 1e9:.2f}B total, {plan.active / 1e9:.2f}B active per token; "
                  f"{s.n_layers} layers, dim {s.dim}, vocab {s.vocab_size}")
    if plan.adapters:
        console.print(f"  LoRA: {plan.adapters / 1e6:,.1f}M adapter parameters train "
                      f"({plan.adapters / plan.params:.2%} of the model); the base is frozen")
    console.print(f"  mesh: {plan.nodes} node(s) × {plan.gpus_per_node} GPU(s) of {plan.gpu_gib:g} GiB; "
                  + ", ".join(f"{k} {v}" for k, v in plan.mesh.items()))
    chosen = ("" if not plan.micro_batch_chosen else " (the plan's: the largest with which every phase fits)"
              if plan.fits else " (the plan's: none fits, so the whole mini-batch)")
    console.print(f"  tokens per step ≤ {plan.tokens_per_step:,} (prompt + max response, or episode with its replies); micro-batch "
                  f"{plan.micro_batch_tokens:,} tokens per GPU{chosen}; the trainer computes "
                  + ("in one process under bf16 autocast" if plan.trainer_path == "one process"
                     else "under FSDP2 in bf16 parameters"))
    draws = plan.rollout_draws_max
    console.print(f"  FLOPs per step: training {plan.train_flops_per_step:.3g} (π_old + update), rollout "
                  f"{plan.rollout_flops_per_step:.3g}"
                  + (f", up to {draws * plan.rollout_flops_per_step:.3g} with dynamic sampling's {draws - 1} extra "
                     "draw(s)" if draws > 1 else ""))
    table = Table(title="memory per GPU" + (" (a training GPU; \"rollout GPU:\" a rollout GPU's)" if plan.rollout_gpus
                                             else ""), box=None)
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for k, v in plan.memory_gib.items():
        table.add_row(k, f"{v:.2f}")
    for k, v in plan.phases_gib.items():
        table.add_row(f"[bold]peak: {k}[/]", f"[bold]{v:.2f}[/]")
    console.print(table)
    what = {0: "stays awake", 1: "sleeps at level 1 (weights to host memory, KV cache dropped)",
            2: "sleeps at level 2 (weights and KV cache dropped, reloaded by each sync)"}[plan.sleep_level]
    console.print(f"  while the trainer trains the engine {what}: "
                  + (f"the plan's (rollout.sleep_level = -1): {plan.sleep_why}" if plan.sleep_chosen
                     else f"rollout.sleep_level = {plan.sleep_level}"), soft_wrap=True)
    console.print(f"  vLLM: {plan.in_flight} full-length sequences in flight per engine, "
                  f"{plan.sequences_per_engine} to sample per step"
                  + (f" (up to {draws * plan.sequences_per_engine:,} with dynamic sampling, a draw at a time)"
                     if draws > 1 else "") + f"; KV cache {plan.kv_sizing}")
    if plan.rollout_gpus:
        console.print(f"  vLLM's start: gpu_memory_utilization {plan.engine_fraction:g} "
                      f"({plan.engine_fraction * plan.gpu_gib:.1f} GiB of each rollout GPU), alone on its GPU(s): "
                      f"{plan.engine_start_free_gib:.1f} GiB within {HEADROOM:.0%}, the weight broadcast's bucket "
                      "beside it")
    else:
        console.print(f"  vLLM's start: gpu_memory_utilization {plan.engine_fraction:g} "
                      f"({plan.engine_fraction * plan.gpu_gib:.1f} GiB of each GPU), beside the trainer's state between "
                      f"updates: {plan.engine_start_free_gib:.1f} GiB free then, within {HEADROOM:.0%}")
    parts = ", ".join(f"{k} {v:.1f}" for k, v in plan.host_gib.items() if k != "peak")
    console.print(f"  host memory per node: {plan.host_gib_per_node:.1f} GiB at its peak ({parts} GiB)"
                  + (f"; Adam's moments cross the host link in ~{plan.offload_s_per_step:.1f} s a step "
                     f"(at {HOST_LINK_BYTES_S / 1e9:g} GB/s a GPU, an assumption)" if plan.offload_s_per_step else ""))
    for cmd in launch:
        console.print(f"  launch: {cmd}", soft_wrap=True)
    for p in plan.problems:
        console.print(f"  [bold red]does not fit:[/] {p}", soft_wrap=True)
    for i, a in enumerate(advice):
        console.print(f"  [bold]{'cheapest change that fits' if i == 0 else 'training every weight'}:[/] {a}",
                      soft_wrap=True)


STATUS_COLORS = {"running": "green", "finished": "green", "interrupted": "yellow", "time_limit": "yellow",
                 "killed": "red", "collapsed": "red", "engine_fault": "red", "grader_fault": "red",
                 "env_fault": "red"}


def status_view(st, width: int = 80) -> Group:
    """`minirl status`: the run's state line, its last metrics, held-out figures and guard events."""
    color = "red" if st.state.startswith("failed start") else STATUS_COLORS.get(st.state, "cyan")
    pace = []
    if st.steps_per_s:
        pace.append(f"{st.steps_per_s:.2f} steps/s")
    if st.eta_s is not None:
        pace.append(f"eta {_duration(st.eta_s)}")
    head = Table.grid(padding=(0, 2))
    head.add_row(f"[bold]{st.run_dir.name}[/]", f"[bold {color}]{st.state}[/]",
                 f"step {st.step}/{st.total_steps}", *pace)
    parts = [head]
    if st.last:
        parity = {"sync/parity_abs_dlogp": st.parity} if st.parity is not None else {}
        parts.append(metrics_grid({**st.last, **parity}, width))
    if st.error:
        parts.append(f"[bold red]stopped:[/] {st.error}")
    if st.damaged:
        parts.append(f"[yellow]damaged, read without it:[/] {st.damaged}")
    h = st.heldout
    if h.get("start"):
        metric = h.get("metric") or next(k for k in h["start"] if k.startswith("avg@"))
        end = f" → {h['end'][metric]:.3f}" if h.get("end") else ""
        parts.append(f"held-out {metric}: {h['start'][metric]:.3f}{end}")
    for rb in st.rollbacks:
        back = f", back to step {rb['back_to']}" if rb["back_to"] is not None else ""
        parts.append(f"[red]rollback at step {rb['step']}[/]: {rb['reason']}{back}")
    if st.skipped:
        parts.append(f"[yellow]skipped updates[/] at steps {', '.join(map(str, st.skipped))}")
    if st.ahead:
        a, n = st.ahead, max(1, sum(st.ahead["tokens_behind"]))
        shares = ", ".join(f"{i}: {c / n:.0%}" for i, c in enumerate(a["tokens_behind"]))
        waits = f"; the trainer waited {a['trainer_wait_s']:.1f} s on the engine" if a.get("trainer_wait_s") else ""
        parts.append(f"sampling ahead, k = {a['k']}: trained tokens by updates behind {shares}; idle on average: "
                     f"engine {a['engine_idle']:.0%}, trainer {a['trainer_idle']:.0%}{waits}")
    if st.preempted or st.regenerated:
        again = f"; {st.regenerated} R3 sample(s) drawn again, their routes recomputed" if st.regenerated else ""
        parts.append(f"[yellow]preempted[/] {st.preempted} request(s): the engine's KV cache ran short{again}")
    if st.newest_checkpoint is not None:
        parts.append(f"newest checkpoint: {st.newest_checkpoint}")
    return Group(*parts)


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
