"""The `code` grader: HumanEval's canonical solutions pass and its bare prompts fail, and hostile
programs score 0 with their reason while the machine and the grader come out unharmed."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

import pytest

from rewards import sandbox
from rewards.code import CodeGrader, extract_program

HUMANEVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "code" / "humaneval.jsonl"
MARK = f"minirl-pwned-{secrets.token_hex(4)}"  # files a hostile program tries to leave behind
TOKEN = f"hf_{secrets.token_hex(8)}"


def humaneval() -> list[dict]:
    return [json.loads(line) for line in HUMANEVAL.read_text().splitlines()]


def test_every_canonical_humaneval_solution_passes_and_every_bare_prompt_fails():
    rows = humaneval()
    assert len(rows) == 164
    grader = CodeGrader()
    solved = grader.grade_batch([(r, r["canonical_solution"]) for r in rows])
    bare = grader.grade_batch([(r, "") for r in rows])
    assert [r["task_id"] for r, s in zip(rows, solved) if s.score != 1.0] == []
    assert [r["task_id"] for r, s in zip(rows, bare) if s.score != 0.0] == []
    assert {s.info["verdict"] for s in bare} == {"failed"}


def test_a_fenced_answer_is_the_program_and_the_prompts_helpers_stay_available():
    row = next(r for r in humaneval() if r["task_id"] == "HumanEval/10")  # make_palindrome uses is_palindrome
    body = row["canonical_solution"]
    fenced = f"Here it is:\n```python\ndef {row['entry_point']}(string: str) -> str:\n{body}```\nDone."
    assert CodeGrader()(row, fenced).score == 1.0
    assert extract_program("x\n```python\na = 1\n```\n```py\ndef f():\n    pass\n```", "", "f").strip().endswith("pass")


def _stdio(program: str) -> tuple[dict, str]:
    return {"input_output": {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}}, f"```python\n{program}\n```"


def test_stdin_stdout_problems():
    rec, ok = _stdio("a, b = map(int, input().split())\nprint(a + b)")
    _, wrong = _stdio("a, b = map(int, input().split())\nprint(a * b)")
    grader = CodeGrader()
    assert grader(rec, ok).score == 1.0
    bad = grader(rec, wrong)
    assert bad.score == 0.0 and bad.info["verdict"] == "failed" and bad.info["passed"] == 0


def _fn(body: str, test: str = "def check(c):\n    assert c() == 1\n") -> tuple[dict, str]:
    """A problem asking for f() == 1, and a response whose program is `body` (defining f)."""
    return {"prompt": "", "test": test, "entry_point": "f"}, f"```python\n{body}\n```"


LISTENER = {}  # port of a TCP listener on 127.0.0.1 in this process, set by the fixture
_HE0 = next(r for r in humaneval() if r["task_id"] == "HumanEval/0")  # has_close_elements

HOSTILE = [
    ("infinite loop", _fn("def f():\n    while True:\n        pass"), {"timeout", "killed"}),
    ("fork bomb", _fn("import os\nwhile True:\n    os.fork()\ndef f():\n    return 1"), {"error", "killed"}),
    ("memory bomb", _fn("blocks = []\nwhile True:\n    blocks.append(bytearray(2**26))\ndef f():\n    return 1"),
     {"error", "killed"}),
    ("1 GB of output", _stdio("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)"), {"error"}),
    ("a file under /tmp", _fn(f"def f():\n    open('/tmp/{MARK}', 'w').write('x')\n    return 1"), {"error"}),
    ("a file in the home folder", _fn(f"import os\ndef f():\n    open(os.path.expanduser('~/{MARK}'), 'w').write('x')\n"
                                       "    return 1"), {"error"}),
    ("reading HF_TOKEN", _fn("import os, glob\ndef f():\n    for p in glob.glob('/proc/*/environ'):\n"
                             "        try:\n            if b'HF_TOKEN' in open(p, 'rb').read():\n"
                             "                return 'found in ' + p\n        except OSError:\n            pass\n"
                             "    return os.environ.get('HF_TOKEN')",
                             "def check(c):\n    assert c() is None\n    assert 0, 'nothing leaked'\n"), {"failed"}),
    ("a TCP connection to 127.0.0.1", _fn("import socket, os\ndef f():\n    s = socket.create_connection(('127.0.0.1', "
                                          "int(os.environ.get('PORT', '{port}'))), timeout=2)\n    s.sendall(b'hi')\n"
                                          "    return 1"), {"error"}),
    ("killing its parent", _fn("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.killpg(0, signal.SIGKILL)\n"
                               "def f():\n    return 1"), {"killed", "error", "hack"}),
    ("sys.exit(0) before the tests", _fn("import sys\nsys.exit(0)\ndef f():\n    return 1"), {"hack"}),
    ("os._exit(0) before the tests", _fn("import os\nos._exit(0)\ndef f():\n    return 1"), {"hack"}),
    ("an always-equal object", _fn("class Yes:\n    def __eq__(self, other):\n        return True\n"
                                   "    __ne__ = lambda self, other: False\ndef f():\n    return Yes()"), {"hack"}),
    ("redefined builtins and assertion helpers", _fn(
        "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "def check(candidate):\n    return True\ndef f():\n    return 2",
        "def check(c):\n    assert abs(c() - 1) < 1e-9\n"), {"failed"}),
    # what the machine holds: the benchmark's reference solutions on disk, the folders a policy
    # would look in, the host's /proc. @humaneval@, @home@, @cache@, @workspace@, @project@, @tmp@:
    # real host paths (quoted), filled in by the test; each must be absent or unreadable inside
    ("the benchmark's reference solution read from the host's disk", (_HE0, (
        "```python\nimport json\ndef has_close_elements(numbers, threshold):\n"
        "    for line in open(@humaneval@):\n        row = json.loads(line)\n"
        "        if row['task_id'] == 'HumanEval/0':\n            ns = {}\n"
        "            exec(row['prompt'] + row['canonical_solution'], ns)\n"
        "            return ns['has_close_elements'](numbers, threshold)\n```")), {"error"}),
    ("a walk of the machine's folders for a benchmark file", (_HE0, (
        "```python\nimport json, os\ndef has_close_elements(numbers, threshold):\n"
        "    for top in [os.path.dirname(@humaneval@), @workspace@, @cache@, @project@, @home@, '/tmp', '/work', "
        "'/data', '/home', '/root', '/']:\n"
        "        for folder, dirs, files in os.walk(top):\n"
        "            dirs[:] = [d for d in dirs if d not in ('proc', 'sys', '.git', '.venv', '.pyenv', 'site-packages')]\n"
        "            for name in files:\n"
        "                if name.endswith('.jsonl'):\n"
        "                    for line in open(os.path.join(folder, name), errors='replace'):\n"
        "                        if 'HumanEval/0\"' in line:\n                            row = json.loads(line)\n"
        "                            ns = {}\n                            exec(row['prompt'] + row['canonical_solution'], ns)\n"
        "                            return ns['has_close_elements'](numbers, threshold)\n"
        "    return None\n```")), {"failed"}),
    ("listing /, /root, /home, the caches, the workspace, the project and /tmp", _fn(
        "import os\ndef f():\n    seen = []\n"
        "    for p in ['/', '/root', '/home', @home@, @cache@, os.path.join(@home@, '.cache', 'huggingface'), "
        "@workspace@, @project@, @tmp@, '/tmp']:\n"
        "        try:\n            seen += os.listdir(p)\n        except OSError:\n            pass\n    return seen",
        "def check(c):\n    assert c() != [], 'nothing listed'\n"), {"failed"}),
    ("reading the host's /proc/1/environ and /proc/self/mountinfo", _fn(
        "def f():\n    got = b''\n    for p in ('/proc/1/environ', '/proc/self/mountinfo'):\n        try:\n"
        "            got += open(p, 'rb').read()\n        except OSError:\n            pass\n    return len(got)",
        "def check(c):\n    assert c() > 0, 'nothing read'\n"), {"failed"}),
    ("a fake 'all tests passed'", _fn("import os\nprint('all tests passed')\nfor fd in range(3, 64):\n    try:\n"
                                      "        os.write(fd, b'pass 0 \"\"\\ndone 1 \"\"\\n')\n    except OSError:\n"
                                      "        pass\ndef f():\n    return 2"), {"failed", "hack"}),
]


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.setblocking(False)
    yield srv
    srv.close()


def _ours() -> set[int]:
    """Processes running the harness that this test process started (none may outlive a grading).
    As root each sandbox is a `pids` cgroup named after the grading process, which no process of
    it can leave: the other xdist worker's sandboxes, graded at the same time, are not ours."""
    mine = f"/run-{os.getpid()}-"
    found = set()
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if b"rewards/harness.py" not in (p / "cmdline").read_bytes():
                continue
            if sandbox._probe()["cgroup"] is None or mine in (p / "cgroup").read_text():
                found.add(int(p.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("name, item, verdicts", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_program_scores_zero_and_harms_nothing(name, item, verdicts, listener, monkeypatch, tmp_path):
    record, response = item
    # what a training machine holds, for the rows that look for it: a workspace and a datasets cache
    # with the benchmark's reference solutions, beside the project and the shared data
    for where in (tmp_path / "ws" / "data", tmp_path / "cache" / "huggingface" / "datasets"):
        where.mkdir(parents=True)
        (where / "humaneval.jsonl").write_text(json.dumps(_HE0) + "\n")
    response = response.replace("{port}", str(listener.getsockname()[1]))
    for name, path in {"humaneval": HUMANEVAL, "home": Path.home(), "cache": tmp_path / "cache",
                       "workspace": tmp_path / "ws", "project": Path(__file__).resolve().parents[1], "tmp": tmp_path}.items():
        response = response.replace(f"@{name}@", repr(str(path)))
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # in the grader's environment, as on a user's machine
    before = _ours()
    # 4 s where the wall clock is what must end the program; elsewhere its limits end it long before
    # 20 s, which leaves a loaded machine room (the memory bomb writes ~1 GiB: 1 s idle, past 4 s
    # beside the rest of the suite)
    score = CodeGrader(timeout_s=4.0 if "timeout" in verdicts else 20.0)(record, response)
    assert score.score == 0.0, score.info
    assert score.info["verdict"] in verdicts, score.info
    assert TOKEN not in json.dumps(score.info)
    # unharmed: no process left, nothing written outside the sandbox, nobody connected, the grader works
    deadline = time.monotonic() + 10
    while _ours() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ours() - before == set()
    assert not Path(f"/tmp/{MARK}").exists() and not Path(os.path.expanduser(f"~/{MARK}")).exists()
    with pytest.raises(BlockingIOError):
        listener.accept()
    ok, good = _fn("def f():\n    return 1")
    assert CodeGrader()(ok, good).score == 1.0


def test_the_machine_here_gives_every_protection():
    """What docs/graders.md says was verified on this machine; a machine without user namespaces
    warns once and still grades (the hostile table above then shows what it loses)."""
    assert sandbox.protections() == {"limits": True, "namespaces": True, "process_limit": True}


@pytest.mark.slow
def test_rl_on_code_and_eval_humaneval_run_end_to_end_on_the_tiny_model(tiny_dir, tmp_path):
    """The pipeline, not the skill: `minirl run` with the code grader on a small local code dataset
    (the tiny model's answers fail their tests, so rewards are 0), then `minirl eval humaneval`
    from a local copy reports avg@k and the unbiased pass@1 beside pass@k."""
    import subprocess
    import sys

    from tests.conftest import data_workspace

    ws = data_workspace(tmp_path / "ws", train=0, heldout=0)
    for split, n in (("train", 24), ("heldout", 8)):
        rows = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1),
                 "input_output": {"inputs": [f"{a} {a + 1}\n"], "outputs": [f"{2 * a + 1}\n"]}} for a in range(n)]
        (ws / f"data/{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    root = Path(__file__).resolve().parents[1]

    def minirl(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=root, capture_output=True, text=True,
                              timeout=900, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"})

    r = minirl("run", str(ws), "--model", str(tiny_dir), "--steps", "2", "--set", "reward.grader=code",
               "--set", "train.prompts_per_step=8", "--set", "eval.k=1")
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = sorted((ws / "runs").iterdir())[-1]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["rollout/reward_mean"] == 0.0 and m["rollout/grader_errors"] == 0 for m in rows)

    r = minirl("eval", "humaneval", "-w", str(ws), "--checkpoint", str(run_dir / "checkpoints/step_000002/hf"),
               "--data", str(HUMANEVAL), "--k", "2", "--max-problems", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(next((ws / "evals").glob("humaneval-k2-*.json")).read_text())
    assert (result["problems"], result["of"], result["grader"]) == (6, 164, "code")
    assert {"avg@2", "pass@1", "pass@2"} <= result.keys() and result["pass@2"] == 0.0
    assert "pass@1" in r.stdout and "pass@2" in r.stdout
