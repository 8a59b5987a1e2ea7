"""The CLI's contract: every option documented; bad input is one line on stderr and exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from cli.main import cli

MINIRL = [sys.executable, "-m", "cli.main"]
ROOT = Path(__file__).resolve().parents[1]


def minirl(*args, cwd=None):
    # HF_HUB_OFFLINE: whether this machine reaches the Hub must not change what a test sees
    return subprocess.run([*MINIRL, *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_every_command_and_option_has_help():
    ctx = click.Context(cli)
    for name, cmd in [("minirl", cli), *cli.commands.items()]:
        assert cmd.help, name
        text = cmd.get_help(ctx)
        for p in cmd.params:
            if isinstance(p, click.Option):
                assert p.help, f"{name} {p.opts} has no help"
                assert p.opts[-1] in text, f"{name} --help does not show {p.opts}"


@pytest.mark.parametrize("sub", ["", "init", "run", "eval"])
def test_help_exits_zero(sub):
    r = minirl(*([sub] if sub else []), "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout


@pytest.fixture
def bare_ws(tmp_path):
    (tmp_path / "minirl.toml").write_text((ROOT / "recipes" / "tiny.toml").read_text())
    return tmp_path


def one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("minirl: error:"), r.stderr[-2000:]
    assert needle in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_missing_workspace(tmp_path):
    one_line_error(minirl("run", str(tmp_path / "nope")), "is not a minirl workspace")


def test_unknown_option():
    one_line_error(minirl("run", "--bogus"), "No such option")


def test_malformed_recipe(bare_ws):
    (bare_ws / "minirl.toml").write_text("[train\nsteps = 1\n")
    one_line_error(minirl("run", str(bare_ws)), "malformed recipe")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "{ws}", "--set", "train.bogus=1"], "unknown recipe key train.bogus"),
        (["run", "{ws}", "--steps", "many"], "'many' is not a valid integer"),
        (["run", "{ws}", "--replay", "r5"], "Invalid value for '--replay'"),
        (["run", "{ws}", "--set", "train.replay=r4"], "train.replay = 'r4'; choose one of off, r2, r3"),
        (["run", "{ws}", "--set", "model.path=nowhere"], "model folder"),
        (["run", "{ws}", "--model", "Qwen3-30B-A3B"], "model 'Qwen/Qwen3-30B-A3B-Base' is not in the local Hugging Face "
                                                  "cache and HF_HUB_OFFLINE is set"),
        (["run", "{ws}", "--model", "gpt-5"], "model.id = 'gpt-5' is neither a short name (tiny-qwen3-moe, Qwen3-0.6B"),
        (["run", "{ws}", "--model", "/nonexistent/folder"], "model folder /nonexistent/folder not found"),
        (["eval", "aime99", "-w", "{ws}", "--checkpoint", "coldstart"], "unknown benchmark 'aime99'"),
    ],
)
def test_bad_input_in_a_workspace(bare_ws, args, needle):
    one_line_error(minirl(*[a.format(ws=bare_ws) for a in args]), needle)


def test_init_logs_its_stages_in_lines_when_its_output_is_not_a_terminal(tmp_path):
    """Piped to a log, rich draws no live bars: init says each stage and the cold start's step
    in lines, so a long build does not look hung."""
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, ["init", str(tmp_path / "ws"), "--set", "cold_start.max_steps=2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for stage in ("task splits: done", "tiny Qwen3-MoE + tokenizer: done", "cold-start SFT: step 1/2",
                  "cold-start SFT: done  loss", "save HF + DCP: done"):
        assert any(line.startswith(stage) for line in lines), (stage, result.output)
    # two SFT steps are below the dev check's interval: the summary says so (it raised a TypeError)
    assert "dev accuracy not checked" in result.output


def test_init_task_builds_the_long_response_workspace_in_the_recipes_shape(tmp_path):
    """--task picks the task's recipe; the data carries the written-out targets, the model's
    context fits prompts plus responses, it has the recipe's layers and experts, and the report
    gives the response lengths. (`--task scratchpad` is built by the lab's tests.)"""
    from minirl.config import recipes
    from minirl.setup.workspace import Workspace, init_workspace

    small = ["cold_start.max_steps=1", "cold_start.train_size=100", "cold_start.heldout_size=10",
             "cold_start.dev_size=2", "cold_start.check_every=1"]
    report = init_workspace(tmp_path / "ws", task="scratchpad-long", overrides=small)
    ws = Workspace.open(tmp_path / "ws")
    rec = recipes.load(ws.recipe_path)
    assert report["recipe"] == "tiny-scratchpad-long" and report["task"] == rec.cold_start.task == "scratchpad-long"
    assert rec.reward.grader == "regex" and rec.rollout.max_tokens == 136
    row = json.loads(ws.path(rec.data.train).read_text().splitlines()[0])
    assert row["target"].endswith(";" + row["answer"])
    config = json.loads((ws.path(rec.model.path) / "config.json").read_text())
    assert config["max_position_embeddings"] == 192  # 28 prompt + 136 response + 1, rounded up to 32
    tok_config = json.loads((ws.path(rec.model.path) / "tokenizer_config.json").read_text())
    assert tok_config["model_max_length"] == 192  # not the default task's 64: transformers truncates there
    shape = (config["num_hidden_layers"], config.get("num_experts", config.get("num_local_experts")),
             config["num_experts_per_tok"])
    assert shape == (6, 16, 4) and report["shape"] == {"layers": 6, "experts": 16, "top_k": 4, "max_seq_len": 192}
    lens = report["response_tokens"]
    assert 70 <= lens["min"] <= lens["median"] <= lens["max"] <= 136 and report["cold_start_steps"] <= 1


def test_in_a_workspaces_folder_a_command_without_one_works_on_it(bare_ws):
    """`cd demo && minirl status`: the current folder, where it is a workspace, is the default; ./minirl-ws
    still where it is one, and a folder that is neither says so of ./minirl-ws."""
    one_line_error(minirl("status", cwd=bare_ws), "no runs in .")
    one_line_error(minirl("export", "out", cwd=bare_ws), "has trained a step yet")
    # a command that makes one makes ./minirl-ws (here a file, so that it stops there): `init --force` in a
    # workspace's folder never rebuilds that workspace
    (bare_ws / "minirl-ws").write_text("")
    one_line_error(minirl("init", "--force", cwd=bare_ws), "minirl-ws exists and is not a folder")
    (bare_ws / "minirl-ws").unlink()
    (bare_ws / "minirl-ws").mkdir()
    (bare_ws / "minirl-ws" / "minirl.toml").write_text((ROOT / "recipes" / "tiny.toml").read_text())
    one_line_error(minirl("status", cwd=bare_ws), "no runs in minirl-ws")
    elsewhere = bare_ws / "minirl-ws" / "data"
    elsewhere.mkdir()
    one_line_error(minirl("status", cwd=elsewhere), "minirl-ws is not a minirl workspace")
