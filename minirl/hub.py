"""Model folders from a model id: a local HF folder as it is, or a Hub repo through
huggingface_hub (its cache, `revision`, `HF_HUB_OFFLINE`, `HF_TOKEN` and progress bars all apply).

    "tiny-qwen3-moe"   the embedded default: its folder is the recipe's model.path (built by init)
    "Qwen3-30B-A3B"    a short name (minirl.models.HUB_IDS) -> "Qwen/Qwen3-30B-A3B-Base"
    "Qwen/Qwen3-8B"    a Hub repo id
    "/data/my-ckpt"    a local HF folder

The config is fetched first and the weights only once the model is known to be one minirl can
train here, so a wrong id or a model too large for the machine costs no download.
"""

from __future__ import annotations

from pathlib import Path

from minirl.errors import UsageError
from minirl.models import HUB_IDS, TINY_ID

WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
OTHER_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def is_local(model_id: str) -> bool:
    return model_id.startswith((".", "/", "~")) or Path(model_id).expanduser().is_dir()


def repo_id(model_id: str) -> str | None:
    """The Hub repo an id names, or None for the embedded default and local folders."""
    if model_id == TINY_ID or is_local(model_id):
        return None
    if model_id in HUB_IDS:
        return HUB_IDS[model_id]
    if model_id.count("/") == 1 and all(model_id.split("/")):
        return model_id
    known = ", ".join([TINY_ID, *HUB_IDS])
    raise UsageError(f"model.id = {model_id!r} is neither a short name ({known}), a Hub repo id (owner/name) nor a folder")


def fetch(repo: str, *, weights: bool, revision: str | None = None) -> Path:
    """A local snapshot of `repo`: config, tokenizer and (with `weights`) the safetensors."""
    from huggingface_hub import snapshot_download

    patterns = OTHER_FILES + (WEIGHT_FILES if weights else [])
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, gated, missing: one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"cannot fetch model {repo!r} from the Hub ({type(e).__name__}: {first})") from None


def model_dir(model_id: str, path: str, base: Path, *, weights: bool = True, before_weights=None) -> Path:
    """The HF folder to load for (model.id, model.path): an explicit path wins (relative to the
    workspace), then a local folder id, then the Hub. `before_weights(folder)` may refuse the model
    once its config is known and before its weights are downloaded."""
    if path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else base / p
    if model_id == TINY_ID:
        raise UsageError("model.path is empty: the embedded default's weights are the folder `minirl init` builds "
                         "(model/coldstart)")
    repo = repo_id(model_id)
    if repo is None:
        return Path(model_id).expanduser()
    folder = fetch(repo, weights=False)
    if before_weights is not None:
        before_weights(folder)
    return fetch(repo, weights=True) if weights else folder


def model_shape(model_id: str, path: str, base: Path):
    """The model's shape with as little as possible fetched: the known short names and the tiny
    default need nothing, a folder its config.json, a repo id its config alone (no weights)."""
    from minirl.models import KNOWN_SHAPES, TINY, read_shape

    if not path and model_id in KNOWN_SHAPES:
        return KNOWN_SHAPES[model_id]
    if model_id == TINY_ID and not (path and (base / path / "config.json").exists()):
        return TINY
    return read_shape(model_dir(model_id, path, base, weights=False))
