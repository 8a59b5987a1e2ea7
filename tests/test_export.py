"""`minirl export` and `minirl push`: a run's checkpoint becomes an HF folder with a model card
that transformers and vLLM load with the trainer's log-probs; --best never picks what a rollback
undid; push goes through huggingface_hub to a stand-in Hub on 127.0.0.1 (the one stand-in, at
the network seam)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

RUN_SETS = ["--set", "train.prompts_per_step=8", "--set", "eval.k=1", "--set", "checkpoint.every=1",
            "--set", "checkpoint.keep=0", "--set", "rollout.max_tokens=4",
            # a random policy earns no exact sums; a number within 500 of the sum gives a signal
            "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 500}',
            # ... and it is noise (0.08-0.27 a step): no reward drop counts, so only the forced
            # rollback below decides which checkpoints are good
            "--set", "guard.reward_drop=1", "--set", "guard.reward_drop_frac=1"]


def minirl(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.fixture(scope="session")
def export_ws(tiny_dir, tmp_path_factory) -> Path:
    """A workspace with a run of the tiny model: 3 healthy steps, then (resumed) a forced guard
    trip: steps 4-5 are bad, step 5 rolls back to step 3, step 6 is bad again. Checkpoints 0..6,
    all kept. Built once for all xdist workers (a file lock in the session's shared folder): two
    `minirl run`s, about 70 s."""
    from tests.conftest import built_once, data_workspace

    def build(root: Path) -> None:
        ws = data_workspace(root / "ws")
        model = ["--model", str(tiny_dir)]
        r = minirl("run", str(ws), *model, "--steps", "3", *RUN_SETS)
        assert r.returncode == 0, r.stderr[-3000:]
        r = minirl("run", str(ws), *model, "--steps", "6", "--resume", *RUN_SETS, "--set", "guard.max_kl=-1",
                   "--set", "guard.patience=2", "--set", "guard.max_rollbacks=1")
        assert r.returncode == 0, r.stderr[-3000:]

    root = built_once(tmp_path_factory, "export-run", build)
    return root / "ws"


@pytest.fixture
def run_dir(export_ws, tmp_path) -> Path:
    """That run, in a copy of its workspace of this test's own (tests write beside checkpoints)."""
    import shutil

    ws = shutil.copytree(export_ws, tmp_path / "ws")
    return next((ws / "runs").iterdir())


@pytest.mark.slow
def test_best_never_picks_what_a_rollback_undid(run_dir, tmp_path):
    from minirl.disk.store import checkpoints

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("guard/action"), r.get("guard/rollback_to_step")) for r in rows][3:] == [
        (4, "step", None), (5, "rollback", 3), (6, "step", None)]
    assert {c.step: c.good for c in checkpoints(run_dir)} == {0: True, 1: True, 2: True, 3: True, 4: False,
                                                              5: False, 6: False}
    for step in (4, 5, 6):  # were they candidates, these scores would win
        (run_dir / "checkpoints" / f"step_{step:06d}" / "heldout.json").write_text(json.dumps({"avg@1": 1.0}))
    r = minirl("export", str(run_dir), str(tmp_path / "best"), "--best")
    assert r.returncode == 0, r.stderr[-3000:]
    origin = json.loads((tmp_path / "best" / "minirl_export.json").read_text())
    assert origin["step"] in (0, 1, 2, 3)
    assert "3 undone or unhealthy skipped" in origin["why"]
    measured = {s: json.loads((run_dir / "checkpoints" / f"step_{s:06d}" / "heldout.json").read_text())["avg@1"]
                for s in (1, 2, 3)}  # evaluated now, cached beside each checkpoint
    summary = json.loads((run_dir / "summary.json").read_text())
    scores = {0: summary["heldout"]["start"]["avg@1"], **measured}
    assert scores[origin["step"]] == max(scores.values())


@pytest.mark.slow
def test_export_loads_in_transformers_and_vllm_with_the_trainers_logprobs(run_dir, tmp_path):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    from minirl.models.shapes import TINY
    from minirl.rollout.vllm import VLLMEngine
    from minirl.train.batch import build_batch
    from minirl.train.trainer import Trainer

    ws = run_dir.parent.parent
    r = minirl("eval", "-w", str(ws), "--checkpoint", str(run_dir / "checkpoints" / "step_000003"), "--k", "2")
    assert r.returncode == 0, r.stderr[-3000:]  # a `minirl eval` result of that checkpoint goes into the card
    out = tmp_path / "hf"
    r = minirl("export", str(run_dir), str(out), "--step", "3", "--max-shard-size", "1MB")
    assert r.returncode == 0, r.stderr[-3000:]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()  # sharded, with an index
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the folder's other files

    trainer = Trainer(TINY, lr=0.0)
    trainer.load(run_dir / "checkpoints" / "step_000003", with_optim=False)
    g = torch.Generator().manual_seed(3)
    prompts = [[int(x) for x in torch.randint(3, 30, (4,), generator=g)] for _ in range(8)]
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] for n in (1, 2, 3, 4, 2, 3, 1, 4)]
    batch = build_batch(prompts, resps, None, None, pad_id=0)
    pi, _, _ = trainer.logprobs(batch)
    m = batch.mask_BT.bool()

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(batch.tokens_BL[:, :-1]).logits
    hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.tokens_BL[:, 1:, None]).squeeze(-1)
    d_hf = float((hf_lp - pi)[m].abs().mean())

    engine = VLLMEngine(out, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.25)
    mu = engine.score(prompts, resps)
    d_vllm = float((build_batch(prompts, resps, mu, None, pad_id=0).rollout_logp_BT - pi)[m].abs().mean())
    print(f"mean |Δ log p| vs the trainer, fp32: transformers {d_hf:.2e}, vLLM {d_vllm:.2e}")
    assert d_hf < 1e-5 and d_vllm < 1e-5

    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert {"minirl", "reinforcement-learning"} <= set(meta["tags"])
    assert (meta["library_name"], meta["pipeline_tag"], meta["license"]) == ("transformers", "text-generation",
                                                                            "apache-2.0")
    results = {(e.dataset_name, e.metric_name) for e in card.data.eval_results}
    assert ("heldout", "avg@2") in results, results  # model-index, parsed back by huggingface_hub
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", card.text):
        assert (out / image).is_file()
    assert "| rollback at step 5 |" not in card.text  # the card shows the run up to its checkpoint
    assert "sampled ahead" not in card.text  # a synchronous run
    # what it writes (#98): the first responses of that evaluation, kept by `minirl eval`
    assert "## What it writes" in card.text and "of `minirl eval heldout` of this checkpoint (k = 2" in card.text
    assert card.text.count("(reference answer ") == 3
    # a run that sampled ahead says how far, and what its stale tokens were clipped against (#74)
    from minirl.config import recipes
    from minirl.disk.store import checkpoints
    from minirl.publish.card import model_card

    rec = recipes.load(run_dir / "recipe.toml", ["rollout.max_staleness=2", "rollout.inflight_updates=true"])
    ckpt = next(c for c in checkpoints(run_dir) if c.step == 3)
    text = str(model_card(run_dir, rec, ckpt, why="", folder=out, eval_results=[], moe=True))
    assert "| sampled ahead (k) | at most 2 update(s) behind, in-flight updates; stale tokens clipped against " \
           "their sampler |" in text
    r = minirl("eval", "-w", str(ws), "--checkpoint", str(out))
    assert r.returncode == 0, r.stderr[-3000:]


def check_the_cards_snippets_run(out: Path) -> None:
    """The two loading snippets of the card, as written, pointed at the exported folder."""
    text = (out / "README.md").read_text()
    assert "| rollback at step 5 | KL(μ‖π_old)" in text and "back to step 3 |" in text
    snippets = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(snippets) == 2
    for code in snippets:
        assert 'MODEL = "./tiny-rl"' in code
        r = subprocess.run([sys.executable, "-c", code], cwd=out.parent, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr[-3000:]  # it loaded and sampled (a random policy's text)


@pytest.mark.slow
def test_the_cards_snippets_run_and_push_to_a_stand_in_hub(run_dir, tmp_path):
    from hub_standin import READ, WRITE, Hub

    folder = tmp_path / "tiny-rl"
    assert minirl("export", str(run_dir), str(folder)).returncode == 0
    check_the_cards_snippets_run(folder)
    home = tmp_path / "hf-home"  # no saved login of this machine's user

    def push(*args, token=WRITE):
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0", "HF_TOKEN": token or ""}
        r = minirl("push", str(folder), *args, env=env)
        for text in (r.stdout, r.stderr):
            assert WRITE not in text and READ not in text
        return r

    with Hub() as hub:
        r = push("--repo", "me/tiny-rl", "--dry-run")
        assert r.returncode == 0 and "model.safetensors" in r.stdout and not hub.requests  # a dry run asks nothing

        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0", "HF_TOKEN": WRITE}
        r = minirl("push", str(run_dir), "--repo", "me/tiny-rl", "--step", "2", "--dry-run", env=env)
        assert r.returncode == 0, r.stderr[-3000:]  # a run is exported first (to a temporary folder)
        assert f"minirl: run {run_dir.name}, step 2" in r.stdout and "training_curves.png" in r.stdout

        r = push("--repo", "me/tiny-rl", "--private")
        assert r.returncode == 0, r.stderr[-3000:]
        sent = hub.repos["me/tiny-rl"]
        assert sent["private"] is True
        files = sent["branches"]["main"]
        local = {p.name: p.read_bytes() for p in folder.iterdir()}
        assert set(files) == set(local) | {".gitattributes"}
        for name, data in local.items():
            if name != "README.md":
                assert files[name] == data, name  # byte-identical
        assert 'MODEL = "me/tiny-rl"' in files["README.md"].decode()  # the card's snippets load from the repo
        assert hub.commits[-1]["summary"].startswith(f"minirl: run {run_dir.name}, step 6")

        r = push("--repo", "me/tiny-rl")
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"minirl: error: me/tiny-rl@main already holds {len(local)} file(s); --force replaces them"]
        assert push("--repo", "me/tiny-rl", "--force").returncode == 0
        assert len(hub.commits) == 2

        r = push("--repo", "me/tiny-rl", "--revision", "rl-v2")
        assert r.returncode == 0, r.stderr[-3000:]
        assert hub.commits[-1]["branch"] == "rl-v2" and "README.md" in hub.repos["me/tiny-rl"]["branches"]["rl-v2"]

        r = push("--repo", "me/other", token="hf_not_a_token")
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "minirl: error: the Hub refused the token (401 Unauthorized): log in again (`hf auth login`) or set "
            "HF_TOKEN"]
        r = push("--repo", "me/other", token=READ)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "minirl: error: no write access to me/other (403 Forbidden): use a token with write permission for its "
            "owner"]
        r = push("--repo", "me/other", token="")
        assert r.returncode == 2 and "no Hugging Face token" in r.stderr
    r = push("--repo", "me/other")  # the server is gone: network down
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot" in r.stderr
    for p in folder.rglob("*"):
        if p.is_file():
            assert WRITE.encode() not in p.read_bytes()


def test_the_checkpoint_pruning_keeps_as_best_is_the_good_one_with_the_top_run_score(tmp_path):
    """`checkpoint.keep` keeps the newest checkpoints, the rollback target, and the good one with
    the best held-out score its run measured (what `export --best` would pick among them)."""
    from minirl.disk.store import best_scored

    def ckpt(step: int, score: float | None, good: bool = True) -> Path:
        path = tmp_path / f"step_{step:06d}"
        path.mkdir()
        (path / "minirl.json").write_text(json.dumps({"step": step, "good": good}))
        if score is not None:
            (path / "heldout.json").write_text(json.dumps({"avg@4": score, "measured_by": "the run"}))
        return path

    ckpts = [ckpt(0, 0.3), ckpt(10, 0.7), ckpt(20, 0.9, good=False), ckpt(30, None), ckpt(40, 0.7), ckpt(50, 0.5)]
    assert best_scored(ckpts, "avg@4") == ckpts[4]  # the unhealthy 0.9 is no candidate; the newer of two 0.7s
    assert best_scored(ckpts, "avg@1") is None
    (ckpts[4] / "heldout.json").write_text("{torn")
    assert best_scored(ckpts, "avg@4") == ckpts[1]


def _debris(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def test_an_export_into_an_empty_folder_keeps_it_and_a_fault_or_signal_leaves_nothing(run_dir, tmp_path, monkeypatch):
    """#82: the export writes aside in a folder of its own process and moves the files into an OUT
    that exists (a container's mounted volume: `rmdir` of it failed with EBUSY) without removing it;
    a full disk (safetensors' IoError) is exit 4's one line; Ctrl-C or SIGTERM (which the command
    turns into it) and any fault leave nothing beside OUT; a second export into an OUT being written
    is refused in one line."""
    import fcntl

    from minirl.errors import RunIOError, UsageError
    from minirl.publish import export as ex

    run, picked, why = ex.pick(run_dir, None, step=None, best=False)
    parent = tmp_path / "exports"
    out = parent / "tiny-rl"
    out.mkdir(parents=True)
    inode = out.stat().st_ino
    ex.export(run, out, picked, why=why)
    assert out.stat().st_ino == inode and (out / "model.safetensors").is_file()  # the same folder, filled
    assert _debris(parent, "tiny-rl") == []

    real_write = ex._write

    def fails(exc):
        def write(tmp, *a, **k):
            real_write(tmp, *a, **k)  # the files are there, aside
            (tmp.with_name(tmp.name + ".tmp")).mkdir()  # and a writer's own aside folder
            raise exc
        return write

    class SafetensorError(Exception):  # as safetensors' Rust writer raises a full disk (its real message)
        pass

    for exc, caught in ((KeyboardInterrupt(), KeyboardInterrupt),
                        (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                         RunIOError)):
        other = parent / "again"
        monkeypatch.setattr(ex, "_write", fails(exc))
        with pytest.raises(caught) as e:
            ex.export(run, other, picked, why=why)
        assert _debris(parent, "tiny-rl") == [], type(exc)  # nothing beside, not OUT either
        if caught is RunIOError:
            assert str(e.value) == (f"cannot write {other}: no space left on device; nothing was written (free space, "
                                    "then run the export again)")
    monkeypatch.setattr(ex, "_write", real_write)

    lock = parent / ".busy.export-lock"  # an export of this OUT under way in another process
    with lock.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(UsageError, match=f"another export is writing {parent / 'busy'}; wait for it"):
            ex.export(run, parent / "busy", picked, why=why)
    assert not (parent / "busy").exists()
    # a folder that cannot be written (a read-only mount; /proc here, as root ignores permissions): exit 4's line
    for where in (Path("/proc/minirl-export"), Path("/proc/self/minirl/export")):
        with pytest.raises(RunIOError, match=f"cannot write {where}: No such file or directory .*; nothing was written"):
            ex.export(run, where, picked, why=why)


def test_an_os_error_a_library_wraps_is_read_as_the_os_said_it():
    """#99: safetensors' Rust writer raises its own SafetensorError on a full disk, its message as the real
    library writes it (`Error while serializing: I/O error: No space left on device (os error 28)`)."""
    import errno

    from minirl.disk.oserrors import os_error_of

    class SafetensorError(Exception):
        pass

    full = os_error_of(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert full is not None and full.errno == errno.ENOSPC
    assert os_error_of(ValueError("a bug")) is None
    handled = RuntimeError("a bug raised while handling a full disk")
    handled.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert os_error_of(handled, chained=False) is None and os_error_of(handled).errno == errno.ENOSPC


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (smaller than the tiny model's weights), where this machine lets the tests mount one."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here (not root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_an_export_onto_a_full_disk_is_one_line_with_the_real_weights_writer(run_dir, small_disk):
    """#99: the weights' own library fills the disk (safetensors, through huggingface_hub), not a stand-in:
    exit 4's one line, and nothing left on the disk."""
    from minirl.errors import RunIOError
    from minirl.publish import export as ex

    run, picked, why = ex.pick(run_dir, None, step=None, best=False)
    out = small_disk / "tiny-rl"
    with pytest.raises(RunIOError) as e:
        ex.export(run, out, picked, why=why)
    assert str(e.value) == (f"cannot write {out}: no space left on device; nothing was written (free space, then run "
                            "the export again)")
    assert sorted(p.name for p in small_disk.iterdir()) == []


def test_the_exports_sigterm_handler_goes_with_the_export(run_dir, tmp_path, monkeypatch):
    """#99: SIGTERM is Ctrl-C while the export writes; once the folder is in place the handler is gone (a
    SIGTERM then ends the process as before the command, never a KeyboardInterrupt raised in an exit hook)."""
    import signal

    from click.testing import CliRunner

    from cli.publish import export_cmd

    before = signal.getsignal(signal.SIGTERM)
    seen = []
    real = signal.signal

    def spy(signum, handler):
        seen.append((signum, handler))
        return real(signum, handler)

    import cli.publish

    monkeypatch.setattr(signal, "signal", spy)
    got = CliRunner().invoke(export_cmd, [str(run_dir), str(tmp_path / "out")], catch_exceptions=False)
    assert got.exit_code == 0, got.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert [h for s, h in seen if s == signal.SIGTERM][0] is cli.publish._interrupt  # it guarded the export
    assert signal.getsignal(signal.SIGTERM) is before  # and is gone with it
