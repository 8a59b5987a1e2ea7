"""Prompt sources through `datasets` on local files; skip counts; sampler determinism."""

import json

import pytest

from minirl.data.prompts import PromptSampler, load_problems
from minirl.data.task import make_splits
from minirl.errors import UsageError


def enc(texts):  # a tokenizer whose tokens are characters, called with a batch of prompts
    return [[ord(c) for c in s] for s in texts]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_are_skipped_and_counted(tmp_path):
    p = write(tmp_path / "d.jsonl", [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "", "answer": "3"},
        {"prompt": "2+2=", "answer": None},
        {"prompt": "1234567890+1=", "answer": "1234567891"},
        {"prompt": "3+3=", "answer": "6"},
    ])
    probs, skipped = load_problems(str(p), encode=enc, prompt_field="prompt", answer_field="answer", max_prompt_tokens=8)
    assert [pr.record["answer"] for pr in probs] == ["2", "6"]
    assert skipped == {"empty_prompt": 1, "missing_answer": 1, "too_long": 1}
    assert probs[0].prompt_ids == tuple(map(ord, "1+1="))


def test_prompts_are_tokenised_in_batches_in_row_order(tmp_path, monkeypatch):
    """The tokenizer is called once per batch of ENCODE_BATCH prompts (skipped rows never reach it),
    and each problem keeps its own row's ids across the batches' seams."""
    from minirl.data import prompts as data

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(7)]
    rows[3]["answer"] = ""
    p = write(tmp_path / "d.jsonl", rows)
    calls = []
    monkeypatch.setattr(data, "ENCODE_BATCH", 2)
    probs, skipped = load_problems(str(p), encode=lambda t: calls.append(list(t)) or enc(t), prompt_field="prompt",
                                   answer_field="answer", max_prompt_tokens=8)
    assert calls == [["0+0=", "1+1="], ["2+2=", "4+4="], ["5+5=", "6+6="]]
    assert [(pr.record["answer"], pr.prompt_ids) for pr in probs] == [
        (r["answer"], tuple(map(ord, r["prompt"]))) for r in rows if r["answer"]]
    assert skipped == {"empty_prompt": 0, "missing_answer": 1, "too_long": 0}


def test_zero_usable_rows_is_an_error(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"prompt": "", "answer": "1"}])
    with pytest.raises(UsageError, match="no usable rows"):
        load_problems(str(p), encode=enc, prompt_field="prompt", answer_field="answer", max_prompt_tokens=8)


def test_missing_field_names_the_fields(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(UsageError, match="no field 'prompt'; fields: question, answer"):
        load_problems(str(p), encode=enc, prompt_field="prompt", answer_field="answer", max_prompt_tokens=8)


def test_a_missing_file_is_one_line_without_asking_the_hub(tmp_path):
    with pytest.raises(UsageError) as e:
        load_problems(str(tmp_path / "nope.jsonl"), encode=enc, prompt_field="p", answer_field="a", max_prompt_tokens=8)
    assert str(e.value) == f"dataset file {tmp_path / 'nope.jsonl'} not found"


def test_a_hub_id_the_loader_fails_on_is_one_line(monkeypatch):
    """The Hub answers the probe (hub.need_hub), then the loader fails: a server that knows no
    dataset stands in for the Hub (the unreachable Hub itself: tests/test_offline.py). The loader's
    own process reads HF_ENDPOINT as it starts."""
    import http.server
    import threading

    from minirl.models import hub

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501 to all
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(hub, "reachable", lambda: True)
    try:
        with pytest.raises(UsageError) as e:
            load_problems("nobody-minirl/no-such-dataset", encode=enc, prompt_field="p", answer_field="a",
                          max_prompt_tokens=8)
    finally:
        server.shutdown()
    assert str(e.value).startswith("cannot load dataset 'nobody-minirl/no-such-dataset': ") and "\n" not in str(e.value)


def test_the_run_process_never_imports_datasets(tmp_path):
    """`datasets` (and pandas, pyarrow) stay in the loader's own process: rows come back as lists."""
    import subprocess
    import sys

    p = write(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    code = ("import sys; from minirl.data.loader import load_rows; r = load_rows(sys.argv[1]); "
            "print(repr((r.column_names, r.rows, 'datasets' in sys.modules, 'pandas' in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True).stdout
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    assert eval(out) == (["prompt", "answer"], rows, False, False)


def test_task_splits_are_disjoint_and_correct():
    train, held = make_splits(2000, 200, seed=3)
    assert len(train) == 2000 and len(held) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in held:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(a) + int(b) == int(r["answer"]) and 100 <= int(a) <= 999


@pytest.mark.parametrize("task, recipe_name, width, mean_len", [
    ("scratchpad", "tiny-scratchpad", (3, 5), (30, 40)), ("scratchpad-long", "tiny-scratchpad-long", (10, 13), (95, 102))])
def test_scratchpad_traces_add_up_and_only_the_final_sum_is_graded(task, recipe_name, width, mean_len):
    import re

    from minirl.config import recipes
    from minirl.data.task import scratchpad
    from rewards import load_grader

    train, held = make_splits(2000, 200, seed=3, task=task)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    rec = recipes.load(recipes.shipped(recipe_name))
    grade = load_grader(rec.reward.grader, rec.reward.params)
    lengths = []
    for r in train + held:
        a, b = map(int, r["prompt"].rstrip("=").split("+"))
        assert r["answer"] == str(a + b) and width[0] <= len(str(a)) == len(str(b)) <= width[1]
        assert len(r["prompt"]) <= rec.data.max_prompt_tokens
        steps, _, total = r["target"].partition(";")
        assert total == r["answer"]
        carry, digits = 0, []  # replay the written columns: each one's digits, carry and sum are right
        for i, step in enumerate(steps.split(",")):
            x, y, *c, s = map(int, re.split(r"[+=]", step))
            assert (x, y) == (a // 10**i % 10, b // 10**i % 10) and c == ([1] if carry else [])
            assert s == x + y + carry
            carry, digits = s // 10, [s % 10, *digits]
        assert int("".join(map(str, [carry] if carry else [])) + "".join(map(str, digits))) == a + b
        assert grade(r, r["target"]).score == 1.0
        lengths.append(len(r["target"]) + 1)  # characters are tokens; + EOS
    assert 20 <= min(lengths) and max(lengths) <= rec.rollout.max_tokens
    assert mean_len[0] < sum(lengths) / len(lengths) < mean_len[1]
    r = train[0]
    wrong_sum = r["target"].rsplit(";", 1)[0] + ";" + str(int(r["answer"]) + 1)
    assert grade(r, wrong_sum).score == 0.0 and grade(r, r["target"] + "1").score == 0.0
    assert grade(r, r["answer"]).score == 0.0  # no ";": no final answer
    assert scratchpad(95, 7) == "5+7=12,9+0+1=10;102"  # operands of different lengths pad with 0


def test_sampler_is_deterministic_and_restorable(tmp_path):
    train, _ = make_splits(50, 1)
    p = write(tmp_path / "t.jsonl", train)
    probs, _ = load_problems(str(p), encode=enc, prompt_field="prompt", answer_field="answer", max_prompt_tokens=16)
    a = PromptSampler(probs, seed=1)
    first = [x.record["prompt"] for x in a.next_batch(30)]
    state = a.state()
    nxt = [x.record["prompt"] for x in a.next_batch(40)]  # crosses an epoch boundary
    b = PromptSampler(probs, seed=1)
    assert [x.record["prompt"] for x in b.next_batch(30)] == first
    c = PromptSampler(probs, seed=1)
    c.restore(state)
    assert [x.record["prompt"] for x in c.next_batch(40)] == nxt
    assert len(set(first)) == 30  # no repeats within an epoch


def test_prompts_go_through_the_template_and_the_chat_template(tokenizer):
    """data.prompt_template puts the row's text at {problem}; data.chat_template sends it as one
    user turn through the tokenizer's own chat template (a Jinja template, as Qwen3's)."""
    import copy

    from minirl.data.prompts import prompt_ids

    plain = prompt_ids(tokenizer, "12+34", template="{problem}=")
    assert tokenizer.decode(plain) == "12+34="
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}+0{% endfor %}{% if add_generation_prompt %}={% endif %}"
    ids = prompt_ids(tok, "12+34", template="{problem}", chat=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "12+34+0="
    # many at once (the run's data loading) give each text's own ids, plain and through the chat template
    from minirl.data.prompts import prompts_ids

    texts = ["12+34", "5+6", "987+1"]
    assert prompts_ids(tokenizer, texts, template="{problem}=") == [
        tokenizer(t + "=", add_special_tokens=False)["input_ids"] for t in texts]
    assert [tok.decode(i) for i in prompts_ids(tok, texts, chat=True)] == ["12+34+0=", "5+6+0=", "987+1+0="]


def test_the_chat_templates_keyword_arguments_reach_it_on_every_prompt_path(tiny_dir):
    """#81: Qwen3's template opens a reasoning block unless `enable_thinking = false`; nothing passed it
    before. `data.chat_template_kwargs` reaches the template for the run's prompts (preflight's
    encoder) and `minirl eval`'s; the validator refuses them where no template reads them."""
    from transformers import AutoTokenizer

    from minirl.config import recipes
    from minirl.data.prompts import prompts_ids
    from minirl.eval.bench import _format_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}="
                         "{% if enable_thinking is defined and enable_thinking is false %}{% else %}0{% endif %}{% endif %}")  # "0": the block it opens
    thinking = prompts_ids(tok, ["1+2"], chat=True)[0]
    plain = prompts_ids(tok, ["1+2"], chat=True, chat_kwargs={"enable_thinking": False})[0]
    assert tok.decode(thinking).endswith("=0") and tok.decode(plain).endswith("=") and plain == thinking[:-1]
    assert _format_prompt(tok, "{problem}", "1+2", {"enable_thinking": False}) == plain
    rec = recipes.load(recipes.shipped("qwen3"))
    assert rec.data.chat_template and rec.data.chat_template_kwargs == {"enable_thinking": True}
    with pytest.raises(UsageError, match="data.chat_template = true or drop them"):
        recipes.load(None, ['data.chat_template_kwargs={"enable_thinking": false}'])


def test_a_check_that_fails_before_the_data_is_read_leaves_no_loader_behind(tmp_path):
    """prepare_run starts the data's loader processes first and reads their rows after the model's
    checks: a model folder that is not there is refused as before, and both loaders are stopped."""
    import psutil

    from minirl.config import recipes
    from minirl.setup.run_inputs import prepare_run
    from minirl.setup.workspace import Workspace
    from tests.conftest import data_workspace

    ws = Workspace.open(data_workspace(tmp_path / "ws"))
    rec = recipes.load(ws.recipe_path, [f"model.path={tmp_path / 'no-model'}"])
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UsageError, match="no-model"):
        prepare_run(ws, rec, resume=None)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []  # killed and waited for: not even a zombie
