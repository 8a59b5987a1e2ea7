"""The Hugging Face Hub, through huggingface_hub: model folders from a model id (a local HF folder
as it is, or a Hub repo: its cache, `revision`, `HF_HUB_OFFLINE`, `HF_TOKEN` and progress bars all
apply), and `push` of an exported folder.

    "tiny-qwen3-moe"   the embedded default: its folder is the recipe's model.path (built by init)
    "Qwen3-30B-A3B"    a short name (minirl.models.shapes.HUB_IDS) -> "Qwen/Qwen3-30B-A3B-Base"
    "Qwen/Qwen3-8B"    a Hub repo id
    "/data/my-ckpt"    a local HF folder

The config is fetched first and the weights only once the model is known to be one minirl can
train here, so a wrong id or a model too large for the machine costs no download.

Offline (air-gapped clusters): before anything asks the Hub, `need_hub` sends one HEAD request to
the endpoint (3 s at most, no retries) and an unreachable Hub is refused at once in one line with
what to do instead; the Hub client's own path retried for a long while first, printing a line per retry.
With `HF_HUB_OFFLINE` (or, for datasets, `HF_DATASETS_OFFLINE`) set nothing is probed: the
libraries answer from their caches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from minirl.errors import UsageError
from minirl.models.shapes import HUB_IDS, KNOWN_SHAPES, TINY, TINY_ID, read_shape

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


def resolution(model_id: str) -> str | None:
    """One line saying which Hub repo a short name stands for and why; None for anything else."""
    repo = HUB_IDS.get(model_id)
    if repo is None:
        return None
    why = ("its pretrained base model, which RL starts from here as in the paper" if repo.endswith("-Base")
           else "no base model of it is published")
    return f"{model_id} is {repo} on the Hub ({why}); give a repo id to train another checkpoint"


def offline(*, datasets: bool = False) -> bool:
    """HF_HUB_OFFLINE is set (for datasets, HF_DATASETS_OFFLINE counts too)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if datasets else ("HF_HUB_OFFLINE",)
    return any(os.environ.get(n, "").strip().upper() in ("1", "ON", "YES", "TRUE") for n in names)


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


@functools.cache
def reachable() -> bool:
    """One HEAD request to the Hub's endpoint through huggingface_hub's own HTTP client (its
    proxies and HF_ENDPOINT), 3 s at most: any answer means reachable. Asked once per process."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint(), timeout=3.0)
    except Exception:  # noqa: BLE001 - DNS, refused, timeout, TLS: the Hub cannot be had
        return False
    return True


def need_hub(what: str, *, instead: str, datasets: bool = False, cache_helps: bool = True) -> None:
    """Before `what` asks the Hub: unreachable, refuse in one line naming `instead` (a local path
    to pass) and, where a cache could answer (not for an upload), the offline variable; offline,
    nothing to check (the caches answer at once)."""
    if offline(datasets=datasets) or reachable():
        return
    cache = ", or with a cache filled elsewhere set HF_HUB_OFFLINE=1" if cache_helps else ""
    raise UsageError(f"{what}: the Hugging Face Hub ({endpoint()}) cannot be reached; {instead}{cache}")


def fetch(repo: str, *, weights: bool, revision: str | None = None) -> Path:
    """A local snapshot of `repo`: config, tokenizer and (with `weights`) the safetensors."""
    from huggingface_hub import snapshot_download

    need_hub(f"model {repo!r}", instead="pass a local HF model folder")
    patterns = OTHER_FILES + (WEIGHT_FILES if weights else [])
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, gated, missing: one line
        if offline():  # the cache did not have it; huggingface_hub's own message runs to a paragraph
            raise UsageError(f"model {repo!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: pass "
                             "a local HF model folder, or unset HF_HUB_OFFLINE to download it") from None
        first = (str(e).strip().splitlines() or [""])[0]
        first = first if len(first) <= 200 else first[:197].rsplit(" ", 1)[0] + " …"
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


def fingerprint(folder: Path) -> str:
    """A content hash of an HF folder's weights: SHA-256 over each safetensors file's name and
    SHA-256. What a LoRA checkpoint records of its frozen base, so that it is never resumed or
    exported onto other weights. A file in the Hub's cache links to a blob named by its SHA-256
    (the LFS object id): the name is taken, the file is not read. Any other file is read once per
    (size, mtime) in this process."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UsageError(f"no *.safetensors in {folder}")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{_file_sha256(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def check_base(checkpoint: Path, recorded: dict, folder: Path, *, here: str | None = None) -> None:
    """LoRA adapters apply only to the weights they were trained on: the base a checkpoint
    recorded ({"path", "fingerprint"}) against the model folder about to hold them, one line if not."""
    here = here or fingerprint(folder)
    if recorded.get("fingerprint") != here:
        raise UsageError(f"checkpoint {checkpoint} holds LoRA adapters trained on {recorded.get('path')} "
                         f"({str(recorded.get('fingerprint'))[:19]}…); {folder} holds other weights ({here[:19]}…): "
                         "adapters apply only to the weights they were trained on")


def _file_sha256(f: Path) -> str:
    target = f.resolve()
    if f.is_symlink() and target.parent.name == "blobs" and len(target.name) == 64:
        try:
            int(target.name, 16)
            return target.name
        except ValueError:
            pass
    st = target.stat()
    return _hash_file(str(target), st.st_size, st.st_mtime_ns)


@functools.cache
def _hash_file(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a rewritten file hashes again
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def model_shape(model_id: str, path: str, base: Path):
    """The model's shape with as little as possible fetched: the known short names and the tiny
    default need nothing, a folder its config.json, a repo id its config alone (no weights)."""
    if not path and model_id in KNOWN_SHAPES:
        return KNOWN_SHAPES[model_id]
    if model_id == TINY_ID and not (path and (base / path / "config.json").exists()):
        return TINY
    return read_shape(model_dir(model_id, path, base, weights=False))


def adapter_base(folder: Path, base_repo: str | None = None) -> tuple[str, str] | None:
    """A PEFT adapter folder's base model as its adapter_config.json names it, and the Hub repo a
    pushed copy must name instead (a Hub user cannot load a local folder): `base_repo` if given, a
    Hub id as it is, a folder in huggingface_hub's cache as the repo it caches; else one line.
    None for a folder that is not an adapter."""
    import re

    cfg = Path(folder) / "adapter_config.json"
    if not cfg.exists():
        return None
    base = str(json.loads(cfg.read_text()).get("base_model_name_or_path") or "")
    if base_repo is not None:
        check_repo_name(base_repo, flag="--base-repo")
        return base, base_repo
    cached = re.search(r"models--([^/]+)--([^/]+)/snapshots/", base)
    if cached:
        return base, f"{cached.group(1)}/{cached.group(2)}"
    if base and not is_local(base) and base.count("/") == 1:
        return base, base
    raise UsageError(f"the adapter's base model is the local folder {base or '(none)'} (adapter_config.json), which nobody "
                     "on the Hub can load: push that base model first and name its repo with --base-repo OWNER/NAME "
                     "(the uploaded adapter_config.json and card then name it)")


def push(folder: Path, repo: str, *, private: bool = False, revision: str | None = None, force: bool = False,
         message: str = "minirl export", dry_run: bool = False, base_repo: str | None = None) -> dict:
    """Upload an exported folder to `repo` as one commit. The repo is created when missing. A
    target branch that already holds files (besides .gitattributes) is refused unless `force`. The token comes from huggingface_hub's
    usual places (HF_TOKEN, a saved login) and is never printed or written. A new branch starts
    from main and takes the folder whole (what main holds besides is deleted on it). The card's snippets
    are pointed at `repo` in the uploaded README.md (the folder itself is left as it is).

    A LoRA adapter's base is named as a Hub repo in what is uploaded (`adapter_base`).

    Returns {"files": [(path, bytes)], "url": ..., "commit": ...} ("url"/"commit" unless dry_run)."""
    import huggingface_hub as hf

    folder = Path(folder)
    check_repo_name(repo)
    base = adapter_base(folder, base_repo)  # a local base is refused before any upload, dry run or not
    files = sorted((p.relative_to(folder).as_posix(), p.stat().st_size) for p in folder.rglob("*") if p.is_file())
    if dry_run:
        return {"files": files}
    if offline():
        raise UsageError("HF_HUB_OFFLINE is set: a push needs the Hub (unset it, or push from a machine with network)")
    need_hub(f"push to {repo}", instead="push from a machine with network", cache_helps=False)
    token = hf.get_token()
    if not token:
        raise UsageError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    api = hf.HfApi(token=token)
    branch = revision or "main"
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        try:
            present = [f for f in api.list_repo_files(repo, revision=branch) if f != ".gitattributes"]
        except hf.errors.RevisionNotFoundError:  # a new branch (from main) is this push's own
            api.create_branch(repo, branch=branch, exist_ok=True)
            present, force = [f for f in api.list_repo_files(repo, revision=branch) if f != ".gitattributes"], True
        if present and not force:
            raise UsageError(f"{repo}@{branch} already holds {len(present)} file(s); --force replaces them")
        readme = (folder / "README.md").read_text() if (folder / "README.md").exists() else None
        rewritten = {}  # the folder is left as it is; what is uploaded names the Hub's base and repo
        if base is not None and base[0] != base[1]:
            cfg = json.loads((folder / "adapter_config.json").read_text())
            rewritten["adapter_config.json"] = json.dumps({**cfg, "base_model_name_or_path": base[1]}, indent=2)
            readme = readme.replace(base[0], base[1]) if readme is not None else None
        if readme is not None:
            rewritten["README.md"] = _point_snippets(readme, repo)
        ops = [hf.CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(folder / rel)) for rel, _ in files
               if rel not in rewritten]
        ops += [hf.CommitOperationAdd(path_in_repo=rel, path_or_fileobj=text.encode()) for rel, text in rewritten.items()]
        ops += [hf.CommitOperationDelete(path_in_repo=f) for f in present if f not in dict(files)]
        commit = api.create_commit(repo, operations=ops, commit_message=message, revision=branch)
    except UsageError:
        raise
    except hf.errors.HfHubHTTPError as e:
        raise UsageError(_http_failure(e, repo)) from None
    except (OSError, ValueError) as e:  # connection refused, DNS, timeouts; the card's YAML refused
        raise UsageError(f"cannot push to {hf.constants.ENDPOINT}: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:200]}") from None
    except Exception as e:  # noqa: BLE001 - httpx's transport errors are not OSErrors
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise UsageError(f"cannot reach the Hub at {hf.constants.ENDPOINT} ({type(e).__name__})") from None
        raise
    return {"files": files, "url": str(url), "commit": commit.oid, "commit_url": commit.commit_url}


def check_repo_name(repo: str, *, flag: str = "--repo") -> None:
    """OWNER/NAME as the Hub accepts it (huggingface_hub's own validator), else one line."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if repo.count("/") != 1:
        raise UsageError(f"{flag} {repo!r} must be OWNER/NAME")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise UsageError(f"{flag} {repo!r} is not a valid Hub repo name (letters, digits, '-', '_', '.'; "
                         "no '--' or '..'; at most 96 characters)") from None


def _point_snippets(readme: str, repo: str) -> str:
    """The card's `MODEL = "./folder"` lines load from the Hub repo instead."""
    import re

    return re.sub(r'^MODEL = ".*"$', f'MODEL = "{repo}"', readme, flags=re.MULTILINE)


def _http_failure(e, repo: str) -> str:
    status = e.response.status_code if getattr(e, "response", None) is not None else None
    if status == 401:
        return "the Hub refused the token (401 Unauthorized): log in again (`hf auth login`) or set HF_TOKEN"
    if status == 403:
        return f"no write access to {repo} (403 Forbidden): use a token with write permission for its owner"
    if status == 404:
        return f"{repo} was not found, or this token cannot see it (404)"
    return f"the Hub answered {status} for {repo}: {(str(e).strip().splitlines() or [''])[0][:200]}"
