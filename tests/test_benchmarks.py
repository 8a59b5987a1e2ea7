"""Benchmark registry on the real files, avg/pass/maj@k by hand, and `minirl eval` with resume."""

import errno
import json
from pathlib import Path

import pytest

from minirl.config.recipe import Recipe
from minirl.errors import UsageError
from minirl.eval import benchmarks
from minirl.eval.bench import eval_benchmark
from minirl.eval.evaluate import summarize
from tests.conftest import SHARED

BENCH = SHARED / "data" / "benchmarks"


@pytest.mark.parametrize("name, n", [("aime24", 30), ("aime25", 30), ("hmmt25", 30), ("amc23", 40),
                                     ("math500", 500), ("gsm8k", 1319)])
def test_every_benchmark_loads_from_a_local_copy(name, n):
    recs = benchmarks.load_records(benchmarks.get(name), data_dir=BENCH)
    assert len(recs) == n
    assert all(r["problem"].strip() and r["answer"].strip() for r in recs)


def test_gsm8k_answer_is_the_number_after_the_marker():
    recs = benchmarks.load_records(benchmarks.get("gsm8k"), data=BENCH / "gsm8k.jsonl")
    assert recs[0]["answer"] == "18" and all("####" not in r["answer"] for r in recs)


def test_unknown_benchmark_and_missing_file():
    with pytest.raises(UsageError, match="unknown benchmark 'aime99'"):
        benchmarks.get("aime99")
    with pytest.raises(UsageError, match="benchmark data not found"):
        benchmarks.load_records(benchmarks.get("aime25"), data=BENCH / "nope.jsonl")


def test_data_is_filed_under_the_benchmark_it_is_and_scored_whole_unless_cut():
    """`eval aime25 --data gsm8k.jsonl` is not aime25 (1,319 problems, not 30): filed under the
    file's own name. A named benchmark is scored whole (the recipe's eval.max_problems cuts the
    held-out split only); --max-problems cuts, and the count it was cut from is kept."""
    from minirl.eval.bench import bench_records

    rec = Recipe()
    rec.eval.max_problems = 500
    got = bench_records("aime25", rec, data=BENCH / "gsm8k.jsonl")
    assert (got.name, len(got.records), got.total) == ("gsm8k.jsonl", 1319, 1319)
    got = bench_records("gsm8k", rec, data=BENCH / "gsm8k.jsonl")
    assert (got.name, len(got.records), got.total) == ("gsm8k", 1319, 1319)  # whole, though max_problems is 500
    got = bench_records("gsm8k", rec, data=BENCH / "gsm8k.jsonl", max_problems=100)
    assert (got.name, len(got.records), got.total) == ("gsm8k", 100, 1319)
    got = bench_records("aime25", rec, data=BENCH)  # a folder of benchmark files: its aime25.jsonl
    assert (got.name, len(got.records)) == ("aime25", 30)


def test_summarize_by_hand():
    s = summarize([[True, False, True], [False, False, False], [False, True, False]],
                  [["4", "5", "4"], ["1", "1", None], ["7", "8", "7"]])
    assert s["avg@3"] == pytest.approx((2 / 3 + 0 + 1 / 3) / 3)
    assert s["pass@3"] == pytest.approx(2 / 3)
    assert s["maj@3"] == pytest.approx(1 / 3)  # majority "4" right; "1" wrong; "7" wrong


def test_eval_aime25_on_the_tiny_model_with_resume(tiny_dir, tmp_path, monkeypatch):
    rec = Recipe()
    rec.eval.k, rec.eval.grader_workers, rec.rollout.kv_cache_gib = 2, 0, 0.25
    out = tmp_path / "evals"
    seen = []

    def stop_after_first_chunk(done, total):
        seen.append(done)
        if done >= 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eval_benchmark(bench_name="aime25", model_dir=tiny_dir, out_dir=out, rec=rec, data=BENCH / "aime25.jsonl",
                       chunk=8, on_progress=stop_after_first_chunk)
    partial = list(out.glob("*.partial.jsonl"))
    assert len(partial) == 1 and len(partial[0].read_text().splitlines()) == 8
    # every response kept (#98), a line a problem done; as if a kill had come after the next problem's
    # samples and before its row, and mid-way through another line: both go, nothing is lost or twice
    [samples] = list(out.glob("*.samples.jsonl"))
    first = samples.read_text().splitlines()
    assert [json.loads(x)["index"] for x in first] == list(range(8))
    with samples.open("a") as f:
        f.write(json.dumps({"index": 8, "problem": "planted", "answer": "", "responses": []}) + '\n{"index": 9, "pro')

    # the same checkpoint under another rollout precision: its own file, nothing resumed from the other
    other = Recipe()
    other.eval.k, other.eval.grader_workers, other.rollout.kv_cache_gib, other.rollout.precision = 2, 0, 0.25, "fp32"
    res = eval_benchmark(bench_name="aime25", model_dir=tiny_dir, out_dir=out, rec=other, data=BENCH / "aime25.jsonl")
    assert res["resumed_problems"] == 0 and res["rollout_precision"] == "fp32"
    assert Path(res["results_file"]).exists() and len(partial[0].read_text().splitlines()) == 8

    # the disk fills as the results are written, half of them on disk: no torn results file is left (export's
    # card and the lab read every one), and the rows stay for the next try, which generates nothing again
    real_open = Path.open

    def disk_fills(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and path.name.endswith((".json", ".json.tmp")):
            write = f.write
            f.write = lambda text: (write(text[: len(text) // 2]), _raise(OSError(errno.ENOSPC, "No space left")))
        return f

    with monkeypatch.context() as m:
        m.setattr(Path, "open", disk_fills)
        with pytest.raises(OSError, match="No space left"):
            eval_benchmark(bench_name="aime25", model_dir=tiny_dir, out_dir=out, rec=rec, data=BENCH / "aime25.jsonl",
                           chunk=8)
    assert len(partial[0].read_text().splitlines()) == 30
    assert [json.loads(f.read_text())["rollout_precision"] for f in out.glob("*.json")] == ["fp32"]  # whole, or none

    res = eval_benchmark(bench_name="aime25", model_dir=tiny_dir, out_dir=out, rec=rec, data=BENCH / "aime25.jsonl",
                         chunk=8)
    assert res["resumed_problems"] == 30 and res["problems"] == 30 and res["k"] == 2
    assert res["truncated_prompts"] == 30  # AIME problems do not fit the tiny model's 64-token context
    assert 0.0 <= res["avg@2"] <= res["pass@2"] <= 1.0
    saved = json.loads(open(res["results_file"]).read())
    assert [r["index"] for r in saved["per_problem"]] == list(range(30))
    assert all(len(r["correct"]) == 2 for r in saved["per_problem"])
    assert not partial[0].exists()
    kept = [json.loads(x) for x in samples.read_text().splitlines()]
    assert res["samples_file"] == str(samples) and [x["index"] for x in kept] == list(range(30))
    assert samples.read_text().splitlines()[:8] == first  # the problems done before were not generated again
    for x, row in zip(kept, saved["per_problem"]):
        assert [r["correct"] for r in x["responses"]] == row["correct"]
        assert all(isinstance(r["text"], str) and r["tokens"] > 0 and "extracted" in r["grader"]
                   for r in x["responses"])
    assert "planted" not in samples.read_text()


def _raise(e: BaseException):
    raise e


def test_prompt_uses_the_chat_template_when_the_tokenizer_has_one(tokenizer):
    from minirl.eval.bench import _format_prompt

    plain = _format_prompt(tokenizer, "{problem}?", "1+2")
    assert tokenizer.decode(plain) == "1+2?"
    tokenizer.chat_template = "{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %}={% endif %}"
    try:
        chat = _format_prompt(tokenizer, "{problem}?", "1+2")
    finally:
        tokenizer.chat_template = None
    assert tokenizer.decode(chat) == "(1+2?)="


def test_eval_chunks_draw_their_own_noise(tiny_dir, tmp_path):
    """`minirl eval` generates chunk by chunk; one seed for every chunk gave the j-th problem of
    each chunk the same noise. 32 copies of one problem in chunks of 16, k = 1: problem j and
    problem j + 16 must not all answer alike (with a shared seed all 16 pairs were equal)."""
    rows = tmp_path / "same.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "12+34=", "answer": "46"}) + "\n" for _ in range(32)))
    rec = Recipe()
    rec.eval.k, rec.eval.grader_workers, rec.rollout.kv_cache_gib = 1, 0, 0.25
    res = eval_benchmark(bench_name="heldout", model_dir=tiny_dir, out_dir=tmp_path / "evals", rec=rec,
                         heldout_path=rows, chunk=16)
    said = [r["extracted"][0] for r in res["per_problem"]]
    assert sum(a == b for a, b in zip(said[:16], said[16:])) < 8
