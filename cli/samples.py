"""`minirl samples`: what the model wrote, shaped for a person: a run's (minirl/run/samples.py keeps a
few groups a step) or an evaluation's (minirl/eval/bench.py keeps every response)."""

from __future__ import annotations

import re
from pathlib import Path

import click
from rich.console import Group
from rich.panel import Panel
from rich.rule import Rule
from rich.text import Text

from cli.options import workspace_argument
from cli.render import console
from minirl.data.written import records, text_of
from minirl.errors import UsageError
from minirl.run import samples as samples_mod
from minirl.run import status as status_mod

SHOWN = 16  # responses a search, a sort, a filter or an evaluation shows at most unless -n says otherwise


def _run_records(path: Path, step: int | None, scan: bool) -> list[dict]:
    """A run's records asked for: a step's, every step's (a search over the run), or the newest step's."""
    if step is not None:
        got = [r for r in records(path) if r["step"] == step]
        if not got:
            steps = sorted({r["step"] for r in records(path)})
            have = f"steps {steps[0]}…{steps[-1]} have some" if steps else "it holds none"
            raise UsageError(f"no samples of step {step} in {path} ({have})")
        return got
    return list(records(path)) if scan else samples_mod.newest(path)


def _eval_file(workspace: Path, name: str) -> Path:
    """An evaluation's samples file: given (or its results file), or the newest of benchmark `name` in
    WORKSPACE/evals."""
    given = Path(name)
    if given.suffix == ".json" and given.with_suffix(".samples.jsonl").is_file():
        return given.with_suffix(".samples.jsonl")
    if given.is_file():
        return given
    found = sorted((workspace / "evals").glob(f"{name}-k*.samples.jsonl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"no responses of an evaluation {name!r} in {workspace / 'evals'} (`minirl eval {name} "
                         f"{workspace}` keeps them; or give the .samples.jsonl file)")
    return found[-1]


def _head(r: dict) -> tuple[tuple, str, str]:
    """(key, title, text) of what a response answers: a run's group (its prompt) or an evaluation's problem."""
    if "step" in r:
        left = "" if r.get("trained", True) else " · left out by dynamic sampling"
        return (r["step"], r["group"]), f"step {r['step']} · group {r['group']}{left}", r["prompt"]
    return (r["index"],), f"problem {r['index']} · answer {r['answer']}", r["problem"]


def _responses(recs: list[dict], *, cut: bool, grep: str | None, order: str | None) -> list[tuple[dict, int, dict]]:
    out = [(r, j, x) for r in recs for j, x in enumerate(r["responses"])]
    if cut:
        out = [t for t in out if t[2].get("finish") == "length"]
    if grep:
        needle = grep.lower()
        out = [t for t in out if needle in text_of(t[2]).lower() or needle in _head(t[0])[2].lower()]
    if order:
        out.sort(key=lambda t: _worth(t[2]), reverse=order == "best")
    return out


def _worth(x: dict) -> float:
    """What --best and --worst order by: a training sample's reward, an evaluation's grade."""
    if "reward" in x:
        return x["reward"] or 0.0
    return float(bool(x.get("correct")))


def _body(resp: dict, calls: list | None) -> Group | Text:
    """A response's text: reasoning dimmed, an episode's turns with the environment's replies set apart,
    calls marked."""
    def marked(text: str) -> Text:
        t = Text(text)
        t.highlight_regex(r"<think>[\s\S]*?(</think>|$)", "dim italic")  # reasoning set apart from the answer
        if calls:
            t.highlight_regex(re.escape(calls[0]) + r"[\s\S]*?" + re.escape(calls[1]), "bold magenta")
        return t

    if "turns" not in resp:
        return marked(resp.get("text", ""))
    parts = []
    for turn in resp["turns"]:
        if turn["by"] == "model":
            parts += [Text("model", style="bold green"), marked(turn["text"])]
        else:
            parts += [Text("environment", style="bold cyan"), Text(turn["text"], style="cyan")]
    return Group(*parts)


def _facts(x: dict) -> str:
    if "reward" in x:  # a training sample
        adv = "—" if x.get("adv") is None else f"{x['adv']:+.3f}"
        score = "not graded" if x.get("score") is None else f"{x['score']:g}"
        bits = [f"score {score}", f"reward {x['reward']:.3g}", f"advantage {adv}"]
    else:  # an evaluation's
        bits = ["not scored (the environment's fault)" if x.get("correct") is None else
                "correct" if x["correct"] else "wrong"]
    cut = " (length cut)" if x.get("finish") == "length" else ""
    bits += [x.get("finish", "?") + cut, f"{x.get('tokens')} tokens"]
    if x.get("behind"):
        bits.append(f"{x['behind']} behind")
    if not x.get("trained", True):
        bits.append("not trained")
    e = x.get("episode")
    if e:
        bits.append(f"{e['turns']} turns, {e['tool_calls']} calls ({e['tool_errors']} errors), ended {e['ended']}"
                    + (f": {e['fault']}" if e.get("fault") else ""))
    g = x.get("grader") or {}
    if "extracted" in g:
        bits.append("no answer found" if g["extracted"] is None else f"answer {g['extracted']!r}")
    bits += [f"{k} {g[k]}" for k in ("verdict", "error", "why") if g.get(k)]
    return " · ".join(bits)


def _color(x: dict) -> str:
    right = x.get("score") if "reward" in x else x.get("correct")
    return "yellow" if right is None else "green" if right >= 1 else "red"


def show(chosen: list[tuple[dict, int, dict]], *, width: int) -> None:
    last = None
    for r, j, x in chosen:
        key, title, text = _head(r)
        if key != last:
            last = key
            console.print(Rule(title))
            console.print(Text(text, style="dim"))
        console.print(Panel(Group(Text(_facts(x), style="bold"), _body(x, r.get("calls"))), title=f"response {j}",
                            title_align="left", border_style=_color(x), width=min(width, 120)),
                      soft_wrap=False)  # wrapped inside the panel even when piped (the console's soft wrap crops it)


@click.command("samples")
@workspace_argument
@click.option("--run", "run_name", default=None, help="A run folder's name under WORKSPACE/runs [default: the newest].")
@click.option("--step", type=click.IntRange(min=0), default=None, help="A step's samples [default: the newest step's].")
@click.option("--eval", "eval_name", default=None, metavar="BENCH|FILE",
              help="An evaluation's responses instead: the newest of BENCH in WORKSPACE/evals, or its file.")
@click.option("--best", "order", flag_value="best", default=None, help="The highest rewards (evaluations: the correct "
                                                                       "responses) first.")
@click.option("--worst", "order", flag_value="worst", help="The lowest rewards (evaluations: the wrong ones) first.")
@click.option("--cut", is_flag=True, help="Only responses the length limit cut.")
@click.option("--grep", default=None, help="Only responses (or prompts) holding this text (any case).")
@click.option("-n", "most", type=click.IntRange(min=1), default=None,
              help=f"Show at most this many responses [default: a step's all; {SHOWN} otherwise].")
def samples_cmd(workspace: Path, run_name: str | None, step: int | None, eval_name: str | None, order: str | None,
                cut: bool, grep: str | None, most: int | None) -> None:
    """What the model wrote: a run's prompts and responses (a few groups a step, recipe:
    metrics.samples_groups), each with its score, reward, advantage, how it finished and whether it
    trained; an episode as its turns, the environment's replies set apart and tool calls marked. With
    --eval, an evaluation's responses, each with its grade and the answer the grader found."""
    searching = bool(order or cut or grep)
    if eval_name is not None:
        if step is not None or run_name is not None:
            raise UsageError("--eval shows an evaluation's responses: --step and --run are a run's")
        path = _eval_file(workspace, eval_name)
        recs, limit = list(records(path, key="index")), most or SHOWN
    else:
        run_dir = status_mod.run_dir_of(workspace, run_name)
        path = run_dir / samples_mod.FILE
        if not path.is_file():
            raise UsageError(f"no samples in {run_dir} (a run from before minirl kept them, or one with "
                             "metrics.samples_groups = 0)")
        recs = _run_records(path, step, scan=searching)
        limit = most or (SHOWN if searching else None)
    chosen = _responses(recs, cut=cut, grep=grep, order=order)
    if not chosen:
        console.print(f"no responses match in {path}" if recs else f"{path} holds no samples yet")
        return
    show(chosen[:limit] if limit else chosen, width=console.width)
    if limit and len(chosen) > limit:
        console.print(f"[dim]{len(chosen) - limit} more match (-n to show more)[/]")
