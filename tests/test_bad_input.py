"""Bad input of every kind, one table: each row is one exit-2 line on stderr, no traceback, and a
workspace left byte-for-byte as it was (no empty run folder for `--resume` to pick up later).

The CLI runs in this process (`cli.main.main`, the console script's own entry point) with the
real file descriptors captured, so the table costs seconds, not a Python start per row; the
subprocess path is covered by tests/test_cli.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = "runs/20260101-000000"
CKPT = f"{RUN}/checkpoints/step_000002"
LORA_RUN = "runs/20251231-000000"  # older than RUN: "latest" is still RUN


@pytest.fixture(scope="session")
def ws_template(tiny_dir, tmp_path_factory) -> Path:
    """A complete small workspace: recipe, data, model, and a run with a checkpoint at step 2."""
    from minirl.config import recipes
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer
    from tests.conftest import data_workspace

    root = data_workspace(tmp_path_factory.mktemp("badinput") / "ws", train=200, heldout=40)
    shutil.copytree(tiny_dir, root / "model/coldstart")
    rec = recipes.load(root / "minirl.toml")
    tr = Trainer(TINY, lr=1e-3)
    tr.load_hf(root / "model/coldstart")
    tr.save(root / CKPT, {"step": 2, "sampler": {"epoch": 0, "pos": 64}, "recipe": rec.to_dict(),
                          "heldout_start": {"avg@4": 0.1}})
    (root / RUN / "recipe.toml").write_text(rec.to_toml())
    (root / RUN / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    lora = recipes.load(root / "minirl.toml", ["train.lora.rank=4"])  # a LoRA run: its checkpoint, adapters only
    tr = Trainer.from_recipe(lora, TINY, device="cpu")
    tr.load_hf(root / "model/coldstart")
    tr.save(root / LORA_RUN / "checkpoints/step_000001", {"step": 1, "sampler": {"epoch": 0, "pos": 32},
                                                         "recipe": lora.to_dict()})
    (root / LORA_RUN / "recipe.toml").write_text(lora.to_toml())
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root with its content hash: "byte-for-byte unchanged" made checkable."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = ("link " + str(p.readlink()) if p.is_symlink() and not p.exists() else "dir" if p.is_dir()
                    else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# ----- mutations of the workspace ------------------------------------------------------------------
def write(rel: str, data: str | bytes):
    def f(ws: Path):
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return f


def append(rel: str, data: str):
    def f(ws: Path):
        with (ws / rel).open("a") as fh:
            fh.write(data)
    return f


def dangling(rel: str, target: str):
    def f(ws: Path):
        p = ws / rel
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        p.symlink_to(target)
    return f


def delete(rel: str):
    def f(ws: Path):
        p = ws / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return f


def truncate(rel: str, keep: float):
    def f(ws: Path):
        p = ws / rel
        p.write_bytes(p.read_bytes()[: int(p.stat().st_size * keep)])
    return f


_HOLDERS: list = []  # processes that hold a run's writer lock for a row; ended after it


def live_writer(rel: str):
    """Another process writing the run `rel`: it holds the run's lock (runlock.py) until the row ends."""
    def f(ws: Path):
        import os
        import subprocess

        script = "import sys; from minirl.run.runlock import RunLock; l = RunLock(sys.argv[1]); print('locked', flush=True); sys.stdin.read()"
        p = subprocess.Popen([sys.executable, "-c", script, str(ws / rel)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.stdout.readline().strip() == "locked"
        _HOLDERS.append(p)
    return f


_SITUATION: dict = {}  # what a row sets outside the workspace: environment variables, a Hub out of reach


def hub_down(ws: Path):
    """No route to the Hub (the real thing: tests/test_offline.py, in a network namespace)."""
    _SITUATION["hub_down"] = True


def platform(**fields):
    """The machine `setup.limits.check` checks a run against (a GPU, or fewer cores, cannot exist here)."""
    def f(ws: Path):
        _SITUATION["platform"] = fields
    return f


def env(**variables):
    def f(ws: Path):
        _SITUATION.setdefault("env", {}).update(variables)
    return f


def edit_json(rel: str, change):
    def f(ws: Path):
        p = ws / rel
        p.write_text(json.dumps(change(json.loads(p.read_text()))))
    return f


def rows(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def wrong_shape_weights(ws: Path):
    from safetensors.torch import load_file, save_file

    p = ws / "model/coldstart/model.safetensors"
    sd = load_file(str(p))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:, :32].contiguous()
    save_file(sd, str(p))


def other_model_checkpoint(ws: Path):
    from minirl.models.shapes import TINY
    from minirl.train.trainer import Trainer

    shutil.rmtree(ws / CKPT)
    Trainer(dataclasses.replace(TINY, n_layers=2), lr=1e-3).save(ws / CKPT, {"step": 2, "sampler": {"epoch": 0, "pos": 0}})


def other_recipe_checkpoint(ws: Path):
    def change(d):
        d["recipe"]["model"]["id"] = "Qwen3-30B-A3B"
        return d
    edit_json(f"{CKPT}/minirl.json", change)(ws)


def no_runs(ws: Path):
    shutil.rmtree(ws / "runs")


def combine(*fs):
    def f(ws: Path):
        for g in fs:
            g(ws)
    return f


def _shard(ws: Path) -> str:
    return str(next((ws / CKPT).glob("*.distcp")).relative_to(ws))


def missing_shard(ws: Path):
    delete(_shard(ws))(ws)


def truncated_shard(ws: Path):
    truncate(_shard(ws), 0.5)(ws)


def an_intact_checkpoint_before_a_truncated_one(ws: Path):
    shutil.copytree(ws / CKPT, ws / CKPT.replace("step_000002", "step_000001"))
    truncated_shard(ws)


def finished(ws: Path):
    """The template run ended as "finished" at the steps its recipe asked for."""
    from minirl.config import recipes

    steps = recipes.load(ws / RUN / "recipe.toml").train.steps
    write(f"{RUN}/summary.json", json.dumps({"status": "finished", "steps": steps}))(ws)


def mixed_folder(ws: Path):
    """A folder of benchmark files whose fields differ (as ../shared/data/benchmarks is)."""
    write("mixed/a.jsonl", rows([{"problem": "1+1", "answer": "2"}]))(ws)
    write("mixed/b.jsonl", rows([{"question": "1+2", "answer": "3"}]))(ws)


def an_export_folder(ws: Path):
    write("out/README.md", "# a model\n")(ws)
    write("out/config.json", "{}")(ws)
    hub_down(ws)


def an_adapter_folder(ws: Path):
    """What `export --adapter` writes for a run on a local base model (the tiny one)."""
    write("adapter/adapter_config.json", json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0,
                                                     "base_model_name_or_path": str(ws / "model/coldstart")}))(ws)
    write("adapter/adapter_model.safetensors", b"")(ws)


def another_base(ws: Path):
    """The workspace's model folder holding other weights than the ones its runs trained on."""
    from safetensors.torch import load_file, save_file

    f = ws / "model/coldstart/model.safetensors"
    state = load_file(str(f))
    save_file({k: v * 1.01 for k, v in state.items()}, str(f), metadata={"format": "pt"})


def a_file_where_the_workspace_goes(ws: Path):
    (ws.parent / "afile").write_text("not a folder")


def lr_chosen_elsewhere(ws: Path):
    """A lab workspace whose lr study chose a learning rate its recipe does not have."""
    write("minirl.toml", '[cold_start]\ntask = "scratchpad"\n[train]\nlr = 3e-4\n')(ws)
    write("lab/study-lr/full/chosen.json", json.dumps({"lr": 1e-4, "why": "", "seeds": 3, "report": "",
                                                        "chosen_at": "2026-11-26 00:00:00"}))(ws)


INIT_SMALL = ["--set", "cold_start.max_steps=1"]
ENV_FITS = ["--set", "env.max_turns=2", "--set", "env.max_reply_tokens=8"]  # an episode within the tiny model's context

# id, arguments ({ws}: the workspace, {new}: a path that does not exist), mutation, what the line says
CASES = [
    # --- init: bad recipe values fail before the folder is made -----------------------------------
    ("init-nan-lr", ["init", "{new}", "--set", "train.lr=nan"], None, "train.lr = nan; it must be a finite number"),
    ("init-no-recipe", ["init", "{new}", "--recipe", "nosuch"], None, "no shipped recipe 'nosuch'"),
    ("init-unknown-key", ["init", "{new}", "--set", "bogus.key=1"], None, "unknown recipe section [bogus]"),
    ("init-dev-too-big", ["init", "{new}", "--set", "cold_start.dev_size=50000"], None, "cold_start.dev_size (50000)"),
    ("init-target-acc", ["init", "{new}", "--set", "cold_start.target_acc=2"], None, "cold_start.target_acc = 2.0"),
    ("init-onto-a-file", ["init", "{afile}", *INIT_SMALL], a_file_where_the_workspace_goes, "is a file"),
    ("init-task-with-model", ["init", "{new}", "--task", "scratchpad", "--model", "Qwen3-8B"], None,
     "--task builds an embedded task for the tiny model; it does not go with --model"),
    ("init-task-unknown", ["init", "{new}", "--set", "cold_start.task=sudoku"], None, "cold_start.task"),
    ("init-top-k-all", ["init", "{new}", "--task", "scratchpad-long", "--set", "cold_start.top_k=16"], None,
     "cold_start.top_k (16) must be below cold_start.experts (16)"),
    ("init-another-task", ["init", "{ws}", "--task", "scratchpad"], None, "is a workspace already, with "),
    ("init-another-model", ["init", "{ws}", "--model", "Qwen3-8B"], None,
     "is a workspace already, with model.id = 'tiny-qwen3-moe'; this init asks for 'Qwen3-8B'"),
    ("init-another-value", ["init", "{ws}", "--set", "train.lr=0.001"], None,
     "is a workspace already, with train.lr = 0.0003; this init asks for 0.001. `--force` rebuilds it"),
    ("lab-dose-seeds", ["lab", "is", "{new}", "--dose-seeds", "-1"], None, "--dose-seeds -1: 0 or more"),
    ("lab-no-study", ["lab", "{new}"], None, "minirl lab STUDY [WORKSPACE]: name a study (is, offpolicy, "),
    ("lab-confirm-no-study", ["lab", "{new}", "--confirm"], None, "--confirm confirms a study"),
    ("lab-confirm-seeds", ["lab", "is", "{new}", "--confirm", "--seeds", "7"], None,
     "--confirm takes its seeds from the first stage's power"),
    ("lab-at-no-study", ["lab", "{new}", "--at", "nvfp4"], None, "--at follows up a study at another dial level"),
    ("lab-at-level", ["lab", "is", "{new}", "--at", "fp4"], None, "--at fp4: not a level of the mismatch dial"),
    ("lab-arm-no-study", ["lab", "{new}", "--arm", "clip"], None, "--arm picks some of a study's arms"),
    ("lab-arm-unknown", ["lab", "offpolicy", "{new}", "--arm", "clip", "--arm", "clip+R3"], None,
     "--arm 'clip+R3' is not an arm of the offpolicy study"),
    ("lab-rescore-no-study", ["lab", "{new}", "--rescore", "fp32"], None, "--rescore evaluates a study's runs again"),
    ("lab-rescore-lr", ["lab", "lr", "{new}", "--rescore", "fp32"], None, "(not the lr study)"),
    ("lab-rescore-level", ["lab", "is", "{new}", "--rescore", "fp4"], None, "'fp4' is not one of"),
    ("lab-lr-frozen", ["lab", "offpolicy", "{ws}"], lr_chosen_elsewhere,
     "the lr study chose train.lr = 0.0001 on the MiniRL control arm;"),
    ("doctor-small-batch", ["doctor", "-w", "{ws}", "--set", "train.prompts_per_step=4"], None,
     "train.prompts_per_step = 4: the doctor measures staleness over 8 mini-batches"),
    # --- run: recipe values and --set forms -------------------------------------------------------
    ("G=1", ["run", "{ws}", "--set", "train.group_size=1"], None, "with one response per prompt every advantage is 0"),
    ("lr-nan", ["run", "{ws}", "--set", "train.lr=nan"], None, "train.lr = nan; it must be a finite number"),
    # a run made on 2 ranks (its recipe says ep = 2) resumed in one process: the flag that does it
    ("ep-past-the-ranks", ["run", "{ws}", "--set", "parallel.ep=2"], None,
     "parallel.ep = 2 must divide the job's 1 rank(s) and the model's 8 experts (launch with torchrun "
     "--nproc-per-node N, or --set parallel.ep=1"),
    ("lr-inf", ["run", "{ws}", "--set", "train.lr=inf"], None, "train.lr = inf; it must be a finite number"),
    ("lr-negative", ["run", "{ws}", "--set", "train.lr=-1e-4"], None, "train.lr = -0.0001; it must be > 0"),
    ("greedy-rollouts", ["run", "{ws}", "--set", "rollout.temperature=0"], None, "rollout.temperature = 0 (greedy)"),
    ("greedy-eval-k4", ["run", "{ws}", "--set", "eval.temperature=0"], None, "eval.temperature = 0 (greedy)"),
    ("steps-negative", ["run", "{ws}", "--steps", "-1"], None, "train.steps = -1; it must be ≥ 0"),
    ("steps-not-int", ["run", "{ws}", "--steps", "many"], None, "'many' is not a valid integer"),
    ("unknown-key", ["run", "{ws}", "--set", "train.bogus=1"], None, "unknown recipe key train.bogus"),
    ("set-no-value", ["run", "{ws}", "--set", "train.lr"], None, "--set expects section.key=value"),
    ("set-no-key", ["run", "{ws}", "--set", "=5"], None, "--set expects section.key=value"),
    ("set-wrong-type", ["run", "{ws}", "--set", "loss.length_norm=maybe"], None, "loss.length_norm: expected bool"),
    ("minibatch-split", ["run", "{ws}", "--set", "train.prompts_per_step=30", "--set", "train.minibatches=4"], None,
     "equal mini-batches"),
    ("eps-low", ["run", "{ws}", "--set", "loss.eps_low=1.5"], None, "loss.eps_low = 1.5; it must be > 0 and ≤ 1"),
    ("tis-cap-zero", ["run", "{ws}", "--set", "loss.tis_cap=0"], None, "loss.tis_cap = 0.0; it must be > 0"),
    ("overlong-buffer-past-the-limit", ["run", "{ws}", "--set", "loss.overlong_buffer=6"], None,
     "loss.overlong_buffer = 6 must be below rollout.max_tokens = 6"),
    ("overlong-penalty-zero", ["run", "{ws}", "--set", "loss.overlong_buffer=2", "--set", "loss.overlong_penalty=0"],
     None, "loss.overlong_penalty = 0.0; it must be > 0"),
    ("unknown-grader", ["run", "{ws}", "--set", "reward.grader=nope"], None, "nope"),
    # --- multi-turn episodes (#84): an environment that cannot run is one line before anything is built ---
    ("env-not-module-class", ["run", "{ws}", "--set", "env.name=calc"], None,
     "env.name = 'calc': name the environment's class as module:Class"),
    ("env-not-importable", ["run", "{ws}", "--set", "env.name=no_such_module:Env", "--set", "env.tool_format=tiny",
                            *ENV_FITS],
     None, "env.name = 'no_such_module:Env' cannot be imported: ModuleNotFoundError"),
    ("env-not-an-environment", ["run", "{ws}", "--set", "env.name=json:JSONDecoder", "--set", "env.tool_format=tiny",
                                *ENV_FITS],
     None, "env.name = 'json:JSONDecoder' has no reset()"),
    ("env-not-callable", ["run", "{ws}", "--set", "env.name=sys:modules", "--set", "env.tool_format=tiny", *ENV_FITS],
     None, "env.name = 'sys:modules' is a dict: name an environment class, a function that builds one (TRL's "
     "environment_factory; one environment a run, not a dict of them), or a list of tool functions (TRL's tools=)"),
    ("env-list-not-of-functions", ["run", "{ws}", "--set", "env.name=json:__all__", "--set", "env.tool_format=tiny",
                                   *ENV_FITS],
     None,
     "env.name = 'json:__all__' lists 'dump', which is not a function: a list names tool functions (TRL's tools=)"),
    ("env-factory-builds-no-environment", ["run", "{ws}", "--set", "env.name=os:getcwd", "--set",
                                           "env.tool_format=tiny", *ENV_FITS], None,
     "env.name = 'os:getcwd' could not start an episode: TypeError: the factory built a str, which has no reset()"),
    ("env-qwen3-format-plain-prompts", ["run", "{ws}", "--set", "env.name=tests.test_episodes:Counter", *ENV_FITS],
     None, "env.tool_format = 'qwen3' writes replies as Qwen3's chat template renders tool messages, and "
           "data.chat_template = false sends the prompt as plain text"),
    ("env-reset-hangs", ["run", "{ws}", "--set", "env.name=tests.test_episodes:ResetHangs", "--set",
                         "env.tool_format=tiny", "--set", "env.step_timeout_s=0.3", *ENV_FITS], None,
     "env.name = 'tests.test_episodes:ResetHangs' could not start an episode: its constructor and reset() took longer "
     "than env.step_timeout_s = 0.3 s"),
    ("env-cannot-start-an-episode", ["run", "{ws}", "--set", "env.name=tests.test_episodes:ResetFails", "--set",
                                     "env.tool_format=tiny", *ENV_FITS], None,
     "env.name = 'tests.test_episodes:ResetFails' could not start an episode: ConnectionError: the environment server is down"),
    ("env-tensor-parallel-ranks", ["run", "{ws}", "--set", "env.name=tests.test_episodes:Counter", "--set",
                                   "env.tool_format=tiny", "--set", "rollout.tensor_parallel=2"], platform(world_size=2),
     "the ranks of a tensor-parallel engine would each step environments of their own for the same episodes"),
    ("env-episode-past-the-context", ["run", "{ws}", "--set", "env.name=tests.test_episodes:Counter", "--set",
                                      "env.tool_format=tiny", "--set", "env.max_reply_tokens=40"], None,
     "an episode may take 143 positions"),
    ("env-reply-below-its-scaffold", ["run", "{ws}", "--set", "env.name=tests.test_episodes:Counter", "--set",
                                      "env.tool_format=tiny", "--set", "env.max_turns=2", "--set",
                                      "env.max_reply_tokens=3"],
     None, "env.max_reply_tokens = 3 cannot hold a reply in env.tool_format = 'tiny': its scaffold and cut marker take "
           "3 tokens of this model's vocabulary (set env.max_reply_tokens ≥ 4)"),
    ("env-constructor-exits", ["run", "{ws}", "--set", "env.name=tests.test_env_faults:ExitsInConstructor", "--set",
                               "env.tool_format=tiny", *ENV_FITS], None,
     "env.name = 'tests.test_env_faults:ExitsInConstructor' could not start an episode: SystemExit: the server said "
     "goodbye"),
    # --- #99: a flag's table is JSON, said; a constructor's argument named by its key, not by the class ---
    ("env-params-toml-table", ["run", "{ws}", "--set", 'env.params={{base_url = "http://127.0.0.1:8000"}}'], None,
     "env.params: expected dict, got '{base_url = \"http://127.0.0.1:8000\"}' (a flag's table is a JSON object: "
     "--set 'env.params={\"name\": \"value\"}', double-quoted keys and strings)"),
    ("env-params-unknown-key", ["run", "{ws}", "--set", "env.name=minirl.data.tools:Calculator", "--set",
                                "env.tool_format=tiny", "--set", 'env.params={{"base_url": "http://x"}}', *ENV_FITS],
     None,
     "env.params.base_url: the constructor of minirl.data.tools:Calculator takes no 'base_url' (it takes none)"),
    ("env-reward-func-needs-a-field", ["run", "{ws}", "--set", "env.name=minirl.data.tools:Calculator", "--set",
                                       "env.tool_format=tiny", "--set", "env.reward_func=json:dumps", *ENV_FITS], None,
     "env.reward_func = 'json:dumps' takes 'obj', a field the rows do not have: minirl calls it on the environment's "
     "worker with environments=[env] and the row's fields"),
    ("env-reward-func-not-a-function", ["run", "{ws}", "--set", "env.name=minirl.data.tools:Calculator", "--set",
                                        "env.tool_format=tiny", "--set", "env.reward_func=json:__all__", *ENV_FITS],
     None, "env.reward_func = 'json:__all__' is a list: name a reward function, reward_func(environments, **kwargs) as "
     "TRL's take them"),
    ("env-reward-func-beside-get-reward", ["run", "{ws}", "--set", "env.name=tests.openenv_shapes:CalcTrl", "--set",
                                           "env.tool_format=tiny", "--set",
                                           "env.reward_func=tests.data.trl.grpo_2048:reward_score", *ENV_FITS], None,
     "env.name = 'tests.openenv_shapes:CalcTrl' has its own get_reward(), and env.reward_func = "
     "'tests.data.trl.grpo_2048:reward_score' names another reward: TRL would add the two; keep one"),
    ("env-reward-func-unnamed", ["run", "{ws}", "--set", "env.reward_func=score"], None,
     "env.reward_func = 'score': name the reward function as module:function (importable), or \"\" for none"),
    ("env-reward-func-without-env", ["run", "{ws}", "--set", "env.reward_func=m:f"], None,
     "env.reward_func = 'm:f' reads an environment, and env.name names none"),
    ("env-params-for-tool-functions", ["run", "{ws}", "--set", "env.name=tests.openenv_shapes:CALC_FUNCTIONS", "--set",
                                       "env.tool_format=tiny", "--set", 'env.params={{"base_url": "http://x"}}',
                                       *ENV_FITS], None,
     "env.params.base_url: tests.openenv_shapes:CALC_FUNCTIONS, a list of tool functions, takes no 'base_url' (it "
     "takes none)"),
    ("init-rg-param-of-a-wrong-type", ["init", "{new}", "--task", "rg:chain_sum", "--set",
                                       'cold_start.task_params={{"min_digits": 1.5}}'], None,
     "cold_start.task_params.min_digits = 1.5: rg:chain_sum's config (ChainSumConfig) takes int"),
    # --- #97: the sampler's cuts ---
    ("rollout-cut-on-a-gpu", ["run", "{ws}", "--set", "rollout.top_p=0.9"], platform(device="cuda"),
     "rollout.top_p / top_k / min_p: the trainer renormalizes π over what the sampler kept, which the CPU engine "
     "records and vLLM's CUDA path does not return yet"),
    ("renormalize-kept-off-uncut", ["run", "{ws}", "--set", "loss.renormalize_kept=false"], None,
     "loss.renormalize_kept = false (the ablation of #97) acts on rollouts the sampler cuts"),
    ("eval-top-p-zero", ["eval", "heldout", "{ws}", "--set", "eval.top_p=0"], None,
     "eval.top_p = 0.0; it must be > 0 and ≤ 1"),
    ("env-isolation", ["run", "{ws}", "--set", "env.isolation=docker"], None, "env.isolation = 'docker'"),
    ("env-reward-mode", ["run", "{ws}", "--set", "env.reward=mean"], None, "env.reward = 'mean'"),
    ("env-concurrency-negative", ["run", "{ws}", "--set", "env.max_concurrency=-1"], None,
     "env.max_concurrency = -1; it must be ≥ 0"),
    ("env-params-without-env", ["run", "{ws}", "--set", "env.params={{\"a\": 1}}"], None,
     "env.params = {'a': 1} configure an environment, and env.name names none"),
    ("params-not-json", ["run", "{ws}", "--set", "reward.params=notjson"], None, "reward.params: expected dict"),
    ("rollout-precision", ["run", "{ws}", "--set", "rollout.precision=int8"], None, "rollout.precision = 'int8'"),
    ("rollout-dtype-old", ["run", "{ws}", "--set", "rollout.dtype=bfloat16"], None,
     "rollout.dtype was replaced by rollout.precision"),
    ("is-off-uncorrected", ["run", "{ws}", "--set", "loss.is_mode=off"], None,
     "loss.is_mode = 'off' leaves the gap between the rollout engine (vLLM, bf16) and the trainer uncorrected"),
    ("replay-choice", ["run", "{ws}", "--replay", "r5"], None, "Invalid value for '--replay'"),
    ("sleep-on-cpu", ["run", "{ws}", "--set", "rollout.sleep_level=2"], None,
     "rollout.sleep_level = 2: vLLM's CPU backend has no sleep mode; set rollout.sleep_level = 0"),
    ("staleness-on-gpu-asleep", ["run", "{ws}", "--set", "rollout.max_staleness=1", "--set", "rollout.sleep_level=1"],
     platform(device="cuda"), "the engine samples on the trainer's GPU while it trains, so it cannot sleep"),
    ("staleness-under-torchrun", ["run", "{ws}", "--set", "rollout.max_staleness=2"], platform(world_size=2),
     "set rollout.max_staleness = 0 under torchrun"),
    ("staleness-one-core", ["run", "{ws}", "--set", "rollout.max_staleness=1"], platform(cores=1),
     "rollout.max_staleness = 1 needs at least 2 cores for a trainer and an engine; this process has 1"),
    ("staleness-long-tmpdir", ["run", "{ws}", "--set", "rollout.max_staleness=1"], platform(tmpdir="/tmp/" + "x" * 71),
     "(76 characters), and a socket's path must fit in 107 bytes: set TMPDIR to a folder of at most 75 characters"),
    ("rollout-gpus-negative", ["run", "{ws}", "--rollout-gpus", "-1"], None, "parallel.rollout_gpus = -1; it must be ≥ 0"),
    ("rollout-gpus-tp", ["run", "{ws}", "--rollout-gpus", "2", "--set", "rollout.tensor_parallel=2"], None,
     "rollout.tensor_parallel = 2 on rollout GPUs: an engine there is one process on one GPU"),
    ("staleness-negative", ["run", "{ws}", "--set", "rollout.max_staleness=-1"], None,
     "rollout.max_staleness = -1; it must be ≥ 0"),
    ("staleness-not-an-integer", ["run", "{ws}", "--set", "rollout.max_staleness=1.5"], None,
     "rollout.max_staleness: expected int, got '1.5'"),
    ("inflight-without-staleness", ["run", "{ws}", "--set", "rollout.inflight_updates=true"], None,
     "rollout.inflight_updates = true loads a sync while the engine samples ahead of the trainer; with "
     "rollout.max_staleness = 0 nothing is sampled ahead"),
    ("clip-anchor-without-staleness", ["run", "{ws}", "--set", "loss.clip_against=proximal"], None,
     "loss.clip_against = 'proximal' anchors the clip of tokens sampled behind the trained weights; with "
     "rollout.max_staleness = 0 none is"),
    ("overlap-in-an-old-recipe", ["run", "{ws}", "--set", "rollout.overlap=true"], None,
     "rollout.overlap was replaced by rollout.max_staleness (overlap = true → max_staleness = 1, false → 0"),
    ("unknown-model", ["run", "{ws}", "--model", "gpt-5"], None, "model.id = 'gpt-5'"),
    ("lr-factor-zero", ["run", "{ws}", "--set", "guard.lr_factor=0"], None, "guard.lr_factor = 0.0"),
    ("ckpt-every-zero", ["run", "{ws}", "--set", "checkpoint.every=0"], None, "checkpoint.every = 0; it must be ≥ 1"),
    # --- what the engines receive, against the model and the machine --------------------------------
    ("max-tokens-20-digits", ["run", "{ws}", "--set", "rollout.max_tokens=12345678901234567890"], None,
     "rollout.max_tokens = 12345678901234567890: with data.max_prompt_tokens = 16 a sequence would need"),
    ("max-tokens-past-context", ["run", "{ws}", "--set", "rollout.max_tokens=64"], None,
     "the model's context is 64 tokens (max_position_embeddings in its config.json); at most 47"),
    ("prompt-past-context", ["run", "{ws}", "--set", "data.max_prompt_tokens=63"], None,
     "data.max_prompt_tokens = 63: the model's context is 64 tokens"),
    ("kv-cache-past-memory", ["run", "{ws}", "--set", "rollout.kv_cache_gib=1e6"], None,
     "rollout.kv_cache_gib = 1000000.0 is more than this machine can give one engine"),
    ("batch-past-memory", ["run", "{ws}", "--set", "train.prompts_per_step=400000"], None,
     "3,200,000 sequences of up to 23 tokens are sampled at once on a CPU and need 97.66 GiB of KV cache; "
     "this machine has"),
    ("group-past-vllms-n", ["run", "{ws}", "--set", "train.group_size=100000"], None,
     "train.group_size = 100000; it must be ≥ 1 and ≤ 16384"),
    ("eval-k-past-vllms-n", ["eval", "-w", "{ws}", "--k", "20000"], None, "eval.k = 20000; it must be ≥ 1 and ≤ 16384"),
    ("dry-run-gpu-mem-inf", ["run", "{new}", "--model", "Qwen3-8B", "--dry-run", "--gpu-mem-gib", "inf"], None,
     "Invalid value for '--gpu-mem-gib': 'inf': it must be a finite number above 0"),
    ("dry-run-gpu-mem-nan", ["run", "{new}", "--model", "Qwen3-8B", "--dry-run", "--gpu-mem-gib", "nan"], None,
     "'nan': it must be a finite number above 0"),
    ("dry-run-gpu-mem-zero", ["run", "{new}", "--model", "Qwen3-8B", "--dry-run", "--gpu-mem-gib", "0"], None,
     "'0': it must be a finite number above 0"),
    ("dry-run-lora-rank", ["run", "{new}", "--model", "Qwen3-30B-A3B", "--dry-run", "--set", "train.lora.rank=100000"],
     None, "train.lora.rank = 100000 is above the width of the"),
    ("dry-run-lora-target", ["run", "{new}", "--model", "Qwen3-8B", "--dry-run", "--set", "train.lora.rank=8",
                             "--set", "train.lora.targets=experts"], None,
     "train.lora.targets names experts, which this model does not have"),
    ("dry-run-tp-heads", ["run", "{new}", "--model", "Qwen3-8B", "--dry-run", "--nodes", "1", "--gpus-per-node", "3",
                          "--set", "rollout.tensor_parallel=3"], None,
     "rollout.tensor_parallel = 3 must divide the model's 32 attention heads"),
    ("init-lora-target-absent", ["init", "{new}", "--model", "Qwen3-8B", "--set", "train.lora.rank=8",
                                 "--set", "train.lora.targets=experts"], None,
     "train.lora.targets names experts, which this model does not have"),
    ("init-replay-on-dense", ["init", "{new}", "--model", "Qwen3-8B", "--set", "train.replay=r3"], None,
     "train.replay = 'r3' replays MoE routes, and Qwen3-8B is a dense model; use off"),
    ("init-tiny-lora-target", ["init", "{new}", "--set", "train.lora.rank=4", "--set", "train.lora.targets=mlp"], None,
     "train.lora.targets names mlp, which this model does not have"),
    ("batch-past-kv-cache", ["run", "{ws}", "--set", "train.group_size=64", "--set", "rollout.kv_cache_gib=0.01"], None,
     "2,048 sequences of up to 23 tokens are sampled at once on a CPU and need 0.06 GiB of KV cache; "
     "rollout.kv_cache_gib = 0.01, room for 327 of them"),
    ("eval-max-tokens-past-context", ["eval", "-w", "{ws}", "--checkpoint", "coldstart", "--set",
                                      "eval.max_tokens=99999999999999999999"], None,
     "eval.max_tokens = 99999999999999999999: the model's context is 64 tokens"),
    # --- data the grader cannot grade ---------------------------------------------------------------
    ("code-grader-no-tests", ["run", "{ws}", "--set", "reward.grader=code"], None,
     "grader 'code' needs 'test' and 'entry_point', or 'input_output', or 'inputs' and 'outputs' in each record; "
     "dataset 'data/train.jsonl' has no such field"),
    ("math-grader-no-answer", ["run", "{ws}", "--set", "reward.grader=math", "--set", 'reward.params={{"answer_field": "solution"}}'],
     None, "grader 'math' needs 'solution' in each record; dataset 'data/train.jsonl' has no such field"),
    ("eval-code-grader-no-tests", ["eval", "-w", "{ws}", "--checkpoint", "coldstart", "--set", "reward.grader=code"], None,
     "grader 'code' needs 'test' and 'entry_point'"),
    ("eval-answer-null", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart", "--data", "{ws}/aime.jsonl"],
     write("aime.jsonl", rows([{"problem": "1+1", "answer": "2"}, {"problem": "1+2", "answer": None}])),
     "grader 'math' needs 'answer' in each record; row 2 of"),
    # #82 on the eval path: a numeric problem among strings read as JSON text ('"1+1"'), a numeric one alone
    # str()-ed into a prompt, and a KV cache beyond the machine a vLLM traceback after the engine's start
    ("eval-problem-mixed-types", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart", "--data", "{ws}/aime.jsonl"],
     write("aime.jsonl", rows([{"problem": "1+1", "answer": "2"}, {"problem": 12, "answer": "3"}])),
     "(aime.jsonl line 2): field 'problem' holds a int (12) where its other rows hold a str"),
    ("eval-problem-a-number", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart", "--data", "{ws}/aime.jsonl"],
     write("aime.jsonl", rows([{"problem": 12, "answer": "3"}])), "field 'problem' holds a int (12); a problem is text"),
    ("eval-kv-cache-beyond-the-machine", ["eval", "-w", "{ws}", "--checkpoint", "coldstart", "--set",
                                          "rollout.kv_cache_gib=100000"], None,
     "rollout.kv_cache_gib = 100000.0 is more than this machine can give one engine"),
    ("eval-env-not-importable", ["eval", "-w", "{ws}", "--checkpoint", "coldstart", "--set",
                                 "env.name=no_such_module:Env", "--set", "env.tool_format=tiny"], None,
     "env.name = 'no_such_module:Env' cannot be imported: ModuleNotFoundError"),
    ("eval-env-qwen3-format-plain-prompts", ["eval", "-w", "{ws}", "--checkpoint", "coldstart", "--set",
                                             "env.name=tests.test_episodes:Counter"], None,
     "env.tool_format = 'qwen3' writes replies as Qwen3's chat template renders tool messages"),
    ("wandb-without-login", ["run", "{ws}", "--set", "metrics.wandb=true"],
     env(WANDB_API_KEY="", WANDB_MODE="", WANDB_IDENTITY_TOKEN_FILE="", NETRC="/nonexistent", WANDB_CONFIG_DIR="/nonexistent"),
     "metrics.wandb = true, and there is no W&B login here"),
    ("dry-run-engine-start", ["run", "{new}", "--recipe", "qwen3-30b-a3b", "--dry-run", "--gpus-per-node", "8",
                              "--set", "rollout.memory_fraction=0.85"], None,
     "vLLM's start: rollout.memory_fraction = 0.85 gives the engine 68.0 GiB of each GPU, and 57.8 GiB are free"),
    ("fp8-graphs-sleep-2", ["run", "{new}", "--recipe", "qwen3-30b-a3b", "--dry-run", "--set", "rollout.cuda_graphs=true",
                            "--set", "rollout.sleep_level=2"], None, "with rollout.cuda_graphs = true and rollout.sleep_level = 2: vLLM's FP8 MoE decode through CUDA graphs "
     "returned non-finite log-probs after the engine's first sleep on an H200 (#72"),
    ("rollout-gpus-64-on-cpu", ["run", "{ws}", "--rollout-gpus", "64"], platform(memory_gib=24.0),
     "engine processes' own memory (measured) 32.0"),  # #75: an engine process at ~33 MB had passed it
    ("runs-is-a-file", ["run", "{ws}"], lambda ws: (shutil.rmtree(ws / "runs"), (ws / "runs").write_text("x")),
     "runs is a file, where the workspace keeps its runs' folders: move it away"),
    ("run-plan-on-this-gpu", ["run", "{ws}"], platform(device="cuda", memory_gib=1.0),
     "(planned for this job: 1 × 1 GPU(s) of 1.0 GiB)"),
    ("dry-run-replay-on-dense", ["run", "{new}", "--model", "Qwen3-8B", "--replay", "r3", "--dry-run"], None,
     "train.replay = 'r3' replays MoE routes, and Qwen3-8B is a dense model; use off"),
    ("model-offline-not-cached", ["run", "{ws}", "--model", "someone/not-cached-here"], env(HF_HUB_OFFLINE="1"),
     "model 'someone/not-cached-here' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: pass a local "
     "HF model folder, or unset HF_HUB_OFFLINE to download it"),
    # --- the recipe file itself --------------------------------------------------------------------
    ("toml-syntax", ["run", "{ws}"], write("minirl.toml", "[train\nsteps = 1\n"), "malformed recipe"),
    ("toml-top-level-key", ["run", "{ws}"], write("minirl.toml", "steps = 1\n"), "must be a [section]"),
    ("toml-wrong-type", ["run", "{ws}"], write("minirl.toml", "[train]\nsteps = 'ten'\n"), "train.steps: expected int"),
    # #75: a TOML value is typed as TOML types it: a string is no bool (or number), as --set's would be parsed
    ("toml-string-for-bool", ["run", "{ws}"], write("minirl.toml", "[rollout]\ninflight_updates = \"yes\"\n"),
     "rollout.inflight_updates: expected bool, got 'yes'"),
    ("toml-string-for-int", ["run", "{ws}"], write("minirl.toml", "[train]\nsteps = \"10\"\n"),
     "train.steps: expected int, got '10'"),
    # #82: a float key takes a TOML float or integer, nothing else; other TOML types and bad bytes: one line
    ("toml-string-for-float", ["run", "{ws}"], write("minirl.toml", "[train]\nlr = \"3e-4\"\n"),
     "train.lr: expected float, got '3e-4' (a TOML string: write 3e-4 without quotes)"),
    ("toml-array-for-float", ["run", "{ws}"], write("minirl.toml", "[train]\nlr = [3e-4]\n"),
     "train.lr: expected float, got [0.0003]"),
    ("toml-date-for-float", ["run", "{ws}"], write("minirl.toml", "[rollout]\ntemperature = 2026-12-01\n"),
     "rollout.temperature: expected float, got datetime.date(2026, 12, 1) (a TOML date)"),
    ("toml-array-for-str", ["run", "{ws}"], write("minirl.toml", "[reward]\ngrader = [\"math\"]\n"),
     "reward.grader: expected str, got ['math']"),
    ("toml-latin-1-byte", ["run", "{ws}"], write("minirl.toml", b"[train]\n# caf\xe9\nsteps = 3\n"),
     "line 2 holds the byte b'\\xe9', which is not UTF-8 (TOML files are UTF-8): re-save it as UTF-8"),
    ("toml-unknown-section", ["run", "{ws}"], write("minirl.toml", "[trian]\nlr = 1\n"), "unknown recipe section [trian]"),
    ("toml-nan", ["run", "{ws}"], write("minirl.toml", "[train]\nlr = nan\n"), "train.lr = nan"),
    ("not-a-workspace", ["run", "{ws}"], delete("minirl.toml"), "is not a minirl workspace"),
    ("a-folder-inside-for-its-workspace", ["samples", "{ws}/model/coldstart"], None, "is inside the workspace"),
    # --- data files ---------------------------------------------------------------------------------
    ("runs-a-dangling-link", ["run", "{ws}"], dangling("runs", "/nonexistent/minirl-runs"),
     "runs is a link to /nonexistent/minirl-runs, which does not exist: create that folder, or remove the link"),
    ("status-of-the-runs-folder", ["status", "{ws}", "--run", "."], None, "no run '.' in"),
    ("status-of-no-name", ["status", "{ws}", "--run", ""], None, "no run '' in"),
    ("status-of-a-path-past-runs", ["status", "{ws}", "--run", "../data"], None, "no run '../data' in"),
    ("train-missing", ["run", "{ws}"], delete("data/train.jsonl"), "train.jsonl not found"),
    ("train-empty", ["run", "{ws}"], write("data/train.jsonl", ""), "train.jsonl is empty"),
    # #82: one row of another type made `datasets` read every row of the field as JSON text
    ("train-a-numeric-prompt", ["run", "{ws}"], append("data/train.jsonl", '{"prompt": 12, "answer": "3"}\n'),
     "(train.jsonl line 201): field 'prompt' holds a int (12) where its other rows hold a str: one type per field"),
    ("train-a-numeric-answer", ["run", "{ws}"], append("data/train.jsonl", '{"prompt": "1+2=", "answer": 3}\n'),
     "(train.jsonl line 201): field 'answer' holds a int (3) where its other rows hold a str"),
    ("train-not-json", ["run", "{ws}"], write("data/train.jsonl", "this is not json\nnor this\n"), "cannot load dataset"),
    ("train-no-prompt-field", ["run", "{ws}"], write("data/train.jsonl", rows([{"question": "1+1=", "answer": "2"}] * 40)),
     "has no field 'prompt'"),
    ("train-int-prompts", ["run", "{ws}"], write("data/train.jsonl", rows([{"prompt": 12, "answer": "3"}] * 40)),
     "field 'prompt' must be a string, got int"),
    ("train-10MB-line", ["run", "{ws}"], write("data/train.jsonl", rows([{"prompt": "1" * 10_000_000, "answer": "1"}])),
     "data/train.jsonl"),
    ("train-binary", ["run", "{ws}"], write("data/train.jsonl", bytes(range(256)) * 64), "cannot load dataset"),
    ("heldout-no-answer", ["run", "{ws}"], write("data/heldout.jsonl", rows([{"prompt": "1+1="}] * 10)),
     "has no field 'answer'"),
    ("prompts-too-long", ["run", "{ws}", "--set", "data.max_prompt_tokens=1"], None, "no usable rows"),
    ("too-few-prompts", ["run", "{ws}", "--set", "train.prompts_per_step=1000"], None,
     "fewer than train.prompts_per_step (1000)"),
    # --- model folders ------------------------------------------------------------------------------
    ("model-no-config", ["run", "{ws}"], delete("model/coldstart/config.json"), "config.json not found"),
    ("model-config-garbage", ["run", "{ws}"], write("model/coldstart/config.json", "{oops"), "is not readable JSON"),
    ("model-other-arch", ["run", "{ws}"], edit_json("model/coldstart/config.json", lambda d: {**d, "architectures": ["LlamaForCausalLM"]}),
     "supported: Qwen3MoeForCausalLM"),
    ("model-truncated", ["run", "{ws}"], truncate("model/coldstart/model.safetensors", 0.5), "model.safetensors are"),
    ("model-no-weights", ["run", "{ws}"], delete("model/coldstart/model.safetensors"), "has no *.safetensors"),
    ("model-wrong-shape", ["run", "{ws}"], wrong_shape_weights, "model.embed_tokens.weight has shape [32, 32]"),
    ("model-path-missing", ["run", "{ws}", "--set", "model.path=nowhere"], None, "model folder"),
    # --- checkpoints (--resume) ---------------------------------------------------------------------
    ("resume-truncated-json", ["run", "{ws}", "--resume"], truncate(f"{CKPT}/minirl.json", 0.5), "minirl.json is damaged"),
    ("resume-missing-shard", ["run", "{ws}", "--resume"], missing_shard, "is missing"),
    ("resume-truncated-shard", ["run", "{ws}", "--resume"], truncated_shard, "bytes, "),
    ("resume-no-metadata", ["run", "{ws}", "--resume"], delete(f"{CKPT}/.metadata"), "DCP metadata missing"),
    ("resume-other-model", ["run", "{ws}", "--resume"], other_model_checkpoint, "does not hold this model"),
    ("resume-other-recipe", ["run", "{ws}", "--resume"], other_recipe_checkpoint, "is of model 'Qwen3-30B-A3B'"),
    ("resume-nothing", ["run", "{ws}", "--resume"], no_runs, "nothing to resume"),
    ("resume-no-such-run", ["run", "{ws}", "--resume", "20991231-000000"], None, "not a run of"),
    ("resume-named-run-damaged", ["run", "{ws}", "--resume", RUN.split("/")[1]], delete(f"{CKPT}/.metadata"),
     "DCP metadata missing"),
    ("resume-finished", ["run", "{ws}", "--resume"], finished, "has finished (300 of 300 steps): nothing to resume"),
    ("resume-live-writer", ["run", "{ws}", "--resume"], live_writer(RUN), "is being written by pid"),
    ("resume-auto-live-writer", ["run", "{ws}", "--resume", "auto"], live_writer(RUN), "is being written by pid"),
    # --- a damaged checkpoint, read by export, eval and doctor -------------------------------------
    ("export-shard-size-typo", ["export", "{ws}", "{new}", "--max-shard-size", "5GBB"], None,
     "'5GBB': give a size with its unit, e.g. 5GB or 500MB"),
    ("export-shard-size-negative", ["export", "{ws}", "{new}", "--max-shard-size", "-1GB"], None,
     "'-1GB': a shard must hold at least one byte"),
    ("export-truncated-shard", ["export", "-w", "{ws}", f"{{ws}}/{RUN}", "{new}"], truncated_shard,
     "shard __0_0.distcp is"),
    ("export-truncated-shard-instead", ["export", "-w", "{ws}", f"{{ws}}/{RUN}", "{new}"],
     an_intact_checkpoint_before_a_truncated_one, "needed; its run's newest intact checkpoint is step_000001"),
    ("export-no-metadata", ["export", "-w", "{ws}", f"{{ws}}/{RUN}", "{new}"], delete(f"{CKPT}/.metadata"),
     "DCP metadata missing"),
    ("eval-truncated-shard", ["eval", "-w", "{ws}", "--checkpoint", f"{{ws}}/{CKPT}"], truncated_shard,
     "its run has no other intact checkpoint"),
    ("doctor-truncated-shard", ["doctor", "-w", "{ws}", "--checkpoint", f"{{ws}}/{CKPT}"], truncated_shard,
     "shard __0_0.distcp is"),
    ("doctor-latest-truncated", ["doctor", "-w", "{ws}"], an_intact_checkpoint_before_a_truncated_one,
     "its run's newest intact checkpoint is step_000001"),
    # --- eval ---------------------------------------------------------------------------------------
    ("eval-unknown-bench", ["eval", "aime99", "-w", "{ws}"], None, "unknown benchmark 'aime99'"),
    # a workspace given as the positional argument or -w, to every command (`eval WS` as `run WS`)
    ("eval-workspace-positional", ["eval", "{ws}", "--k", "0"], None, "eval.k = 0; it must be ≥ 1"),
    ("eval-bench-and-workspace", ["eval", "aime99", "{ws}"], None, "unknown benchmark 'aime99'"),
    ("status-two-workspaces", ["status", "{ws}", "-w", "{new}"], None, "two workspaces given"),
    ("status-no-workspace", ["status", "{new}"], None, "workspaces beside it: ws;"),
    ("run-w-workspace", ["run", "-w", "{ws}", "--set", "train.lr=nan"], None, "train.lr = nan; it must be a finite"),
    ("lora-negative-rank", ["run", "{ws}", "--set", "train.lora.rank=-1"], None, "train.lora.rank = -1; it must be ≥ 0"),
    ("lora-rank-too-wide", ["run", "{ws}", "--set", "train.lora.rank=65"], None,
     "train.lora.rank = 65 is above the width of the 'q' weights (64)"),
    ("lora-targets-absent", ["run", "{ws}", "--set", "train.lora.rank=4", "--set", "train.lora.targets=mlp"], None,
     "train.lora.targets names mlp, which this model does not have"),
    ("lora-targets-unknown", ["run", "{ws}", "--set", "train.lora.rank=4", "--set", "train.lora.targets=gate"], None,
     "train.lora.targets = 'gate': name weights among q, k, v, o, mlp, experts, or all"),
    ("offload-unknown", ["run", "{ws}", "--set", "train.offload=adam"], None,
     "train.offload = 'adam'; choose one of none, optimizer"),
    ("export-adapter-of-full-run", ["export", "-w", "{ws}", f"{{ws}}/{RUN}", "{new}", "--adapter"], None,
     "trained every weight (train.lora.rank = 0), so it has no LoRA adapter"),
    ("resume-full-with-lora", ["run", "{ws}", "--resume", "--set", "train.lora.rank=4"], None,
     "trained every weight and this run asks for LoRA (rank 4"),
    ("resume-lora-without", ["run", "{ws}", "--resume", LORA_RUN.split("/")[1], "--set", "train.lora.rank=0"], None,
     "is of a LoRA run (rank 4, α 32, on q,k,v,o,experts) and this run trains every weight"),
    ("resume-lora-other-rank", ["run", "{ws}", "--resume", LORA_RUN.split("/")[1], "--set", "train.lora.rank=8"], None,
     "holds LoRA adapters of rank 4, α 32, on q,k,v,o,experts and this run's [train.lora] asks for rank 8"),
    ("resume-lora-other-base", ["run", "{ws}", "--resume", LORA_RUN.split("/")[1]], another_base,
     "holds other weights"),
    ("doctor-workspace-positional", ["doctor", "{ws}", "--seeds", "0"], None, "--seeds"),
    ("export-workspace-as-source", ["export", "{ws}", "{new}", "--step", "7"], None, "no checkpoint of step 7"),
    ("export-workspace-without-out", ["export", "{ws}"], None, "is what to export, and OUT is missing"),
    ("export-checkpoint-without-out", ["export", f"{{ws}}/{CKPT}"], None, "is what to export, and OUT is missing"),
    ("eval-no-checkpoint", ["eval", "-w", "{ws}", "--checkpoint", "/nonexistent/ckpt"], None, "checkpoint not found"),
    ("eval-damaged-json", ["eval", "-w", "{ws}", "--checkpoint", f"{{ws}}/{CKPT}"], truncate(f"{CKPT}/minirl.json", 0.3),
     "is not readable JSON"),
    ("eval-missing-shard", ["eval", "-w", "{ws}"], missing_shard, "is missing"),
    ("eval-other-model", ["eval", "-w", "{ws}"], other_model_checkpoint, "does not hold this model"),
    ("run-samples-negative", ["run", "{ws}", "--set", "metrics.samples_groups=-1"], None,
     "metrics.samples_groups = -1; it must be ≥ 0"),
    ("run-samples-chars", ["run", "{ws}", "--set", "metrics.samples_max_chars=10"], None, "it must be ≥ 100"),
    ("run-record-tokens-float", ["run", "{ws}", "--set", "metrics.record_tokens=1.5"], None,
     "metrics.record_tokens: expected int, got '1.5'"),
    ("samples-none-kept", ["samples", "{ws}"], None, "no samples in"),
    ("samples-negative-step", ["samples", "{ws}", "--step", "-1"], None, "--step"),
    ("samples-no-eval", ["samples", "{ws}", "--eval", "aime25"], None, "no responses of an evaluation 'aime25'"),
    ("check-no-record", ["check", "{ws}"], None, "no token record in"),
    ("eval-k-zero", ["eval", "-w", "{ws}", "--k", "0"], None, "eval.k = 0; it must be ≥ 1"),
    ("eval-negative-T", ["eval", "-w", "{ws}", "--temperature", "-1"], None, "eval.temperature = -1.0"),
    ("eval-garbage-data", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart", "--data", "{ws}/garbage.jsonl"],
     write("garbage.jsonl", b"\x00\xff" * 1000), "cannot load dataset"),
    ("eval-data-mixed-folder", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart", "--data", "{ws}/mixed"],
     mixed_folder, "holds files with different fields (a.jsonl: answer, problem; b.jsonl: answer, question)"),
    ("push-adapter-of-a-model", ["push", "{ws}/out", "--repo", "someone/model", "--adapter"], an_export_folder,
     "is a whole model folder (config.json, no adapter_config.json); push it without --adapter"),
    ("push-adapter-local-base", ["push", "{ws}/adapter", "--repo", "someone/adapter", "--dry-run"], an_adapter_folder,
     "which nobody on the Hub can load: push that base model first and name its repo with --base-repo OWNER/NAME"),
    ("push-adapter-bad-base-repo", ["push", "{ws}/adapter", "--repo", "someone/adapter", "--base-repo", "nope"],
     an_adapter_folder, "--base-repo 'nope' must be OWNER/NAME"),
    ("push-hub-unreachable", ["push", "{ws}/out", "--repo", "someone/model"], an_export_folder,
     "the Hugging Face Hub (https://huggingface.co) cannot be reached; push from a machine with network"),
    ("eval-hub-unreachable", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart"], hub_down,
     "the Hugging Face Hub (https://huggingface.co) cannot be reached; pass a local copy with --data PATH"),
    ("eval-offline-not-cached", ["eval", "aime25", "-w", "{ws}", "--checkpoint", "coldstart"], env(HF_HUB_OFFLINE="1"),
     "is not in the local cache and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"),
    ("eval-neither", ["eval", "-w", "{ws}", "--checkpoint", "{ws}/data"], None, "neither an HF model folder"),
    ("eval-truncated-coldstart", ["eval", "-w", "{ws}", "--checkpoint", "coldstart"],
     truncate("model/coldstart/model.safetensors", 0.9), "model.safetensors are"),
]


def test_the_table_is_large_enough():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("args, mutate, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(ws_template, tmp_path, capfd, monkeypatch, args, mutate, needle):
    from cli.main import main

    ws = tmp_path / "ws"
    shutil.copytree(ws_template, ws)
    _SITUATION.clear()
    if mutate is not None:
        mutate(ws)
    for k, v in _SITUATION.get("env", {}).items():
        monkeypatch.setenv(k, v)
    if _SITUATION.get("env", {}).get("HF_HUB_OFFLINE") == "1":
        # huggingface_hub and datasets read it once, at import (a fresh `minirl` process sees it
        # there); in this process they were imported before it was set, and would spend ~20 s
        # reaching for the Hub before the cache check this row is about
        import datasets.config
        import huggingface_hub.constants

        for module in (huggingface_hub.constants, datasets.config):
            monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    if "platform" in _SITUATION:
        from minirl.setup import limits

        here = limits.Platform.here
        monkeypatch.setattr(limits.Platform, "here", classmethod(
            lambda cls, world_size=1: dataclasses.replace(here(world_size), **_SITUATION["platform"])))
    if _SITUATION.get("hub_down"):
        from minirl.models import hub

        monkeypatch.setattr(hub, "reachable", lambda: False)
    before = snapshot(tmp_path)
    argv = [a.format(ws=ws, new=tmp_path / "new", afile=tmp_path / "afile") for a in args]
    monkeypatch.setattr(sys, "argv", ["minirl", *argv])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capfd.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exit_.value.code == 2, (exit_.value.code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("minirl: error: "), err[-2000:]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in out + err
    # before a refusal, notes at most: no blank line or frame a progress bar left (init's, export's, eval's did)
    assert not out.startswith("\n") and "━" not in out, out
    assert snapshot(tmp_path) == before  # nothing written, nothing created, nothing deleted
    while _HOLDERS:
        holder = _HOLDERS.pop()
        holder.stdin.close()  # its signal to end
        holder.wait(timeout=60)


def _one_line(monkeypatch, capfd, argv: list[str]) -> tuple[int, str]:
    from cli.main import main

    monkeypatch.setattr(sys, "argv", ["minirl", *argv])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main()
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    return exit_.value.code, err[-1] if err else ""


DRY_AND_RUN = [  # --set values `run` refuses before any engine starts, for the recipe, the model or the mesh
    ("lora-rank-above-width", ["train.lora.rank=4096"]),
    ("lora-target-absent", ["train.lora.rank=4", "train.lora.targets=mlp"]),
    ("ep-above-the-job", ["parallel.ep=2"]),
    ("tp-above-the-job", ["rollout.tensor_parallel=2"]),
    ("tp-and-heads", ["rollout.tensor_parallel=3", "parallel.gpus_per_node=3"]),
    ("prompts-over-ranks", ["parallel.gpus_per_node=3"]),
    ("group-above-vllms-n", ["train.group_size=20000"]),
]


@pytest.mark.parametrize("sets", [c[1] for c in DRY_AND_RUN], ids=[c[0] for c in DRY_AND_RUN])
def test_the_dry_run_refuses_what_the_run_refuses_with_its_line(ws_template, tmp_path, capfd, monkeypatch, sets):
    """#64: `--dry-run` validates with the model's shape and the mesh it plans, so that a plan never
    prints a launch line for what `run` then refuses: both refuse, exit 2, with the same line. The
    run is one process here (world 1); the dry run plans that machine (one node of
    parallel.gpus_per_node GPUs), whose user-set values it never lowers."""
    ws = tmp_path / "ws"
    shutil.copytree(ws_template, ws)
    flags = [x for kv in sets for x in ("--set", kv)]
    gpus = next((kv.split("=")[1] for kv in sets if kv.startswith("parallel.gpus_per_node")), "1")
    before = snapshot(tmp_path)
    dry = _one_line(monkeypatch, capfd, ["run", str(ws), "--dry-run", "--gpus-per-node", gpus, *flags])
    if "parallel.gpus_per_node=3" in sets:  # a run of 3 ranks: its torchrun job, here its own checks at that size
        from minirl.config import recipes
        from minirl.errors import UsageError
        from minirl.models.shapes import read_shape
        from minirl.setup.preflight import check_layout

        rec = recipes.load(ws / "minirl.toml", sets)
        with pytest.raises(UsageError) as e:
            from minirl.setup.limits import check

            shape = read_shape(ws / "model/coldstart")
            check(rec, None, shape)
            check_layout(rec, shape, 3)
        run = (2, f"minirl: error: {' '.join(str(e.value).split())}")
    else:
        run = _one_line(monkeypatch, capfd, ["run", str(ws), *flags])
    assert dry[0] == run[0] == 2 and dry[1].startswith("minirl: error: "), (dry, run)
    assert dry[1] == run[1]
    assert snapshot(tmp_path) == before  # neither wrote anything


@pytest.mark.parametrize("where", ["/proc/minirl-ws", "/proc/self/minirl/ws"])
def test_a_workspace_or_export_that_cannot_be_written_is_exit_4s_one_line(monkeypatch, capfd, where):
    """#82: `init` into a folder that cannot be made (a read-only mount; /proc here, as root ignores
    permissions) was a FileNotFoundError traceback; now exit 4 and one line naming it, nothing written
    (export's: tests/test_export.py)."""
    code, line = _one_line(monkeypatch, capfd, ["init", where])
    assert code == 4 and line.startswith(f"minirl: error: cannot create the workspace {where}: No such file"), line
    assert "nothing was written" in line
