"""`minirl status`'s reading of a run's files: the state rules, the pace, the held-out line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from minirl.run import status


def make_run(root, *, proc=None, summary=None, rows=3, steps=10):
    run = root / "runs" / "20261123-010203"
    run.mkdir(parents=True)
    (run / "recipe.toml").write_text(f"[train]\nsteps = {steps}\n")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "rollout/reward_mean": 0.1 * s, "timing/elapsed_s": 10.0 + 2 * s}) + "\n"
        for s in range(1, rows + 1)))
    if proc is not None:
        (run / "process.json").write_text(json.dumps(proc))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def exec_child(*cmd: str) -> subprocess.Popen:
    """A child that has exec'd: until then its /proc cmdline is this process's (pytest's), and a
    state read from it would race the exec. It says so on stdout once it runs its own program."""
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)", *cmd],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_a_live_minirl_process_is_running_with_pace_and_eta(tmp_path):
    p = exec_child("cli.main")  # "cli.main" in its cmdline
    try:
        run = make_run(tmp_path, proc={"pid": p.pid, "host": socket.gethostname(), "started": time.time()})
        st = status.read(run)
        assert (st.state, st.step, st.total_steps) == ("running", 3, 10)
        assert st.steps_per_s == 0.5 and st.eta_s == 14.0  # 2 s a step; 7 steps left
    finally:
        p.kill()
        p.wait()
    assert status.read(run).state == "killed"  # the process is gone, and no summary came


def test_a_reused_pid_is_not_the_run_and_summaries_are_read_by_age(tmp_path):
    p = exec_child("sleeper")  # alive, but not minirl: a pid the run's could have been reused for
    try:
        started = time.time()
        run = make_run(tmp_path, proc={"pid": p.pid, "host": socket.gethostname(), "started": started},
                       summary={"status": "interrupted", "written_at": started - 100})  # an earlier attempt's
        assert status.read(run).state == "killed"
        (run / "summary.json").write_text(json.dumps({"status": "collapsed", "written_at": started + 5}))
        assert status.read(run).state == "collapsed"
        (run / "process.json").write_text(json.dumps({"pid": 1, "host": "node-17", "started": started + 10}))
        assert status.read(run).state == "running on node-17?"
    finally:
        p.kill()
        p.wait()


def test_rollbacks_and_skips_are_listed(tmp_path):
    run = make_run(tmp_path, summary={"status": "finished", "heldout": {"metric": "avg@4", "start": {"avg@4": 0.3},
                                                                       "end": {"avg@4": 0.6}}})
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "guard/action": "skip", "guard/reason": "loss not finite"}) + "\n")
        f.write(json.dumps({"step": 5, "guard/action": "rollback", "guard/reason": "KL 0.2 > 0.1",
                            "guard/rollback_to_step": 2}) + "\n")
    st = status.read(run)
    assert st.state == "finished" and st.eta_s is None
    assert st.skipped == [4] and st.rollbacks == [{"step": 5, "reason": "KL 0.2 > 0.1", "back_to": 2}]
    assert st.heldout["end"] == {"avg@4": 0.6}


def test_a_run_that_samples_ahead_shows_its_staleness_in_status_and_the_plot(tmp_path, monkeypatch):
    """#66: with rollout.max_staleness ≥ 1 the rows carry how stale each batch was; `status` shows it
    as columns and the figure as a panel of its own; a synchronous run's view is unchanged."""
    import matplotlib.axes
    from rich.console import Console

    from cli.render import status_view
    from minirl.run import plots

    def shown() -> str:
        c = Console(width=200, record=True)
        c.print(status_view(status.read(run)))
        return c.export_text()

    run = make_run(tmp_path, summary={"status": "finished"})
    assert "stale" not in shown()
    with (run / "metrics.jsonl").open("a") as f:
        for s in (4, 5):
            f.write(json.dumps({"step": s, "rollout/reward_mean": 0.4, "rollout/staleness_mean": 2.0,
                                "rollout/staleness_max": 2, "rollout/batches_ahead": 2,
                                "timing/engine_idle_frac": 0.25, "timing/trainer_idle_frac": 0.03,
                                "rollout/preempted": 3, "rollout/regenerated": 2}) + "\n")
    (run / "recipe.toml").write_text("[train]\nsteps = 10\n[rollout]\nmax_staleness = 2\n")
    with (run / "metrics.jsonl").open("a") as f:  # the histogram and the trainer's waits (#74)
        f.write(json.dumps({"step": 6, "rollout/staleness_mean": 1.0, "rollout/staleness_tokens": [10, 20, 10],
                            "timing/engine_idle_frac": 0.25, "timing/trainer_idle_frac": 0.03,
                            "timing/trainer_wait_s": 4.5}) + "\n")
    out = shown()
    assert "stale" in out and "ahead" in out and "25%" in out and "3%" in out
    assert ("sampling ahead, k = 2: trained tokens by updates behind 0: 25%, 1: 50%, 2: 25%; idle on average: "
            "engine 25%, trainer 3%; the trainer waited 4.5 s on the engine") in out
    assert "preempted 6 request(s)" in out and "4 R3 sample(s) drawn again" in out
    titles = []
    set_title = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, t, *a, **k: (titles.append(t), set_title(self, t, *a, **k))[1])
    plots.plot_metrics(run / "metrics.jsonl", tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 0 and titles[-2:] == [plots.STALENESS[1], plots.IDLE[1]]
    assert len(titles) == 8


def test_status_shows_trained_tokens_nonfinite_share_the_last_parity_and_an_engine_fault_in_80_columns(tmp_path):
    """#72: what a step trained on beside what was sampled, the share of log μ that was not finite,
    the newest parity (a row has one only where a check was due) and what stopped the run; #74:
    the cells fit 80 columns, the async ones included."""
    from rich.console import Console

    from cli.render import status_view

    run = make_run(tmp_path, summary={"status": "engine_fault", "written_at": time.time(),
                                      "error": "step 4: the rollout engine returned non-finite log-probs"})
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "sync/parity_abs_dlogp": 0.029, "loss/tokens": 262144,
                            "rollout/resp_tokens": 262144, "rollout/logp_nonfinite_frac": 0.0}) + "\n")
        f.write(json.dumps({"step": 5, "loss/tokens": 256, "rollout/resp_tokens": 262144,
                            "rollout/logp_nonfinite_frac": 0.999, "train/kl_mu_pi_old": 1.5e-3,
                            "rollout/staleness_mean": 1.0, "rollout/batches_ahead": 1,
                            "timing/engine_idle_frac": 0.5, "timing/trainer_idle_frac": 0.25}) + "\n")
    c = Console(width=80, record=True)
    c.print(status_view(status.read(run), 80))
    out = c.export_text()
    assert "engine_fault" in out and "stopped: step 4: the rollout engine returned non-finite log-probs" in out
    assert "tokens 256/262.1k" in out and "log μ NaN 99.9%" in out and "parity 2.9e-02" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_a_run_that_ended_before_its_first_step_reads_as_a_failed_start(tmp_path):
    """#99: a start's fault (or a kill) before the first step leaves a run folder with nothing to resume:
    `status` says it is a failed start, and `--resume` says to run again without it."""
    import pytest

    import types

    from minirl.disk import store
    from minirl.errors import UsageError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no process has now
    run = make_run(tmp_path, proc={"pid": gone.pid, "host": socket.gethostname(), "started": time.time()}, rows=0)
    assert status.read(run).state == "failed start (killed)"
    (run / "summary.json").write_text(json.dumps({"status": "engine_fault", "written_at": time.time() + 1}))
    assert status.read(run).state == "failed start (engine_fault)"
    ws = types.SimpleNamespace(root=tmp_path, runs=tmp_path / "runs", runs_newest_first=lambda: [run])
    with pytest.raises(UsageError, match=r"nothing to resume in .*runs: no run has a checkpoint \(the newest, "
                                         r"20261123-010203, stopped before its first\); start it again: `minirl run "):
        store.resume_checkpoint(ws, check=lambda c: None)
    with pytest.raises(UsageError, match="it stopped before its first checkpoint; start it again: `minirl run .*` "
                                         "without --resume"):
        store.resume_checkpoint(ws, check=lambda c: None, run=run)
    assert status.read(make_run(tmp_path / "b", proc={"pid": gone.pid, "host": socket.gethostname(),
                                                    "started": time.time()})).state == "killed"  # it trained steps


def test_a_runs_folder_given_for_its_workspace_is_that_run(tmp_path, monkeypatch):
    """`minirl status|samples|check demo/runs/ID` (the path a run prints; ID in runs/) reads that run; the newest
    otherwise; a folder elsewhere in the workspace names the workspace; two runs given are refused."""
    import pytest

    from minirl.errors import UsageError

    run = make_run(tmp_path)
    (tmp_path / "minirl.toml").write_text("")
    newer = tmp_path / "runs" / "20991231-000000"
    newer.mkdir()
    assert status.run_dir_of(tmp_path, None) == newer
    assert status.run_dir_of(run, None) == tmp_path / "runs" / run.name
    assert status.run_dir_of(run, run.name) == tmp_path / "runs" / run.name
    monkeypatch.chdir(tmp_path / "runs")
    assert status.run_dir_of(Path(run.name), None) == tmp_path / "runs" / run.name
    with pytest.raises(UsageError, match="two runs given"):
        status.run_dir_of(run, newer.name)
    with pytest.raises(UsageError, match="is inside the workspace"):
        status.run_dir_of(tmp_path / "runs", None)
