"""#100: a run that trains and samples in one process spins long and sizes its OpenMP team to the cores
other processes leave it (minirl/proc/team.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minirl.proc import team as team_mod
from minirl.proc.team import Team, busy_ticks, tree_ticks, wanted
from tests.test_faults import ROOT, fresh_copy, latest_run, metric_rows, small_ws, wait_until  # noqa: F401

HOG = "import sys; open(sys.argv[1], 'w').close()\nwhile True: pass"


def test_the_team_is_the_cores_left_between_one_and_its_first_size():
    assert wanted(2, 0.0, 2) == 2 and wanted(2, 0.3, 2) == 2  # a quiet machine, or a little noise
    assert wanted(2, 0.7, 2) == 1 and wanted(2, 1.0, 2) == 1 and wanted(2, 3.0, 2) == 1  # never none
    assert wanted(16, 1.0, 16) == 15  # one core taken of many
    assert wanted(8, 0.0, 4) == 4  # never more than the team minirl started with


def test_only_a_run_whose_one_team_minirl_chose_watches():
    from minirl.config.recipe import Recipe

    rec, auto = Recipe(), {team_mod.AUTO: "auto"}
    assert team_mod.adapts(rec, env=auto)
    assert not team_mod.adapts(rec, env={})  # the user's OMP_NUM_THREADS or GOMP_SPINCOUNT
    assert not team_mod.adapts(rec, env={**auto, "WORLD_SIZE": "2"})  # a rank of a torchrun job
    rec.rollout.max_staleness = 1  # an engine in a process of its own
    assert not team_mod.adapts(rec, env=auto)
    rec.rollout.max_staleness, rec.parallel.rollout_gpus = 0, 1  # engines on rollout GPUs of their own
    assert not team_mod.adapts(rec, env=auto)


class Readings(Team):
    """The team's decisions on given clock readings and, once a window, CPU readings (busy s of its
    CPUs, its own CPU s): a CPU reading is taken only where a window has passed."""

    def __init__(self, walls, cpus):
        self.walls, self.cpus = iter(walls), iter(cpus)
        super().__init__(watch=True)

    def _wall(self):
        return next(self.walls)

    def _cpu(self):
        return next(self.cpus)


@pytest.fixture
def two_threads():
    import torch

    was = torch.get_num_threads()
    torch._C.set_num_threads(2)  # the suite's workers run one each
    yield
    torch._C.set_num_threads(was)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no team to size")
def test_the_team_shrinks_at_once_and_grows_back_after_two_quiet_windows(two_threads):
    import torch

    n = len(os.sched_getaffinity(0))
    # cumulative (busy of its CPUs, its own); windows of 1 s, in which others keep n − 1 cores busy, then none;
    # at 1.5 s no window has passed, and no CPU reading is taken (an exhausted iterator would say so)
    team = Readings([0, 1, 1.5, 2, 3, 4], [(0, 0), (n, 1), (2 * n, 2), (2 * n + 1, 3), (2 * n + 2, 4)])
    team.start()
    assert team.watched and team.most == 2
    assert team.after_step() == 1 and torch.get_num_threads() == 1  # another process held a core: at once
    assert team.after_step() == 1  # under a second: no window yet
    assert team.after_step() == 1  # still held
    assert team.after_step() == 1  # free, one window: not yet
    assert team.after_step() == 2 and torch.get_num_threads() == 2  # free for a second window: grown back


def test_a_team_minirl_did_not_choose_never_changes(two_threads):
    team = Team(watch=False)
    team.start()  # reads nothing
    assert not team.watched and team.after_step() == team.threads == 2


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="no /proc/stat")
def test_busy_ticks_count_what_a_process_on_that_cpu_spent(tmp_path):
    """On this machine's real /proc/stat: a process kept on one CPU adds at least its own CPU time to
    that CPU's busy ticks (the window's measure of others' use)."""
    cpu = min(os.sched_getaffinity(0))
    started = tmp_path / "started"
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(started)], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        wait_until(started.exists, hog, timeout_s=60)

        def spent() -> int:  # the hog's user + system ticks
            fields = Path(f"/proc/{hog.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])

        stat = Path("/proc/stat")
        busy0, spent0 = busy_ticks({cpu}, stat.read_text()), spent()
        wait_until(lambda: spent() - spent0 >= 50, hog, timeout_s=120)  # half a second of its time at 100 Hz
        busy1, spent1 = busy_ticks({cpu}, stat.read_text()), spent()
        assert busy1 - busy0 >= spent1 - spent0 - 5  # a few ticks of accounting's granularity
    finally:
        hog.kill()
        hog.wait()


KID = """import subprocess, sys, time
while time.process_time() < 0.5: pass
subprocess.run([sys.executable, "-c", "import time\\nwhile time.process_time() < 0.5: pass"])
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def test_a_runs_own_time_counts_its_children_and_what_they_waited_for(tmp_path):
    """A grader's sandbox or a hosted environment is the run's own work: its team waits for it, never
    competes with it, so a window counts it as the run's, not another process's."""
    done = tmp_path / "done"
    before = tree_ticks(os.getpid())
    kid = subprocess.Popen([sys.executable, "-c", KID, str(done)])
    try:
        wait_until(done.exists, kid, timeout_s=120)
        hz = os.sysconf("SC_CLK_TCK")
        assert tree_ticks(os.getpid()) - before >= 0.9 * hz  # its own half second and its child's, waited for
    finally:
        kid.kill()
        kid.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no team to size")
def test_a_run_beside_a_busy_process_runs_on_the_cores_left(small_ws, tmp_path):
    """`minirl run` as a user starts it (neither OMP_NUM_THREADS nor GOMP_SPINCOUNT set) beside a
    process that keeps a core busy: its rows say the team shrank, and the console says why."""
    ws = fresh_copy(small_ws, tmp_path)
    started = tmp_path / "hog-started"
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(started)])
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "MINIRL_TEST_THREADS", team_mod.AUTO)}
    try:
        wait_until(started.exists, hog, timeout_s=60)
        out = tmp_path / "out.txt"
        with out.open("w") as f:
            run = subprocess.Popen([sys.executable, "-m", "cli.main", "run", str(ws), "--steps", "10000"], cwd=ROOT,
                                   env={**env, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}, stdout=f,
                                   stderr=subprocess.PIPE, text=True)

            def shrunk() -> bool:
                run_dir = latest_run(ws)
                rows = metric_rows(run_dir, allow_torn_last=True) if run_dir else []
                return any(r["timing/threads"] < os.cpu_count() for r in rows)

            wait_until(shrunk, run, timeout_s=600)  # a hang guard: the state is waited for, not a time
            run.send_signal(signal.SIGINT)
            assert run.wait(timeout=600) == 128 + signal.SIGINT
    finally:
        hog.kill()
        hog.wait()
    rows = metric_rows(latest_run(ws))
    assert rows[0]["timing/threads"] <= os.cpu_count() and min(r["timing/threads"] for r in rows) >= 1
    assert "other processes keep" in out.read_text()
    summary = json.loads((latest_run(ws) / "summary.json").read_text())
    assert summary["status"] == "interrupted"


def test_the_cli_chooses_the_team_and_its_spin_only_where_the_user_set_neither(monkeypatch):
    from cli.main import _prepare_env

    for given, mark in (({}, "auto"), ({"OMP_NUM_THREADS": "2"}, team_mod.USER_THREADS),
                        ({"GOMP_SPINCOUNT": "300000"}, None), ({"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "9"}, None)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", team_mod.AUTO)} | given
        monkeypatch.setattr(os, "environ", env)  # what the CLI sets stays in this copy
        _prepare_env(verbose=True)
        assert env.get(team_mod.AUTO) == mark
        assert env["GOMP_SPINCOUNT"] == given.get("GOMP_SPINCOUNT", "1000")  # `run` lengthens it where it watches
        _prepare_env(verbose=True)  # a child of the CLI inherits the mark, whatever the CLI set
        assert env.get(team_mod.AUTO) == mark


def test_a_run_that_keeps_the_users_threads_with_a_short_spin_says_so():
    """OMP_NUM_THREADS alone (common on ML hosts) keeps the user's team with the CLI's short spin, slower on a
    quiet machine than the team minirl would choose: the run says so in one line, and how to choose."""
    from minirl.config.recipe import Recipe

    rec = Recipe()
    env = {team_mod.AUTO: team_mod.USER_THREADS, "OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "1000"}
    note = team_mod.fixed_team_note(rec, env=env)
    assert "OMP_NUM_THREADS=2" in note and "GOMP_SPINCOUNT=1000" in note and "unset it" in note
    assert not team_mod.adapts(rec, env=env)
    assert team_mod.fixed_team_note(rec, env={**env, team_mod.AUTO: "auto"}) is None  # minirl chose: it watches
    assert team_mod.fixed_team_note(rec, env={"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "9"}) is None  # both chosen
    assert team_mod.fixed_team_note(rec, env={**env, "WORLD_SIZE": "2"}) is None  # a rank: its team is the launcher's
    rec.rollout.max_staleness = 1  # an engine in a process of its own: no team to choose for both
    assert team_mod.fixed_team_note(rec, env=env) is None
