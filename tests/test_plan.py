"""`minirl run --dry-run`: plans from the recipe and the model's shape alone, no GPU, no weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirl.config import recipes
from minirl.errors import UsageError
from minirl.models.shapes import KNOWN_SHAPES, active_params, param_count
from minirl.setup.plan import GiB, fit_mesh, make_plan

ROOT = Path(__file__).resolve().parents[1]
FLAVORS = {"Qwen3-0.6B": "0.6B", "Qwen3-1.7B": "1.7B", "Qwen3-4B": "4B", "Qwen3-8B": "8B", "Qwen3-14B": "14B",
           "Qwen3-30B-A3B": "30B-A3B", "Qwen3-235B-A22B": "235B-A22B"}


@pytest.mark.parametrize("name", list(FLAVORS))
def test_known_shapes_are_torchtitans_own_flavors(name):
    from torchtitan.models.qwen3 import qwen3_configs

    with torch.device("meta"):
        model = qwen3_configs[FLAVORS[name]]("flex").build()
    assert param_count(KNOWN_SHAPES[name]) == sum(p.numel() for p in model.parameters())


def plan_30b(nodes: int, gpus: int, *sets: str):
    rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), [f"parallel.nodes={nodes}", f"parallel.gpus_per_node={gpus}",
                                                          *sets])
    return make_plan(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B")


def test_30b_a3b_on_two_nodes_fits_with_the_published_size():
    plan = plan_30b(2, 8)
    assert plan.fits, plan.problems
    assert plan.params == pytest.approx(30.5e9, rel=0.01)  # "30.5B in total" (model card)
    assert active_params(KNOWN_SHAPES["Qwen3-30B-A3B"]) == plan.active
    assert plan.active == pytest.approx(3.35e9, rel=0.001)  # the card's "3.3B activated", rounded
    assert plan.mesh == {"world": 16, "dp_shard (FSDP2)": 16, "ep": 8, "vLLM tp": 2, "vLLM engines": 8}
    # 16 bytes a parameter of training state, sharded over the 16 ranks
    state = sum(plan.memory_gib[k] for k in ("fp32 weights (sharded)", "fp32 gradients (sharded)",
                                             "Adam moments (sharded)"))
    assert state * GiB == pytest.approx(16 * plan.params / 16)
    assert max(plan.phases_gib.values()) <= 0.9 * 80 + 1e-9 and plan.in_flight >= 1
    assert plan.tokens_per_step == 64 * 16 * (1024 + 32768)


@pytest.mark.parametrize("model, nodes, gpus, ep, lora", [("Qwen3-30B-A3B", 2, 8, 8, 0), ("Qwen3-30B-A3B", 1, 4, 4, 0),
                                                          ("Qwen3-8B", 1, 8, 1, 0), ("Qwen3-30B-A3B", 2, 8, 8, 16),
                                                          ("Qwen3-30B-A3B", 1, 8, 8, 16)])
def test_plan_bytes_are_those_of_the_sharded_model(model, nodes, gpus, ep, lora):
    """The model built on the meta device, under a fake process group of the planned size, through
    the same `parallelize` call a run makes: rank 0's parameter, gradient and Adam bytes equal the
    plan's; with LoRA, the frozen bf16 base's too, and the adapters' sharded as their weights.
    Offloaded (train.offload = "optimizer"), the moments' bytes moved equal the plan's host row and
    the device keeps none of them, nor any gradient, between updates."""
    import json

    sets = [f"parallel.nodes={nodes}", f"parallel.gpus_per_node={gpus}", f"parallel.ep={ep}", "rollout.tensor_parallel=1",
            "train.offload=optimizer"]
    rec = recipes.load(recipes.for_model(model), sets + ([f"train.lora.rank={lora}"] if lora else []))
    plan = make_plan(rec, KNOWN_SHAPES[model], model=model)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_mesh_worker.py"), "--model", model,
                        "--world", str(nodes * gpus), "--ep", str(ep), "--lora", str(lora)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == ["torch.float32"]  # sharded master weights; FSDP2 gathers them in param_dtype
    mem = {k: v * GiB for k, v in plan.memory_gib.items()}
    if lora:
        assert got["frozen_dtypes"] == ["torch.bfloat16"] and got["frozen"] == mem["base weights (bf16, frozen, sharded)"]
        assert got["params"] == mem["fp32 LoRA adapters (sharded)"] and got["grads"] == mem["fp32 LoRA gradients (sharded)"]
        assert got["optim"] == mem["Adam moments of the adapters (sharded)"]
        # the host row (#63): each of the node's ranks offloads its adapters' moments
        assert plan.host_gib["Adam moments offloaded"] * GiB == gpus * got["offloaded"] == gpus * got["optim"]
        return
    assert got["params"] == mem["fp32 weights (sharded)"]
    assert got["grads"] == mem["fp32 gradients (sharded)"]
    assert got["optim"] == mem["Adam moments (sharded)"]
    assert got["offloaded"] == mem["host memory: Adam moments offloaded"] == mem["Adam moments (sharded)"]
    assert got["watched"] == got["optim"] and got["left_on_device"] == 0 and got["grads_after_step"] == 0
    assert plan.host_gib["Adam moments offloaded"] * GiB == gpus * got["offloaded"]
    assert plan.host_gib_per_node == max(plan.host_gib["Adam moments offloaded"], plan.host_gib["checkpoint read at start (rank 0)"])


def test_sleeping_engines_leave_training_the_gpu_and_awake_ones_share_it():
    """rollout.sleep_level 2 (the 30B recipes' own): vLLM's weights and KV cache are gone while the trainer
    works; level 1 keeps the weights in host memory; level 0 keeps both on the GPU, so the KV cache
    gets only what training leaves (in micro-batches of 16k tokens: the whole 32k-token share's
    logits and their gradient, 23 GiB, would leave an awake engine no room). The weight sync holds
    at least one whole layer."""
    asleep, host, awake = (plan_30b(2, 8, f"rollout.sleep_level={n}", "train.micro_batch_tokens=16384")
                           for n in (2, 1, 0))
    vllm_w = asleep.memory_gib["vLLM weights (fp8, TP 2)"]
    assert vllm_w == pytest.approx(asleep.params / 2 / GiB)  # fp8: a byte a parameter, over TP 2
    assert asleep.phases_gib["training (full AC)"] == pytest.approx(host.phases_gib["training (full AC)"])
    assert host.memory_gib["host memory: vLLM weights asleep"] == pytest.approx(vllm_w)
    assert awake.phases_gib["training (full AC)"] == pytest.approx(0.9 * 80)  # the KV cache takes the rest
    assert awake.memory_gib["vLLM KV cache"] < asleep.memory_gib["vLLM KV cache"]
    assert awake.in_flight < asleep.in_flight
    layer_bf16 = (asleep.params - 2 * 151936 * 2048) / 48 * 2
    assert asleep.memory_gib["weight sync bucket"] * GiB == pytest.approx(max(2**30, layer_bf16), rel=1e-6)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-30b-a3b-offpolicy"])
def test_the_shipped_30b_recipes_follow_the_paper_and_fit_on_two_h100_nodes(name):
    """B = 64 prompts × G = 16 per mini-batch, FP8 rollouts with TIS 5, ε 0.2 / 0.27; off-policy:
    N = 4 mini-batches of a 256-prompt step with R3. Both fit 2 × 8 H100 80 GB with room."""
    rec = recipes.load(recipes.shipped(name), [])
    t, lo = rec.train, rec.loss
    assert (t.prompts_per_step // t.minibatches, t.group_size) == (64, 16)
    assert (t.minibatches, t.replay) == ((1, "off") if name == "qwen3-30b-a3b" else (4, "r3"))
    assert (rec.rollout.precision, lo.is_mode, lo.tis_cap, lo.eps_low, lo.eps_high) == ("fp8", "truncate", 5.0, 0.2, 0.27)
    assert (rec.parallel.nodes, rec.parallel.gpus_per_node) == (2, 8)
    plan = make_plan(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=80.0)
    assert plan.fits, plan.problems
    assert max(plan.phases_gib.values()) <= 0.9 * 80 + 1e-9 and plan.in_flight >= 16
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", "--dry-run", "--recipe", name], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "COLUMNS": "200",
                                                                        "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert f"launch: minirl init WORKSPACE --model Qwen3-30B-A3B --recipe {name}" in r.stdout
    assert "--max-restarts 3" in r.stdout and "--resume auto" in r.stdout


def test_the_design_cards_command_fits_one_node_of_8_h100s():
    """#55: `minirl run --model Qwen3-30B-A3B --replay r3 --dry-run --nodes 1 --gpus-per-node 8` fits
    as shipped (its recipe sends Adam's moments to host memory between updates) with at least 16
    full-length sequences in flight per engine; two nodes keep at least the 18 they had before."""
    import re

    def dry(nodes: int) -> str:
        r = subprocess.run([sys.executable, "-m", "cli.main", "run", "--model", "Qwen3-30B-A3B", "--replay", "r3",
                            "--dry-run", "--nodes", str(nodes), "--gpus-per-node", "8"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "COLUMNS": "200", "HF_HUB_OFFLINE": "1",
                                                        "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    one, two = dry(1), dry(2)
    in_flight = [int(re.search(r"vLLM: (\d+) full-length sequences in flight", out).group(1)) for out in (one, two)]
    assert in_flight[0] >= 16 and in_flight[1] >= 18, in_flight
    # what the offload costs: the moments of 8 GPUs in the node's memory, and their trips
    plan = plan_30b(1, 8, "train.replay=r3")
    moments = plan.memory_gib["Adam moments (sharded)"]
    assert plan.memory_gib["host memory: Adam moments offloaded"] == moments
    assert plan.host_gib_per_node == pytest.approx(8 * moments)
    assert plan.offload_s_per_step == pytest.approx(2 * moments * GiB / 25e9)
    assert "host memory per node: 227.5 GiB" in one
    # without the offload the same node keeps the moments beside the engine: fewer in flight
    assert plan_30b(1, 8, "train.replay=r3", "train.offload=none").in_flight < plan.in_flight


def test_one_80gb_gpu_is_refused_naming_every_phase_that_overflows_and_the_cheapest_change():
    """#55: every phase that overflows at once (a fix for training must not reveal the weight
    sync's overflow on the next try), and the cheapest change that makes the whole plan fit, with
    the plan it gives: on one 80 GiB GPU that is LoRA on two GPUs; training every weight, one node."""
    from minirl.setup.advice import advise

    rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), ["parallel.nodes=1", "parallel.gpus_per_node=1",
                                                          "parallel.ep=1", "rollout.tensor_parallel=1"])
    plan = make_plan(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B")
    assert [p.split(" ")[0] for p in plan.problems] == ["training", "weight", "rollouts:"]
    assert plan.problems[0].startswith("training needs 455.0 GiB per GPU")
    # the recipe offloads already: the moments are on the GPU for the step alone, and only more GPUs shrink them
    assert plan.problems[0].endswith("the largest part is Adam moments (sharded) (227.5 GiB, on the GPU for the step): "
                                     "more GPUs")
    assert "the largest part is fp32 weights (sharded) (113.7 GiB)" in plan.problems[1]
    for lora, want in ((True, {"train.lora.rank": 16, "train.lr": 1e-5, "parallel.gpus_per_node": 2}),
                       (False, {"parallel.gpus_per_node": 8})):
        sets, fixed = advise(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=80, lora=lora)
        assert sets == want and fixed.fits and fixed.in_flight >= 1
        for key in [k for k in sets if k != "train.lr"]:  # nothing in the advice is spare (the lr comes with LoRA)
            rest = {k: v for k, v in sets.items() if k != key}
            assert advise(recipes.with_sets(rec, rest), KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B",
                          gpu_gib=80, lora=lora)[0] != {}


@pytest.mark.parametrize("sets, want", [
    (["train.micro_batch_tokens=65536"], {"train.micro_batch_tokens": 16384}),  # the micro-batch, before offload
    (["rollout.precision=bf16"], {"train.offload": "optimizer"}),  # the sync and the KV cache: offload, before TP
    (["rollout.precision=bf16", "rollout.tensor_parallel=1"], {"train.offload": "optimizer", "rollout.tensor_parallel": 2}),
])
def test_the_advice_takes_the_cheapest_kind_of_change_first(sets, want):
    from minirl.setup.advice import advise

    rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), ["parallel.nodes=1", "train.offload=none", *sets])
    assert not make_plan(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B").fits
    got, fixed = advise(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=80)
    assert got == want and fixed.fits


def test_the_cli_plans_without_a_workspace(tmp_path):
    def dry(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", "run", "--model", "Qwen3-30B-A3B", "--dry-run", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={"PYTHONPATH": str(ROOT), "COLUMNS": "200", "HF_HUB_OFFLINE": "1",
                                   "PATH": "/usr/bin:/bin"})

    ok = dry("--replay", "r3", "--nodes", "2", "--gpus-per-node", "8", "--set", "train.lr=2e-6")
    assert ok.returncode == 0, ok.stderr[-2000:]
    # the resolved recipe comes first, as TOML that loads back to what the flags made of the model's recipe
    from minirl.config import recipes

    toml = ok.stdout.split("would hold)\n", 1)[1].split("\nplan for ", 1)[0]
    (tmp_path / "resolved").mkdir()
    (tmp_path / "resolved" / "r.toml").write_text(toml)
    flags = ["train.replay=r3", "parallel.nodes=2", "parallel.gpus_per_node=8", "train.lr=2e-6"]
    want = recipes.load(recipes.shipped("qwen3-30b-a3b"), flags)
    assert recipes.load(tmp_path / "resolved" / "r.toml", []) == want and want.train.lr == 2e-6
    (tmp_path / "resolved" / "r.toml").unlink()
    (tmp_path / "resolved").rmdir()
    assert "30.53B total, 3.35B active" in ok.stdout and "world 16, dp_shard (FSDP2) 16, ep 8" in ok.stdout
    assert "launch: minirl init WORKSPACE --model Qwen3-30B-A3B\n" in ok.stdout
    assert ("launch: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 8 --max-restarts 3 "
            "--rdzv-backend c10d --rdzv-endpoint "
            "$HEAD_NODE:29500 --rdzv-id $JOB_ID -m cli.main run WORKSPACE --model Qwen3-30B-A3B --replay r3 --set "
            "train.lr=2e-6 --resume auto"
            "   # on each of the 2 nodes") in ok.stdout
    refused = dry("--nodes", "1", "--gpus-per-node", "1", "--set", "parallel.ep=1", "--set", "rollout.tensor_parallel=1")
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("minirl: error: the plan does not fit: training needs 455.0 GiB per GPU, over 90% of 80 GiB; "
                           "weight sync needs ")
    # LoRA with its own learning rate (the shipped LoRA recipe's 10 × full RL's); the figures: the re-plan test below
    assert "; the cheapest change that fits: --gpus-per-node 2 --set train.lora.rank=16 --set train.lr=1e-05: " in line
    assert "training every weight: --gpus-per-node 8: " in refused.stdout
    assert not list(tmp_path.iterdir())  # a plan writes nothing


def test_a_refusal_names_the_largest_part_of_the_phase_that_overflows_and_what_shrinks_it(tmp_path):
    """The tiny workspace's recipe with --model Qwen3-30B-A3B on 2 × 8 GPUs, its engine kept awake
    (sleep_level 0, set: the plan's own choice would sleep), so training overflows because of vLLM's bf16 weights at TP 1 beside it, and
    the advice is tensor parallel or FP8, and the model's own recipe."""
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), "--model", "Qwen3-30B-A3B", "--replay", "r3",
                        "--dry-run", "--nodes", "2", "--gpus-per-node", "8", "--set", "rollout.sleep_level=0"],
                       cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(ROOT), "COLUMNS": "200", "HF_HUB_OFFLINE": "1",
                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("minirl: error: the plan does not fit: training needs ")
    # the tiny recipe gives its engine 10% of a GPU (rollout.memory_fraction = 0.1): too little for 30B's weights
    assert "; the cheapest change that fits: --set rollout.memory_fraction=0 --set rollout.tensor_parallel=2: " in line
    assert line.endswith("; this recipe is tiny-qwen3-moe's: Qwen3-30B-A3B's own is recipes/qwen3-30b-a3b.toml "
                         "(`minirl init WS --model Qwen3-30B-A3B`)")
    assert ("does not fit: training needs 96.2 GiB per GPU, over 90% of 80 GiB; the largest part is vLLM weights "
            "(bf16, TP 1) (56.9 GiB): raise rollout.tensor_parallel (1) or set rollout.precision = \"fp8\"") in r.stdout
    # its own recipe on one 80 GB GPU without the offload: the moments, which the offload takes off the GPU
    plan = plan_30b(1, 1, "parallel.ep=1", "rollout.tensor_parallel=1", "train.offload=none")
    assert plan.problems[0].endswith('the largest part is Adam moments (sharded) (227.5 GiB): train.offload = '
                                     '"optimizer" (host memory between updates), or more GPUs')
    # activations, when checkpointing is off, point at it
    plan = plan_30b(1, 8, "train.activation_checkpoint=none")
    assert "the largest part is activations (no AC)" in plan.problems[0]
    assert plan.problems[0].endswith('set train.activation_checkpoint = "full", or lower train.micro_batch_tokens')


def test_the_slurm_example_launches_what_the_plan_says():
    """recipes/qwen3-30b-a3b.sbatch: valid bash, one torchrun per node with the plan's restart and
    rendezvous flags, and `--resume auto`, so a requeued or restarted job continues its run."""
    from minirl.setup.dryrun import launch_commands

    script = ROOT / "recipes" / "qwen3-30b-a3b.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    plan_line = launch_commands(2, 8, "run WS")[0]
    for flag in ("--max-restarts 3", "--rdzv-backend c10d", "-m cli.main run", "--resume auto"):
        assert flag in plan_line and flag in text, flag
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --nodes=2" in text and "--nproc-per-node 8" in text


def test_a_dry_run_plans_what_init_and_run_would_run(tmp_path):
    """`run --model Qwen3-8B --dry-run` with no workspace plans the recipe `init --model Qwen3-8B`
    writes (recipes/qwen3.toml, suited to a dense model), says which Hub repo the short name is,
    and the same plan comes from the workspace init makes, on this machine without a GPU too."""
    from minirl.config import recipes

    env = {"PYTHONPATH": str(ROOT), "COLUMNS": "200", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}

    def minirl(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env)

    alone = minirl("run", "--model", "Qwen3-8B", "--dry-run", "--gpus-per-node", "8")
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "Qwen3-8B is Qwen/Qwen3-8B-Base on the Hub (its pretrained base model" in alone.stdout
    assert f"recipe: {ROOT / 'recipes' / 'qwen3.toml'}" in alone.stdout
    assert minirl("init", "ws", "--model", "Qwen3-8B").returncode == 0
    written = recipes.load(tmp_path / "ws" / "minirl.toml")
    assert (written.train.replay, written.rollout.sleep_level) == ("off", recipes.load(recipes.shipped("qwen3")).rollout.sleep_level)
    toml = alone.stdout.split("would hold)\n", 1)[1].split("\nplan for ", 1)[0]
    (tmp_path / "planned.toml").write_text(toml)
    planned = recipes.load(tmp_path / "planned.toml")
    planned.parallel.gpus_per_node = written.parallel.gpus_per_node  # the flag, not the recipe
    assert planned == written  # what init wrote is what was planned
    within = minirl("run", "ws", "--dry-run", "--gpus-per-node", "8")
    assert within.returncode == 0, within.stderr[-2000:]
    assert within.stdout.split("\nplan for ", 1)[1].split("launch:")[0] == alone.stdout.split("\nplan for ", 1)[1].split("launch:")[0].replace(
        f"recipe: {ROOT / 'recipes' / 'qwen3.toml'}", "recipe: ws/minirl.toml")


def test_lora_fits_the_30b_on_one_141gib_gpu_not_on_one_80gib_one(tmp_path):
    """#54: `minirl run --model Qwen3-30B-A3B --replay r3 --dry-run --nodes 1 --gpus-per-node 1
    --gpu-mem-gib 141` with LoRA fits: the mesh follows the one GPU (EP 8 and vLLM TP 2 of the
    two-node recipe are lowered, and the launch line says so); the bf16 base is held whole."""
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", "--model", "Qwen3-30B-A3B", "--replay", "r3",
                        "--dry-run", "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem-gib", "141",
                        "--set", "train.lora.rank=16", "--set", "train.lr=1e-5"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "COLUMNS": "250", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "for 1 × 1 GPU(s): parallel.ep = 1, rollout.tensor_parallel = 1" in r.stdout
    assert "LoRA: 843.8M adapter parameters train (2.76% of the model)" in r.stdout
    assert ("launch: minirl run WORKSPACE --model Qwen3-30B-A3B --replay r3 --set train.lora.rank=16 --set "
            "train.lr=1e-5 --set parallel.ep=1 --set rollout.tensor_parallel=1") in r.stdout
    shipped = recipes.load(recipes.shipped("qwen3-30b-a3b-lora"))
    assert (shipped.train.lora.rank, shipped.train.replay, shipped.rollout.precision) == (16, "r3", "fp8")
    one = make_plan(shipped, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=141)
    assert one.fits and one.in_flight >= 8 and one.memory_gib["gathered bf16 layers"] == 0
    assert one.memory_gib["base weights (bf16, frozen, sharded)"] * GiB == 2 * one.params
    small = make_plan(shipped, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=80)
    assert not small.fits and "the largest part is base weights (bf16, frozen, sharded)" in small.problems[0]
    node = recipes.load(recipes.shipped("qwen3-30b-a3b-lora"), ["parallel.gpus_per_node=8"])
    assert make_plan(node, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=80).fits


def test_the_mesh_follows_the_machine_only_downwards():
    rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), ["parallel.nodes=1", "parallel.gpus_per_node=4"])
    assert fit_mesh(rec, KNOWN_SHAPES["Qwen3-30B-A3B"]) == {"parallel.ep": 4}  # TP 2 fits in 4 GPUs
    assert fit_mesh(recipes.load(recipes.for_model("Qwen3-30B-A3B")), KNOWN_SHAPES["Qwen3-30B-A3B"]) == {}
    dense = recipes.load(None, ["model.id=Qwen3-8B", "rollout.tensor_parallel=4", "parallel.ep=8",
                               "parallel.gpus_per_node=2"])
    assert fit_mesh(dense, KNOWN_SHAPES["Qwen3-8B"]) == {"rollout.tensor_parallel": 2}  # no experts: EP is not its business


# Each shipped GPU recipe on the machines its docs name (docs/cluster.md: what runs where; the
# recipes' headers): nodes, GPUs per node, GiB a GPU
DOCUMENTED = [("qwen3-30b-a3b", "Qwen3-30B-A3B", 1, 8, 80), ("qwen3-30b-a3b", "Qwen3-30B-A3B", 2, 8, 80),
              ("qwen3-30b-a3b-offpolicy", "Qwen3-30B-A3B", 1, 8, 80), ("qwen3-30b-a3b-offpolicy", "Qwen3-30B-A3B", 2, 8, 80),
              ("qwen3-30b-a3b-lora", "Qwen3-30B-A3B", 1, 1, 141), ("qwen3-30b-a3b-lora", "Qwen3-30B-A3B", 1, 8, 80),
              ("qwen3-30b-a3b-lora", "Qwen3-30B-A3B", 2, 8, 80), ("qwen3", "Qwen3-0.6B", 1, 1, 80),
              ("qwen3", "Qwen3-0.6B", 1, 1, 141), ("qwen3-code", "Qwen3-8B", 1, 8, 80)]


@pytest.mark.parametrize("name, model, nodes, gpus, gib", DOCUMENTED)
def test_the_engine_of_each_shipped_recipe_starts_beside_the_trainer(name, model, nodes, gpus, gib):
    """#63: vLLM 0.32 takes ⌈total × gpu_memory_utilization⌉ at its start and refuses when less is
    free (its own `request_memory`, called here on a snapshot of that moment: the trainer's state
    between updates already on the GPU, and the plan's headroom all taken by the CUDA context and
    fragmentation). The fraction the run gives vLLM is the plan's, and it passes; the recipes'
    former 0.85 did not on one node of 8 (68 GiB asked, 57.8 GiB free)."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    rec = recipes.load(recipes.shipped(name), [f"parallel.nodes={nodes}", f"parallel.gpus_per_node={gpus}"])
    assert rec.rollout.memory_fraction == 0  # the plan derives the engine's share
    plan = make_plan(rec, KNOWN_SHAPES[model], model=model, gpu_gib=gib)
    assert plan.fits, plan.problems
    total = gib * GiB
    free = plan.engine_start_free_gib * GiB  # within the plan's 90%: the rest taken by the context
    assert free < 0.9 * total
    asked = request_memory(MemorySnapshot(auto_measure=False, device="cpu", free_memory=int(free), total_memory=int(total)),
                           CacheConfig(gpu_memory_utilization=plan.engine_fraction))
    assert asked <= free and plan.in_flight >= 1
    # what the engine takes is what the rollout phase counts: weights, working memory, KV cache
    engine = sum(v for k, v in plan.memory_gib.items() if k.startswith(("vLLM weights", "vLLM working", "vLLM KV")))
    assert plan.engine_fraction * gib == pytest.approx(engine, abs=0.001 * gib)
    if name.startswith("qwen3-30b-a3b") and "lora" not in name and nodes == 1:
        old = make_plan(recipes.with_sets(rec, {"rollout.memory_fraction": 0.85}), KNOWN_SHAPES[model], model=model)
        with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
            request_memory(MemorySnapshot(auto_measure=False, device="cpu", free_memory=int(free), total_memory=int(total)),
                           CacheConfig(gpu_memory_utilization=0.85))
        assert [p for p in old.problems if p.startswith("vLLM's start: rollout.memory_fraction = 0.85 gives the engine "
                                                        "68.0 GiB of each GPU, and 57.8 GiB are free when it starts")]


def test_the_plan_reads_the_engines_memory_fraction():
    """rollout.memory_fraction is vLLM's gpu_memory_utilization: the KV cache is what it leaves
    after the engine's weights and working memory, and a fraction more than is free when the
    engine starts is refused naming it and the most that fits."""
    plans = {f: make_plan(recipes.load(recipes.shipped("qwen3"), [f"rollout.memory_fraction={f}"]), KNOWN_SHAPES["Qwen3-4B"],
                          model="Qwen3-4B") for f in (0, 0.1, 0.25, 0.3, 0.95)}
    assert plans[0.25].fits and plans[0.3].fits and plans[0].fits
    assert plans[0.25].memory_gib["vLLM KV cache"] < plans[0.3].memory_gib["vLLM KV cache"]
    assert (plans[0.3].memory_gib["vLLM KV cache"] - plans[0.25].memory_gib["vLLM KV cache"]) == pytest.approx(0.05 * 80)
    assert plans[0.1].problems[0].startswith("rollouts: rollout.memory_fraction = 0.1 gives the engine 8.0 GiB, and its "
                                             "weights and working memory take ")
    assert plans[0.3].kv_sizing == "rollout.memory_fraction" and plans[0].kv_sizing != "rollout.memory_fraction"
    [start] = plans[0.95].problems
    most = float(start.split("set rollout.memory_fraction at most ")[1].split(",")[0])
    assert start.startswith("vLLM's start: rollout.memory_fraction = 0.95 gives the engine 76.0 GiB of each GPU")
    assert make_plan(recipes.load(recipes.shipped("qwen3"), [f"rollout.memory_fraction={most}"]), KNOWN_SHAPES["Qwen3-4B"],
                     model="Qwen3-4B").fits
    assert not make_plan(recipes.load(recipes.shipped("qwen3"), [f"rollout.memory_fraction={most + 0.002}"]),
                         KNOWN_SHAPES["Qwen3-4B"], model="Qwen3-4B").fits


ADVICE = re.compile(r"(?:cheapest change that fits|training every weight): (?P<flags>[^:]*): training (?P<train>[\d.]+), "
                    r"weight sync (?P<sync>[\d.]+), rollout (?P<rollout>[\d.]+) GiB per GPU; (?P<n>\d+) full-length")


def _dry(args, cwd):
    from click.testing import CliRunner

    from cli.main import cli

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("COLUMNS", "250")
        return CliRunner().invoke(cli, ["run", "--dry-run", *args])


def _figures(out: str) -> dict:
    peak = {m.group(1): m.group(2) for m in re.finditer(r"peak: (training|weight sync|rollout)\S*(?: \([^)]*\))?\s+([\d.]+)", out)}
    return {"train": f"{float(peak['training']):.1f}", "sync": f"{float(peak['weight sync']):.1f}",
            "rollout": f"{float(peak['rollout']):.1f}", "n": re.search(r"vLLM: (\d+) full-length", out).group(1)}


@pytest.mark.parametrize("args", [
    ["--model", "Qwen3-30B-A3B", "--replay", "r3", "--nodes", "1", "--gpus-per-node", "1"],
    ["--model", "Qwen3-30B-A3B", "--gpus-per-node", "1"],  # one node of it (the recipe's is two)
    ["--recipe", "qwen3-30b-a3b-lora"],  # one 80 GiB GPU
    ["--model", "Qwen3-8B", "--set", "rollout.memory_fraction=0.9"],
])
def test_every_printed_advice_replans_to_its_quoted_figures(args, tmp_path):
    """#63: an advice is the plan of exactly the command it prints: the dry run again with the
    advice's flags added gives the figures the advice quoted (it once kept the mesh it had lowered
    for one GPU: '9 in flight' where the 1 × 8 plan gives 28)."""
    from minirl.errors import UsageError

    first = _dry(args, tmp_path)
    assert isinstance(first.exception, UsageError), first.output[-2000:]  # refused: `minirl` exits 2 with its line
    advice = list(ADVICE.finditer(first.output))
    assert advice, first.output[-2000:]
    for a in advice:
        again = _dry(args + a.group("flags").split(), tmp_path)
        assert again.exit_code == 0, (a.group(0), again.output[-2000:])
        got, quoted = _figures(again.output), {k: a.group(k) for k in ("train", "sync", "rollout", "n")}
        # the table prints two decimals and the advice one: 54.749 is "54.75" there and "54.7" here
        assert got["n"] == quoted["n"] and all(abs(float(got[k]) - float(quoted[k])) <= 0.1001
                                               for k in ("train", "sync", "rollout")), (a.group(0), got)
    if "--gpus-per-node" in args and "--nodes" not in args:
        assert "mesh: 1 node(s) × 1 GPU(s)" in first.output and "--nnodes" not in first.output


def test_rollout_gpus_are_planned_apart_from_the_trainers(tmp_path):
    """#66: `--rollout-gpus 2` on one node of 8 H200s: the trainer's state sharded over the other 6
    GPUs, which hold no engine; each rollout GPU holds its engine alone (weights, working memory, a
    KV cache within its GPU, the bucket the weights arrive in), and vLLM's start takes its own GPU.
    The launch line starts 6 training ranks and says the flag; the dry run says a run starts
    engines of one GPU each (the recipe's TP 2 is refused at the run), and a job that cannot place
    them is refused in one line (more rollout GPUs than the node has left, TP 2). Bad layouts: one
    line each."""
    def h200(*sets):
        rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), ["parallel.nodes=1", "parallel.gpus_per_node=8", "rollout.sleep_level=0",
                                                              *sets])
        return make_plan(rec, KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B", gpu_gib=141)

    plan, beside = h200("parallel.rollout_gpus=2", "parallel.ep=2"), h200()
    P = plan.params
    assert plan.fits, plan.problems
    # on 80 GiB GPUs the trainer's state over 6 of 8 does not fit: said, naming the phase
    assert "training needs" in plan_30b(1, 8, "parallel.rollout_gpus=2", "rollout.sleep_level=0",
                                        "parallel.ep=2").problems[0]
    assert plan.mesh["world"] == 6 and plan.mesh["rollout GPUs"] == 2 and plan.mesh["vLLM engines"] == 1
    assert plan.memory_gib["fp32 weights (sharded)"] == pytest.approx(4 * P / 6 / GiB)
    assert not any(k.startswith("vLLM") for k in plan.memory_gib)  # the training GPUs hold no engine
    engine = {k.removeprefix("rollout GPU: "): v for k, v in plan.memory_gib.items() if k.startswith("rollout GPU: ")}
    assert engine["vLLM weights (fp8, TP 2)"] == pytest.approx(P / 2 / GiB)
    assert sum(engine.values()) == pytest.approx(plan.phases_gib["sampling (rollout GPUs)"])
    assert plan.phases_gib["sampling (rollout GPUs)"] <= 0.9 * 141 + 1e-9
    # alone on its GPU the engine holds more sequences than beside a trainer, at the same precision and TP
    assert plan.in_flight > beside.in_flight and plan.engine_start_free_gib == pytest.approx(0.9 * 141)
    assert plan.phases_gib["weight sync"] < beside.phases_gib["weight sync"]

    def minirl(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={"PYTHONPATH": str(ROOT), "COLUMNS": "250", "HF_HUB_OFFLINE": "1",
                                                "PATH": "/usr/bin:/bin"})

    six = ["--set", "rollout.sleep_level=0", "--set", "train.prompts_per_step=48"]  # a batch 6 training ranks split
    r = minirl("run", str(tmp_path / "none"), "--dry-run", "--model", "Qwen3-30B-A3B", "--gpus-per-node", "8",
               "--rollout-gpus", "2", "--gpu-mem-gib", "141", "--set", "rollout.sleep_level=0")
    assert r.returncode == 2 and "train.prompts_per_step = 64 must split evenly into 1 mini-batch(es) on each of 6 " \
        "rank(s)" in r.stderr  # the training ranks' share, as the run would refuse it
    r = minirl("run", str(tmp_path / "none"), "--dry-run", "--model", "Qwen3-30B-A3B", "--gpus-per-node", "8",
               "--rollout-gpus", "2", "--gpu-mem-gib", "141", *six)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "starts engines of one GPU each on rollout GPUs and refuses TP > 1" in r.stdout  # the recipe's TP 2
    assert re.search(r"launch: torchrun --nproc-per-node 6 .*--rollout-gpus 2", r.stdout)
    assert "rollout GPU: vLLM KV cache" in r.stdout and "alone on its GPU(s)" in r.stdout
    r = minirl("run", str(tmp_path / "none"), "--dry-run", "--model", "Qwen3-30B-A3B", "--nodes", "2",
               "--gpus-per-node", "8", "--rollout-gpus", "2", "--gpu-mem-gib", "141", *six)
    assert r.returncode == 0 and "rollout.tensor_parallel = 2: planned below" in r.stdout, r.stderr[-2000:]
    r = minirl("run", str(tmp_path / "none"), "--dry-run", "--model", "Qwen3-30B-A3B", "--gpus-per-node", "8",
               "--rollout-gpus", "2", "--gpu-mem-gib", "141", *six, "--set", "rollout.tensor_parallel=1")
    assert r.returncode == 0 and "planned below" not in r.stdout, r.stderr[-2000:]
    from minirl.setup.limits import Platform, check

    rec = recipes.load(recipes.for_model("Qwen3-30B-A3B"), ["parallel.gpus_per_node=8", "parallel.rollout_gpus=2",
                                                          "rollout.sleep_level=0"])
    with pytest.raises(UsageError, match="rollout.tensor_parallel = 2 on rollout GPUs: an engine there is one process"):
        check(rec, Platform("cuda", world_size=6, local_ranks=6, gpus=8))
    rec = recipes.with_sets(rec, {"rollout.tensor_parallel": 1})
    check(rec, Platform("cuda", world_size=6, local_ranks=6, gpus=8))  # 6 training ranks, 2 engines' GPUs: placed
    check(rec, Platform("cuda", world_size=12, local_ranks=6, gpus=8))  # two such nodes
    for platform, says in ((Platform("cuda", world_size=7, local_ranks=7, gpus=8), "this node shows 8 GPU(s) and its 7 "
                                                                                    "training rank(s) take 7; launch at "
                                                                                    "most 6 rank(s)"),
                           (Platform("cpu", cores=1), "needs at least 2 cores for rank 0 and the engines")):
        with pytest.raises(UsageError, match=re.escape(says)):
            check(rec, platform)
    for sets, says in ((["--rollout-gpus", "8"], "parallel.rollout_gpus = 8 leaves none of each node's 8 GPU(s) to "
                                                  "train: at most 7"),
                       (["--rollout-gpus", "3"], "parallel.rollout_gpus = 3 must hold whole engines of "
                                                  "rollout.tensor_parallel = 2"),
                       (["--rollout-gpus", "2", "--set", "rollout.sleep_level=2"], "rollout.sleep_level = 2 frees the "
                                                                                   "engine's memory for the trainer")):
        r = minirl("run", str(tmp_path / "none"), "--dry-run", "--model", "Qwen3-30B-A3B", "--gpus-per-node", "8", *sets)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def test_sampling_ahead_plans_the_weights_queued_for_the_engines_process():
    """#66: k ≥ 1 beside the trainer on one GPU, the engine awake: every sync waiting behind the
    engine's batch is a copy of the weights in its dtype (CUDA IPC), up to k of them, in the
    training and the weight-sync phases; on a CPU, k snapshots of the fp32 weights in the host's
    shared memory. A refusal names them and what shrinks them."""
    from minirl.setup.footprint import host_memory
    from minirl.setup.overflow import REMEDY

    shape = KNOWN_SHAPES["Qwen3-0.6B"]
    plans = {k: make_plan(recipes.load(None, ["rollout.sleep_level=0", f"rollout.max_staleness={k}"]), shape,
                          model="Qwen3-0.6B") for k in (0, 2)}
    P, row = param_count(shape), "weight copies queued for the engine (k ≥ 1)"
    assert row not in plans[0].memory_gib and plans[2].memory_gib[row] == pytest.approx(2 * 2 * P / GiB)
    for phase in ("training (no AC)", "weight sync"):
        assert plans[2].phases_gib[phase] - plans[0].phases_gib[phase] == pytest.approx(4 * P / GiB)
    assert REMEDY[row] == "lower rollout.max_staleness"
    cpu = {k: host_memory(recipes.load(None, [f"rollout.max_staleness={k}"]), shape, device="cpu") for k in (0, 2)}
    assert cpu[2]["weight snapshots for the engine's process (k ≥ 1)"] == 2 * 4 * P
    assert "weight snapshots for the engine's process (k ≥ 1)" not in cpu[0]
    # the k snapshots, and the engine's process itself (#75: measured, setup/footprint.py)
    from minirl.setup.footprint import ENGINE_PROCESS_BYTES

    assert cpu[2]["peak"] - cpu[0]["peak"] == pytest.approx(8 * P + ENGINE_PROCESS_BYTES)


def test_on_a_gpu_the_plan_chooses_the_micro_batch_and_the_run_trains_with_it(tmp_path):
    """#72: the 0.76B MoE's run on the H200 (32 × 8 responses of 1,024 tokens, full AC) took its whole
    batch of ~266k tokens in one micro-batch (train.micro_batch_tokens = 0) and held 80 GiB. With 0
    the plan now chooses: the whole mini-batch where every phase fits (the H200), else the largest
    power of two that does (an 80 GiB GPU); `--dry-run` prints it and `minirl run` on a GPU trains
    with it (preflight's plan, RunInputs.micro_batch_tokens). A micro-batch set in the recipe is kept."""
    import json as json_

    from minirl.models.shapes import hf_config_dict
    from minirl.setup.limits import Platform
    from minirl.setup.preflight import check_gpu_plan
    from tests.conftest import data_workspace
    from tests.gpu import kit, sequence

    shape = kit.moe_shape()
    ws = data_workspace(tmp_path / "ws")  # the sequence's moe-r3 runs the workspace's recipe with --model
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json_.dumps(hf_config_dict(shape, bos_id=0, eos_id=1, pad_id=2)))
    sets = [f"{k}={v}" for k, v in sequence.MOE_SETS.items()]
    flags = [x for kv in sets for x in ("--set", kv)]
    seen = {}
    for gib in (139.8, 79.2):
        r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), "--model", str(model), "--replay", "r3",
                            "--dry-run",
                            "--gpu-mem-gib", str(gib), *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        m = re.search(r"micro-batch ([\d,]+) tokens per GPU \(the plan's: the largest with which every phase fits\)",
                      r.stdout)
        assert m, r.stdout[-3000:]
        seen[gib] = int(m.group(1).replace(",", ""))
    rec = recipes.load(ws / "minirl.toml", [*sets, "train.replay=r3", f"model.id={model}", "model.path="])
    whole = 32 * 8 * (rec.data.max_prompt_tokens + rec.rollout.max_tokens)
    assert seen == {139.8: whole, 79.2: 131072}
    assert check_gpu_plan(rec, shape, Platform("cuda", 1, 16, 79.2)).micro_batch_tokens == 131072  # what the run takes
    kept = recipes.load(ws / "minirl.toml", [*sets, "train.replay=r3", "train.micro_batch_tokens=8192"])
    plan = check_gpu_plan(kept, shape, Platform("cuda", 1, 16, 79.2))
    assert plan.micro_batch_tokens == 8192 and not plan.micro_batch_chosen


def test_the_plan_sleeps_the_engine_only_where_it_must_and_the_dry_run_says_why(tmp_path, monkeypatch):
    """#73: on the H200 the tiny default slept its engine through every update (unmapping 12 GiB of KV
    cache and reloading every weight) for a trainer of 0.08 GiB. rollout.sleep_level = -1 (the
    default) is now the plan's: awake where the trainer's larger phase and the engine with its whole
    job's KV cache fit together, level 2 where not (the 30B recipes); a level set by hand wins, and is
    planned as set; a CPU stays awake."""
    from minirl.setup.limits import Platform
    from minirl.setup.preflight import check_gpu_plan
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")

    def dry(*args, cwd=tmp_path):
        r = subprocess.run([sys.executable, "-m", "cli.main", "run", "--dry-run", *args], cwd=cwd, capture_output=True,
                           text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        return next(ln for ln in r.stdout.splitlines() if "while the trainer trains the engine" in ln)

    assert dry(str(ws), "--gpu-mem-gib", "139.8").startswith(
        "  while the trainer trains the engine stays awake: the plan's (rollout.sleep_level = -1): the trainer's larger "
        "phase and the engine with its whole job's KV cache fit together")
    assert dry("--model", "Qwen3-30B-A3B").startswith(
        "  while the trainer trains the engine sleeps at level 2 (weights and KV cache dropped, reloaded by each sync): "
        "the plan's (rollout.sleep_level = -1): awake beside the trainer it would leave too small a KV cache for the job")
    assert dry(str(ws), "--gpu-mem-gib", "139.8", "--set", "rollout.sleep_level=2").endswith("rollout.sleep_level = 2")
    rec = recipes.load(ws / "minirl.toml", [])
    from minirl.models.shapes import TINY

    assert check_gpu_plan(rec, TINY, Platform("cuda", 1, 16, 139.8)).sleep_level == 0  # what the run sleeps at
    full = recipes.load(recipes.shipped("qwen3-30b-a3b"), [])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # one rank of a torchrun job of 2 nodes × 8
    plan = check_gpu_plan(full, KNOWN_SHAPES["Qwen3-30B-A3B"], Platform("cuda", 16, 16, 79.2))
    assert (plan.sleep_level, plan.sleep_chosen) == (2, True)
    # the plan choosing level 2 for FP8 decoded through CUDA graphs refuses it, as the validator would (#72)
    graphs = make_plan(recipes.load(recipes.shipped("qwen3-30b-a3b"), ["rollout.cuda_graphs=true"]),
                       KNOWN_SHAPES["Qwen3-30B-A3B"], model="Qwen3-30B-A3B")
    assert not graphs.fits and "set rollout.cuda_graphs = false" in graphs.problems[-1]


@pytest.mark.parametrize("args, needle", [
    # #75: each of these was planned "fits" above the GPU, or refused without the most that fits
    (["--model", "Qwen3-30B-A3B", "--replay", "r3", "--nodes", "1", "--gpus-per-node", "8",
      "--set", "rollout.kv_cache_gib=200"],
     "rollouts need 230.9 GiB per GPU, over 90% of 80 GiB, the largest part vLLM's KV cache (200.0 GiB): set "
     "rollout.kv_cache_gib at most "),
    (["--model", "Qwen3-30B-A3B", "--gpus-per-node", "8", "--rollout-gpus", "2", "--gpu-mem-gib", "141",
      "--set", "train.prompts_per_step=48", "--set", "rollout.tensor_parallel=1", "--set", "rollout.kv_cache_gib=500"],
     "sampling on a rollout GPU needs 532.2 GiB, over 90% of 141 GiB: rollout.kv_cache_gib = 500 is more than is left "
     "beside its weights, working memory and the bucket: set it at most 94.6"),
    (["--model", "Qwen3-30B-A3B", "--gpus-per-node", "8", "--rollout-gpus", "2", "--gpu-mem-gib", "141",
      "--set", "train.prompts_per_step=48", "--set", "rollout.tensor_parallel=1", "--set", "rollout.memory_fraction=0.99"],
     "vLLM's start on a rollout GPU: rollout.memory_fraction gives the engine 139.6 GiB, and 125.7 GiB are left beside "
     "the weight broadcast's bucket within 90% of 141 GiB: set it at most 0.891"),
])
def test_no_plan_says_fits_above_the_gpu_and_every_refusal_names_the_most_that_fits(args, needle, tmp_path):
    def dry(args):
        return subprocess.run([sys.executable, "-m", "cli.main", "run", "--dry-run", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"})

    r = dry(args)
    assert r.returncode == 2, r.stdout[-2000:]
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("minirl:")]
    assert needle in line, line
    # #82: the most named fits (it was rounded up: 94.7 named, then refused)
    key = args[-1].split("=")[0]
    most = line.split("at most ")[1].split(",")[0]
    r = dry([*args[:-1], f"{key}={most}"])
    assert key not in r.stderr, r.stderr[-2000:]


def test_a_dry_run_at_k_one_batch_at_a_time_says_what_in_flight_updates_would_change(tmp_path):
    """#74: at k ≥ 1 without in-flight updates a sync drains the engines, so the next batch cannot fill
    the slots a batch's stragglers leave: the simulated cluster's gain (docs/results/async.md) is the
    in-flight mode's. The dry run says so; with in-flight updates, or synchronous, it says nothing."""
    from minirl.setup.dryrun import dry_run
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")

    def notes(*sets):
        return " ".join(dry_run(ws, model_id=None, recipe_name=None, sets=list(sets), user_sets=list(sets),
                                launch_flags=[], nodes=None, gpus_per_node=None, gpu_gib=79.2).notes)

    assert "rollout.max_staleness = 2, one batch at a time" in notes("rollout.max_staleness=2")
    assert "one batch at a time" not in notes("rollout.max_staleness=2", "rollout.inflight_updates=true")
    assert "one batch at a time" not in notes()
