"""Which weights an evaluation (and the doctor) reads: `--checkpoint` resolved to a checked HF folder
vLLM can load, whatever it names (the cold start, a run's newest or given checkpoint, an exported
folder or LoRA adapter, a Hub id), and the short name its results are filed under."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

from minirl.config import recipes
from minirl.disk import store
from minirl.disk.store import is_checkpoint, latest_trained
from minirl.errors import UsageError
from minirl.models import hub
from minirl.setup.preflight import check_checkpoint, check_model_folder, instead


def _merged_adapter(ws, adapter: Path) -> Path:
    """A PEFT adapter folder merged onto the base its adapter_config.json names (a folder, or a Hub
    id fetched), once: kept under the evaluations' folder, named by both fingerprints, so that a
    resumed evaluation finds the same checkpoint."""
    from minirl.train.hf_io import merge_peft_folder  # deferred: torch (the CLI imports this module at start)

    named = str(json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or "")
    if not named:
        raise UsageError(f"{adapter}/adapter_config.json names no base model (base_model_name_or_path)")
    base = Path(named) if hub.is_local(named) else hub.fetch(named, weights=True)
    if not base.exists():
        raise UsageError(f"the adapter {adapter} applies to {named}, which is not here")
    check_model_folder(base)
    tag = hashlib.sha1((hub.fingerprint(adapter) + hub.fingerprint(base)).encode()).hexdigest()[:10]
    out = (ws.root / "evals" if ws else Path("minirl-evals")) / "merged" / f"{adapter.resolve().name}-{tag}"
    if not (out / "config.json").exists():
        merge_peft_folder(adapter, base, out)
    check_model_folder(out)
    return out


def resolve_checkpoint(ws, rec, checkpoint: str):
    """'latest' | 'coldstart' | HF folder | exported LoRA adapter folder | run checkpoint (DCP)
    folder | Hub id -> a checked HF folder vLLM can load."""

    def start_dir() -> Path:  # the model the workspace's runs start from
        if ws is None:
            raise UsageError(f"--checkpoint {checkpoint} needs a workspace (-w DIR)")
        return hub.model_dir(rec.model.id, rec.model.path, ws.root)

    if checkpoint == "coldstart":
        check_model_folder(start_dir())
        return start_dir()
    if checkpoint == "latest":
        if ws is None:
            raise UsageError("no workspace here: pass -w DIR, or --checkpoint with an HF folder or model id")
        path = latest_trained(ws)
        if path is None:
            raise UsageError(f"no run in {ws.runs} has trained a step yet; run `minirl run` first or pass "
                             "--checkpoint coldstart")
    else:
        path = Path(checkpoint)
        if not path.exists():
            if checkpoint.count("/") == 1 and not checkpoint.startswith((".", "/")):
                folder = hub.fetch(checkpoint, weights=True)
                check_model_folder(folder)
                return folder
            raise UsageError(f"checkpoint not found: {checkpoint}")
    if (path / "adapter_config.json").exists():  # an exported LoRA adapter: served merged onto its base
        return _merged_adapter(ws, path)
    for folder in (path, path / "hf"):
        if (folder / "config.json").exists():
            try:
                check_model_folder(folder)
            except UsageError as e:
                if ws is None or not is_checkpoint(path):
                    raise
                raise UsageError(f"{e}; {instead(path, check_model_folder(start_dir()), rec.model.id)}") from None
            return folder
    if is_checkpoint(path):  # a DCP step checkpoint: export its weights once
        from minirl.train.hf_io import save_hf_folder  # deferred: torch (the CLI imports this module at start)
        from minirl.train.trainer import Trainer

        shape = check_model_folder(start_dir())
        run_recipe = path.parent.parent / "recipe.toml"  # the model its run trained (LoRA adapters or not)
        # a run without a summary may be live: it prunes its old checkpoints as it goes, so what is read
        # is pinned first, and nothing is written into its folder (#82); an ended run's keeps its HF copy
        live = ws is not None and store.status(path.parent.parent) is None
        out = ws.root / ".cache" / "eval-hf" / checkpoint_label(path) if live else path / "hf"
        if live and (out / "config.json").exists():
            return out
        check_checkpoint(path, shape, rec.model.id)  # a damaged one: one line, nothing written
        with (_pinned(path, ws.root / ".cache") if live else contextlib.nullcontext(path)) as read:
            trainer = Trainer.for_checkpoint(recipes.load(run_recipe) if run_recipe.exists() else rec, shape,
                                             start_dir())
            trainer.load(read, with_optim=False)
        return save_hf_folder(out, shape, trainer.full_state_dict(), tokenizer_dir=start_dir())
    raise UsageError(f"{path} is neither an HF model folder nor a minirl checkpoint")


@contextlib.contextmanager
def _pinned(path: Path, cache: Path):
    """`path`'s files hard-linked into a folder of this process's own (a copy where links cannot be
    made): what a live run's pruning deletes then stays readable until it is read. A checkpoint
    pruned before it was pinned whole is one line."""
    pin = cache / "pins" / f"{os.getpid()}-{path.name}"
    shutil.rmtree(pin, ignore_errors=True)
    try:
        if not path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "pruned", str(path))
        for f in sorted(p for p in path.rglob("*") if p.is_file() and "hf" not in p.relative_to(path).parts):
            to = pin / f.relative_to(path)
            to.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, to)
            except FileNotFoundError:  # pruned meanwhile: below
                raise
            except OSError:  # no hard links here (another filesystem): a copy
                shutil.copy2(f, to)
    except FileNotFoundError:
        shutil.rmtree(pin, ignore_errors=True)
        raise UsageError(f"{path} was pruned by its run while it was read; evaluate a newer checkpoint "
                         "(--checkpoint latest again)") from None
    try:
        yield pin
    finally:
        shutil.rmtree(pin, ignore_errors=True)


def checkpoint_label(model_dir: Path) -> str:
    """A checkpoint's short name for a results file: `<run>-step_000300` for a run's checkpoint (its
    HF folder or DCP folder), else the folder's own name (`coldstart`, an export's)."""
    p = Path(model_dir).resolve()
    p = p.parent if p.name == "hf" else p
    name = f"{p.parent.parent.name}-{p.name}" if p.parent.name == "checkpoints" else p.name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
