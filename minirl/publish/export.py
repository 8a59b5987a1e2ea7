"""`minirl export`: a run's checkpoint becomes a self-contained Hugging Face model folder with a
model card (`minirl push` then uploads it; hub.py).

    run folder ──▶ which checkpoint (final | --step N | --best among the good ones)
        ──▶ Trainer.load (DCP, any world size) ──▶ TorchTitan → HF names (the state-dict adapter)
        ──▶ safetensors (sharded with an index by huggingface_hub) + config + generation config + tokenizer
        ──▶ training_curves.png (rollbacks marked) ──▶ README.md (huggingface_hub's ModelCard)

A checkpoint is *good* when the guard was healthy when it was written and no later rollback undid
its step (a rollback at step s to the checkpoint of step t undoes the steps t+1..s); `--best`
picks the good one with the best held-out score. Scores come from the run's summary (its start
and final checkpoints), from a previous `--best` (`heldout.json` beside the checkpoint), or are
measured now with the run's own held-out evaluation.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from minirl.config import recipes
from minirl.disk import atomic, store
from minirl.disk.oserrors import os_error_of
from minirl.disk.store import Checkpoint, checkpoints, latest_trained, run_of
from minirl.errors import RunIOError, UsageError
from minirl.eval.evaluate import evaluate
from minirl.models import sizing
from minirl.models.hub import model_dir, repo_id as hub_repo
from minirl.publish.card import known_score, model_card
from minirl.run.plots import plot_metrics
from minirl.setup.preflight import check_checkpoint, check_model_folder
from minirl.setup.run_inputs import prepare_run
from minirl.setup.workspace import RECIPE_NAME, Workspace


def is_source(path: Path) -> bool:
    """A workspace, a run folder or one of its checkpoints: what `pick` exports from, never a folder to write."""
    if (Path(path) / RECIPE_NAME).is_file():
        return True
    try:
        run_of(path)
    except UsageError:
        return False
    return True


def pick(source: Path | None, workspace: Path, *, step: int | None, best: bool,
         progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[Path, Checkpoint, str]:
    """(run folder, checkpoint, why) for a run or checkpoint folder, else the workspace's latest
    run with a checkpoint; the run's checkpoint by `choose`."""
    if best and step is not None:
        raise UsageError("--best and --step choose the checkpoint two ways; give one")
    if source is not None and (Path(source) / RECIPE_NAME).is_file():  # a workspace: its latest run
        source, workspace = None, Path(source)
    if source is not None:
        run_dir, named = run_of(source)
    else:
        ws = Workspace.open(workspace)
        latest = latest_trained(ws)  # a run stopped at step 0 holds the cold start, not an RL policy
        if latest is None:
            raise UsageError(f"no run in {ws.runs} has trained a step yet; run `minirl run` first")
        run_dir = latest.parent.parent
        named = None
    if named is not None:
        ckpt = next(c for c in checkpoints(run_dir) if c.path == named)
        return run_dir, ckpt, f"the checkpoint asked for (step {ckpt.step})"
    metric = f"avg@{recipes.load(run_dir / 'recipe.toml', []).eval.k}"
    ckpt, why = choose(run_dir, step=step, best=best, metric=metric,
                       measure=lambda todo: measure_heldout(run_dir, todo, metric, progress=progress))
    return run_dir, ckpt, why


def choose(run_dir: Path, *, step: int | None, best: bool, metric: str,
           measure: Callable[[list[Checkpoint]], dict[Path, float]]) -> tuple[Checkpoint, str]:
    """The checkpoint to export and one line saying why."""
    ckpts = checkpoints(run_dir)
    if not ckpts:
        raise UsageError(f"run {run_dir} has no complete checkpoint")
    if step is not None:
        match = [c for c in ckpts if c.step == step]
        if not match:
            raise UsageError(f"run {run_dir.name} has no checkpoint of step {step}; it has steps "
                             f"{', '.join(str(c.step) for c in ckpts)}")
        return match[0], f"step {step}, as asked"
    if not best:
        return ckpts[-1], f"the run's newest checkpoint (step {ckpts[-1].step})"
    good = [c for c in ckpts if c.good]
    if not good:
        raise UsageError(f"run {run_dir.name} has no checkpoint the guard marked good")
    scores, sources = {}, {}
    for c in good:
        known = known_score(run_dir, c, metric)
        if known is not None:
            scores[c.path], sources[c.path] = known
    todo = [c for c in good if c.path not in scores]
    if todo:
        for path, value in measure(todo).items():
            scores[path], sources[path] = value, "held-out evaluation measured now"
            store.write_scores(path, {metric: value})
    pick = max(good, key=lambda c: (scores[c.path], c.step))
    table = ", ".join(f"step {c.step}: {scores[c.path]:.3f}" for c in good)
    skipped = len(ckpts) - len(good)
    return pick, (f"best held-out {metric} among {len(good)} good checkpoint(s) ({table}; {skipped} undone or "
                  f"unhealthy skipped); its score: {sources[pick.path]}")


def export(run_dir: Path, out: Path, ckpt: Checkpoint, *, why: str, max_shard_size: int | str = "5GB",
           eval_results: list[dict] | None = None, repo_id: str | None = None, adapter: bool = False) -> Path:
    """Write the HF folder of `ckpt` with its card and curves into `out` (aside, then renamed).
    adapter: a LoRA run's adapters alone, as a PEFT adapter folder for its base model."""
    from minirl.train.trainer import Trainer  # deferred: torch (the CLI imports this module at start)

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty; choose another folder or remove it")
    rec = recipes.load(run_dir / "recipe.toml", [])
    if adapter and not rec.train.lora.rank:
        raise UsageError(f"export --adapter: run {run_dir.name} trained every weight (train.lora.rank = 0), so it has "
                         "no LoRA adapter; export the whole model without --adapter")
    ws_root = run_dir.parent.parent
    base = model_dir(rec.model.id, rec.model.path, ws_root)
    shape = check_model_folder(base)
    check_checkpoint(ckpt.path, shape, rec.model.id)  # a damaged one: one line, nothing written
    trainer = Trainer.for_checkpoint(rec, shape, base)
    trainer.load(ckpt.path, with_optim=False)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(out, e) from None
    with _export_lock(out):
        if out.exists() and any(out.iterdir()):  # written by an export that held the lock before this one
            raise UsageError(f"{out} exists and is not empty; choose another folder or remove it")
        # aside, in a folder of this process's own (#82: two exports shared OUT.tmp, one's cleanup the other's loss)
        tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
        try:
            _write(tmp, run_dir, rec, ckpt, trainer, shape, base, adapter=adapter, why=why, out=out,
                   max_shard_size=max_shard_size, eval_results=eval_results, repo_id=repo_id)
            _move_into(tmp, out)
        except BaseException as e:
            for debris in (tmp, tmp.with_name(tmp.name + ".tmp")):  # a writer's own aside folder too
                shutil.rmtree(debris, ignore_errors=True)
            cause = os_error_of(e, chained=False) if isinstance(e, Exception) else None
            if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RunIOError(f"cannot write {out}: no space left on device; nothing was written (free space, "
                                 "then run the export again)") from None
            if cause is not None:  # any other write the disk refused (read-only, permissions, I/O): one line
                raise RunIOError(f"cannot write {out}: {cause.strerror or cause}; nothing was written") from None
            raise
    return out


@contextlib.contextmanager
def _export_lock(out: Path):
    """One export into `out` at a time: a second is refused in one line while the first writes (an
    flock, released when its process ends however it ends; the file goes with a clean end)."""
    path = out.with_name(f".{out.name}.export-lock")
    try:
        fh = path.open("w")
    except OSError as e:
        raise _unwritable(out, e) from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another export is writing {out}; wait for it, or export elsewhere") from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def _unwritable(out: Path, e: OSError) -> RunIOError:
    """A folder that cannot be made or written (read-only, no permission, /proc): one line, before any work."""
    return RunIOError(f"cannot write {out}: {e.strerror or e} ({e.filename or out.parent}); nothing was written "
                      "(export into a folder you can write)")


def _move_into(tmp: Path, out: Path) -> None:
    """The finished folder into place. An `out` that exists (empty: checked) stays, a mount point
    of a container among them (#82: `rmdir` failed with EBUSY): its files are moved into it."""
    if not out.exists():
        os.replace(tmp, out)
        return
    for f in sorted(tmp.iterdir()):
        shutil.move(str(f), str(out / f.name))
    tmp.rmdir()


def _write(tmp: Path, run_dir: Path, rec, ckpt: Checkpoint, trainer, shape, base: Path, *, adapter: bool, why: str,
           out: Path, max_shard_size, eval_results, repo_id) -> None:
    """The export's folder's files, in `tmp`."""
    from minirl.train.hf_io import save_hf_folder, save_peft_folder  # deferred, as export's: torch
    from minirl.train.lora import adapter_state

    adapter_of = base_name(rec, base) if adapter else None
    if adapter:
        save_peft_folder(tmp, shape, adapter_state(trainer.model), rank=trainer.lora["rank"],
                         alpha=trainer.lora["alpha"], base_model=adapter_of)
    else:
        save_hf_folder(tmp, shape, trainer.full_state_dict(), tokenizer_dir=base, max_shard_size=max_shard_size)
    if (run_dir / "metrics.jsonl").exists():
        plot_metrics(run_dir / "metrics.jsonl", tmp / "training_curves.png", upto=ckpt.step)

    card = model_card(run_dir, rec, ckpt, why=why, folder=out, moe=shape.is_moe, eval_results=eval_results or [],
                      repo_id=repo_id,
                      lora=trainer.lora, adapter_of=adapter_of)
    card.save(tmp / "README.md")
    atomic.write_text(tmp / "minirl_export.json", json.dumps(
        {"run": run_dir.name, "step": ckpt.step, "checkpoint": str(ckpt.path), "why": why,
         "kind": "peft-adapter" if adapter else "model"}, indent=2))


def base_name(rec, folder: Path) -> str:
    """What an adapter names as its base model: the Hub repo, else the model folder's path."""
    return hub_repo(rec.model.id) or str(Path(folder).resolve())


def eval_results_for(ws_root: Path, ckpt: Checkpoint) -> list[dict]:
    """`minirl eval` results of this checkpoint (workspace evals/), newest per benchmark."""
    found: dict[str, dict] = {}
    files = (ws_root / "evals").glob("*.json") if (ws_root / "evals").is_dir() else []
    for f in sorted(files, key=lambda f: f.stat().st_mtime):  # the newest last: it wins (one per settings)
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        where = Path(str(r.get("checkpoint", ""))).resolve()  # results of earlier versions hold the path as typed
        if where in (ckpt.path.resolve(), (ckpt.path / "hf").resolve()) and "benchmark" in r:
            found[r["benchmark"]] = r
    return list(found.values())


def measure_heldout(run_dir: Path, ckpts: list[Checkpoint], metric: str,
                    progress: Callable[[int, int], None] = lambda done, total: None) -> dict[Path, float]:
    """The run's own held-out evaluation of each checkpoint: one vLLM engine, weights loaded in place."""
    from minirl.rollout import make_engine  # deferred: torch and vLLM (the CLI imports this module at start)
    from minirl.rollout.sync import sync
    from minirl.train.trainer import Trainer

    rec = recipes.load(run_dir / "recipe.toml", [])
    ws = Workspace.open(run_dir.parent.parent)
    inputs = prepare_run(ws, rec, resume=None)
    engine = make_engine(inputs.model_dir, rec.rollout, seed=rec.train.seed, max_model_len=sizing.max_model_len(rec))
    trainer = Trainer.for_checkpoint(rec, inputs.shape, inputs.model_dir)
    tok = inputs.tokenizer
    out = {}
    for c in ckpts:  # every one before the first engine step: a damaged one costs no evaluation
        check_checkpoint(c.path, inputs.shape, rec.model.id)
    for i, c in enumerate(ckpts):
        trainer.load(c.path, with_optim=False)
        sync(trainer, engine, bucket_bytes=rec.rollout.sync_bucket_mib * 2**20)  # as the run's rollouts saw it
        got = evaluate(engine, inputs.heldout, inputs.grading, k=rec.eval.k, sampler=rec.eval,
                       max_tokens=rec.rollout.max_tokens, eos_id=tok.eos_token_id,
                       decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
        out[c.path] = float(got[metric])
        progress(i + 1, len(ckpts))
    inputs.grading.close()
    return out
