"""A sandbox for running untrusted programs (the code grader's), from what Linux gives.

Each run is a process tree of its own:

    prlimit (resource limits) ─▶ unshare (user, mount, PID, network, IPC namespaces) ─▶ harness.py

- limits (`prlimit`, inherited by everything below): CPU seconds, address space, file size, open
  files, processes, no core files; a wall-clock limit kills the whole tree;
- a new session, an empty environment (no tokens, no paths of ours);
- namespaces (`unshare`): no network (a network namespace with nothing up), its own PID namespace
  (it sees and can signal only its own processes; when its first process ends the kernel kills
  the rest), and a mount namespace in which the harness builds the program a root of its own
  (`root_layout` says what it holds: the standard library and the shared libraries it loads,
  read-only, a few devices, and a small tmpfs folder, the one writable place; no /proc, no home,
  no workspace, no caches, no project, not the host's /tmp) before dropping every capability;
- the process limit: RLIMIT_NPROC counts every process of the user, and root is exempt from it,
  so run as root (containers, CI) each run gets a `pids` cgroup of its own with `pids.max` instead.

What is unavailable on a machine (no `unshare`, user namespaces switched off, a mount that
cannot be made read-only) is said once, loudly, on stderr, and the run goes on with what is
left; `protections()` says what holds here. docs/graders.md lists the protections, the attacks
each stops, and what was verified on which machine.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
MAX_REPORT = 2**20  # bytes of report lines read from one run
_runs = itertools.count()
_warned: set[str] = set()
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Limits:
    wall_s: float = 10.0  # the whole run, start-up included
    cpu_s: int = 10
    memory_mib: int = 1024  # address space of each process
    file_mib: int = 16  # largest file it may write
    folder_mib: int = 64  # all it may write: its folder is a tmpfs of this size (memory, never the disk)
    open_files: int = 64
    processes: int = 32


@dataclass(slots=True)
class Outcome:
    """What came back from one run: the harness's report lines that carried the run's secret
    (kind, test index, reason), how the tree ended, and what the harness said it could confine."""

    reports: list[tuple[str, int, str]] = field(default_factory=list)
    returncode: int | None = None
    timed_out: bool = False
    hello: dict = field(default_factory=dict)
    seconds: float = 0.0


def protections() -> dict[str, bool]:
    """What holds on this machine (probed once per process)."""
    p = _probe()
    return {"limits": p["prlimit"], "namespaces": p["namespaces"],
            "process_limit": p["cgroup"] is not None or os.geteuid() != 0}


def run(job: dict, limits: Limits = Limits()) -> Outcome:
    """Run the harness on `job` ({"program", "tests"}) in a fresh sandbox; never raises on what
    the program does."""
    probe = _probe()
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="minirl-code-"))
    cgroup = _new_cgroup(probe, limits)
    secret = secrets.token_hex(16)
    out = Outcome()
    fds: list[int] = []
    try:
        secret_r, secret_w = os.pipe()
        report_r, report_w = os.pipe()
        fds += [secret_r, report_r, report_w]
        os.write(secret_w, secret.encode())
        os.close(secret_w)
        cmd = [shutil.which("prlimit") or "prlimit", f"--cpu={limits.cpu_s}", f"--as={limits.memory_mib * 2**20}",
               f"--fsize={limits.file_mib * 2**20}", f"--nofile={limits.open_files}",
               f"--nproc={probe['other_processes'] + limits.processes}", "--core=0", "--"]
        if cgroup is not None:  # the shell joins the run's cgroup, then becomes prlimit: nothing forks before
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *cmd]
        if probe["namespaces"]:
            cmd += [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork",
                    "--net", "--ipc", "--kill-child", "--"]
        cmd += [sys.executable, "-I", str(HARNESS), str(secret_r), str(report_w)]
        root = {**probe["root"], "folder_mib": limits.folder_mib} if probe["namespaces"] else None
        body = json.dumps({**job, "workdir": str(workdir), "root": root}).encode()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=workdir, env=ENV, pass_fds=(secret_r, report_w), start_new_session=True)
        for fd in (secret_r, report_w):
            os.close(fd)
            fds.remove(fd)
        chunks: list[bytes] = []
        reader = threading.Thread(target=_read_capped, args=(report_r, chunks), daemon=True)
        reader.start()
        try:
            proc.stdin.write(body)
            proc.stdin.close()
        except OSError:
            pass  # it ended before reading its job: the report says nothing, the run fails
        try:
            out.returncode = proc.wait(timeout=max(0.1, limits.wall_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            out.timed_out = True
        finally:  # also when interrupted (a caller's own time limit): nothing of the run outlives it
            if proc.returncode is None:
                _kill(proc)
                out.returncode = proc.wait()
        reader.join(timeout=2.0)  # everything that held the pipe is gone with the namespace
        out.reports, out.hello = _parse(b"".join(chunks), secret)
        _check_hello(out.hello, probe)
        return out
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            _remove_cgroup(cgroup)
        out.seconds = time.monotonic() - t0


def _read_capped(fd: int, chunks: list[bytes]) -> None:
    got = 0
    while True:
        data = os.read(fd, 65536)
        if not data:
            return
        if got < MAX_REPORT:
            chunks.append(data[: MAX_REPORT - got])
            got += len(data)


def _parse(raw: bytes, secret: str) -> tuple[list[tuple[str, int, str]], dict]:
    """Report lines that carry the secret; anything else (forged, garbled, cut) is ignored."""
    reports, hello = [], {}
    for line in raw.decode(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) != 4 or parts[0] != secret:
            continue
        try:
            kind, index, why = parts[1], int(parts[2]), json.loads(parts[3])
        except ValueError:
            continue
        if kind == "hello":
            try:
                hello = json.loads(why)
            except ValueError:
                pass
        else:
            reports.append((kind, index, why))
    return reports, hello


def _kill(proc: subprocess.Popen) -> None:
    """The whole tree: its session's process group (prlimit, unshare and, without namespaces,
    whatever stayed in the group); with namespaces, unshare's end takes the PID namespace down."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1's pids hierarchy, or v2


def _new_cgroup(probe: dict, limits: Limits) -> Path | None:
    """A `pids` cgroup for one run (root only: the kernel's RLIMIT_NPROC exempts root)."""
    if probe["cgroup"] is None:
        return None
    path = probe["cgroup"] / f"run-{os.getpid()}-{next(_runs)}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(limits.processes))
        return path
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return None


def _remove_cgroup(path: Path) -> None:
    """Kill what is left in it (nothing, with namespaces), then remove it."""
    for _ in range(50):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.02)


def _owner(p: Path) -> int | None:
    try:
        return p.stat().st_uid
    except OSError:
        return None


_PROBED: dict | None = None


def _probe() -> dict:
    """Which protections this machine gives, tried once: namespaces through `unshare`, a `pids`
    cgroup when running as root, and what RLIMIT_NPROC must leave to the user's other processes
    (it counts every process of the user, and never binds root: counted once, with a margin)."""
    global _PROBED
    with _lock:
        if _PROBED is not None:
            return _PROBED
        root = os.geteuid() == 0
        others = 0 if root else sum(1 for p in Path("/proc").glob("[0-9]*") if _owner(p) == os.getuid()) + 64
        found = {"prlimit": shutil.which("prlimit") is not None, "namespaces": False, "cgroup": None,
                 "other_processes": others, "root": root_layout()}
        unshare = shutil.which("unshare")
        if unshare:
            try:
                r = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "--pid", "--fork", "--net", "--ipc",
                                    "--kill-child", "--", "/bin/true"], env=ENV, capture_output=True, timeout=30, cwd="/")
                found["namespaces"] = r.returncode == 0
            except (OSError, subprocess.SubprocessError):
                pass
        if root:
            for base in CGROUP_ROOTS:
                parent = base / "minirl-sandbox"
                try:
                    parent.mkdir(exist_ok=True)
                    probe_dir = parent / f"probe-{os.getpid()}"
                    probe_dir.mkdir(exist_ok=True)
                    ok = (probe_dir / "pids.max").exists()
                    probe_dir.rmdir()
                    if ok:
                        found["cgroup"] = parent
                        break
                except OSError:
                    continue
        if not found["prlimit"]:
            _warn_once("prlimit", "`prlimit` (util-linux) is missing: sandboxed programs run without CPU, memory, "
                                  "file-size, open-file or process limits; only the wall-clock limit stops them")
        if root and found["cgroup"] is None:
            _warn_once("cgroup", "running as root without a writable `pids` cgroup: the kernel exempts root from "
                                 "the process limit, so nothing stops a fork bomb inside the code sandbox but the "
                                 "wall-clock limit")
        if not found["namespaces"]:
            _warn_once("namespaces", "Linux user namespaces are unavailable here (`unshare --user` failed): sandboxed "
                                     "programs run WITHOUT network isolation, a read-only filesystem or a private "
                                     "process table; only resource limits, a session of their own, an empty "
                                     "environment and a temporary folder protect this machine")
        _PROBED = found
        return found


DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def root_layout() -> dict:
    """What the program's root holds besides its own folder, at the paths this interpreter knows
    them by: the standard library and the shared libraries its extension modules load, read-only;
    the interpreter's site-packages covered (third-party packages are not part of it); a few
    devices. The harness builds it (harness.confine); nothing else of the machine is there."""
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                     "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix})
    dynload = Path(sysconfig.get_config_var("DESTSHARED") or Path(base["platstdlib"], "lib-dynload"))
    libraries = _shared_libraries(sorted(dynload.glob("*.so"))) if dynload.is_dir() else []
    links: dict[str, str] = {}
    read_only = {_real(base[k], links) for k in ("stdlib", "platstdlib") if os.path.isdir(base[k])}
    read_only |= {os.path.dirname(_real(lib, links)) for lib in libraries}
    if os.path.isfile("/etc/ld.so.cache"):  # where the loader finds a library by its name
        read_only.add(_real("/etc/ld.so.cache", links))
    read_only = {p for p in read_only if not _inside(p, read_only)}
    packages = {base["purelib"], base["platlib"], *site.getsitepackages()}
    hidden = {os.path.realpath(p) for p in packages if os.path.isdir(p)}
    hidden = {p for p in hidden if _inside(p, read_only)}
    links = {k: v for k, v in links.items() if not _inside(k, read_only)}  # those inside come with their folder
    return {"read_only": sorted(read_only), "hidden": sorted(hidden), "links": links,
            "devices": [d for d in DEVICES if os.path.exists(d)]}


def _inside(path: str, folders: set[str]) -> bool:
    return any(path.startswith(f.rstrip("/") + "/") for f in folders)


def _shared_libraries(modules: list[Path]) -> list[str]:
    """The shared libraries these extension modules load, as the loader names them (`ldd`); the
    usual library folders where `ldd` is missing."""
    ldd = shutil.which("ldd")
    if ldd and modules:
        try:
            out = subprocess.run([ldd, *map(str, modules)], capture_output=True, text=True, timeout=60, env=ENV).stdout
            found = {line.split("=>")[1].split("(")[0].strip() for line in out.splitlines() if "=> /" in line}
            if found:
                return sorted(found)
        except (OSError, subprocess.SubprocessError):
            pass
    return [str(Path(d, "x")) for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64") if os.path.isdir(d)]


def _real(path: str, links: dict[str, str]) -> str:
    """`path` with every symbolic link on its way resolved; each link met is recorded in `links`
    (its place -> its target), so the sandbox can make the same path lead to the same file."""
    current = "/"
    for part in Path(path).parts[1:]:
        step = os.path.join(current, part)
        if os.path.islink(step):
            links[step] = os.readlink(step)
            current = os.path.realpath(step)
        else:
            current = step
    return current


def _check_hello(hello: dict, probe: dict) -> None:
    if probe["namespaces"] and hello and hello.get("confine_error"):
        _warn_once("root", f"the code sandbox could not give the program a root of its own "
                           f"({hello['confine_error']}): sandboxed programs see this machine's files and can "
                           "write where its user can")
    elif probe["namespaces"] and hello and not hello.get("read_only", False):
        _warn_once("read_only", "the code sandbox's root stayed writable: sandboxed programs can write outside "
                                "their folder (inside the sandbox only)")


def _warn_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"minirl: WARNING: {text}", file=sys.stderr, flush=True)
