"""The program inside the code grader's sandbox (rewards/sandbox.py starts it; standard library only).

Two processes, so that the program under test never shares memory with what judges it:

    tester (trusted: runs the dataset's tests, holds the run's secret, reports to the grader)
      └─ runner (untrusted: loads the model's program and answers calls on it)

The tester reads the job (program, tests) from stdin, sets up the sandbox's filesystem when it
runs as root of a fresh user and mount namespace (a root of its own: the standard library
read-only and a small writable folder, nothing else of the machine), drops every capability,
marks itself non-dumpable (so the runner can neither ptrace it nor read its memory), and forks
the runner. Only then does
it read the secret from its descriptor: the runner's memory never held it, and the runner closes
the report descriptor before it runs a line of the program.

The tests run in the tester, in a namespace of their own, with the prompt's trusted code and
pristine builtins. The function under test is a proxy: each call goes to the runner as JSON, and
what comes back is plain data (exact builtin types, rebuilt here), so an object with a doctored
`__eq__`, a redefined builtin, a patched assertion helper or a printed "all tests passed" never
reaches the comparison. Every test's outcome is one report line carrying the secret; the grader
counts a run as passed only when every test reported a pass and the tester reported done.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import sys
import traceback

MAX_REPLY = 16 * 2**20  # bytes of one answer from the runner
MAX_OUTPUT = 2**20  # characters a stdin/stdout program may print per case


# ----- plain data, both ways --------------------------------------------------------------------
def encode(x, depth: int = 0):
    """x as JSON-able plain data; anything that is not an exact builtin value type is refused."""
    if depth > 100:
        raise TypeError("nested too deep")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if abs(x) < 2**53 else {"i": str(x)}
    if t is float:
        return x if math.isfinite(x) else {"f": repr(x)}
    if t is list:
        return [encode(v, depth + 1) for v in x]
    if t is tuple:
        return {"t": [encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [encode(v, depth + 1) for v in x]}
    if t is bytes:
        return {"b": x.hex()}
    if t is complex:
        return {"c": [encode(x.real), encode(x.imag)]}
    raise TypeError(f"not plain data: {t.__module__}.{t.__qualname__}")


def decode(x):
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    (tag, v), = x.items()
    if tag == "i":
        return int(v)
    if tag == "f":
        return float(v)
    if tag == "t":
        return tuple(decode(e) for e in v)
    if tag == "d":
        return {decode(k): decode(e) for k, e in v}
    if tag == "s":
        return {decode(e) for e in v}
    if tag == "fs":
        return frozenset(decode(e) for e in v)
    if tag == "b":
        return bytes.fromhex(v)
    if tag == "c":
        return complex(decode(v[0]), decode(v[1]))
    raise ValueError(f"unknown tag {tag!r}")


# ----- the sandbox's filesystem and privileges (tester, as root of its own namespaces) ---------
_MS = {"RDONLY": 1, "NOSUID": 2, "NODEV": 4, "NOEXEC": 8, "REMOUNT": 32, "NOATIME": 1024,
       "NODIRATIME": 2048, "BIND": 4096, "REC": 16384, "PRIVATE": 1 << 18, "RELATIME": 1 << 21}
# statvfs's flags of a mount -> the mount flags a read-only remount of a bind of it must keep (the
# kernel locks them on mounts that came from the parent namespace)
_KEEP = {os.ST_NOSUID: "NOSUID", os.ST_NODEV: "NODEV", os.ST_NOEXEC: "NOEXEC", os.ST_NOATIME: "NOATIME",
         os.ST_NODIRATIME: "NODIRATIME", os.ST_RELATIME: "RELATIME"}
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}  # syscall numbers; no libc wrapper
FOLDER = "/sandbox"  # the program's own folder, its working directory


def _mount(libc, src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    if libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _place(root: str, path: str, *, is_dir: bool) -> str:
    """Make `path` inside the new root (a mount point), its missing parents traverse-only (0111:
    the program can pass through /root on its way to the standard library but not list it)."""
    target = root + path
    parent = os.path.dirname(target)
    missing = []
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(missing):
        os.mkdir(d, 0o111)
    if not os.path.lexists(target):
        if is_dir:
            os.mkdir(target, 0o111)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o444))
    return target


def confine(mount_point: str, layout: dict) -> dict:
    """A root of the program's own, then no capabilities: an empty read-only tmpfs holding the
    standard library and the shared libraries it loads (read-only binds at their own paths, the
    interpreter's site-packages covered), a few devices, and its folder (a small tmpfs, the one
    writable place). No /proc, no /sys, no home, no workspace, no project, not the host's /tmp.
    `layout` comes from rewards/sandbox.py; returns what holds, checked, for the grader to report."""
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    _mount(libc, None, "/", None, _MS["REC"] | _MS["PRIVATE"])  # nothing we do here leaks out
    root = mount_point.rstrip("/")
    _mount(libc, "tmpfs", root, "tmpfs", _MS["NOSUID"] | _MS["NODEV"], "size=1m,mode=0111")
    try:
        for src in layout["read_only"]:
            dst = _place(root, src, is_dir=os.path.isdir(src))
            _mount(libc, src, dst, None, _MS["BIND"] | _MS["REC"])
            kept = sum(_MS[name] for flag, name in _KEEP.items() if os.statvfs(dst).f_flag & flag)
            _mount(libc, None, dst, None, _MS["REMOUNT"] | _MS["BIND"] | _MS["RDONLY"] | kept)
        for path in layout["hidden"]:  # inside a bind above: covered by an empty read-only tmpfs
            _mount(libc, "tmpfs", root + path, "tmpfs", _MS["RDONLY"] | _MS["NOSUID"] | _MS["NODEV"] | _MS["NOEXEC"],
                   "size=4k,mode=0111")
        for dev in layout["devices"]:
            _mount(libc, dev, _place(root, dev, is_dir=False), None, _MS["BIND"])
        for path, target in layout["links"].items():
            _place(root, os.path.dirname(path), is_dir=True)
            os.symlink(target, root + path)
        folder = _place(root, FOLDER, is_dir=True)
        _mount(libc, "tmpfs", folder, "tmpfs", _MS["NOSUID"] | _MS["NODEV"],
               f"size={layout['folder_mib']}m,mode=0700")
        number = _PIVOT_ROOT.get(platform.machine())
        if number is None:
            raise OSError(38, f"pivot_root's syscall number on {platform.machine()} is not known here")
        os.chdir(root)
        if libc.syscall(ctypes.c_long(number), b".", b".") != 0:  # the old root now sits on top of the new one ...
            raise OSError(ctypes.get_errno(), "pivot_root failed", root)
        if libc.umount2(b".", 2) != 0:  # ... and is detached (MNT_DETACH): nothing of it stays reachable
            raise OSError(ctypes.get_errno(), "detaching the old root failed")
    except BaseException:
        os.chdir("/")
        libc.umount2(os.fsencode(root), 2)  # back to the machine's root; the grader warns
        raise
    os.chdir("/")
    _mount(libc, None, "/", None, _MS["REMOUNT"] | _MS["BIND"] | _MS["RDONLY"] | _MS["NOSUID"] | _MS["NODEV"])
    os.chdir(FOLDER)
    return {"root": "private", "read_only": bool(os.statvfs("/").f_flag & os.ST_RDONLY)}


def _drop_capabilities(libc) -> None:
    PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability: harmless

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()  # all zero: no capability left
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


# ----- the runner: the model's program, behind a pipe -------------------------------------------
def runner(program: str, requests: int, replies: int) -> None:
    """Load the program, then answer one JSON line per request. Never returns."""
    ns: dict = {"__name__": "__main__"}

    def reply(obj) -> None:
        data = (json.dumps(obj) + "\n").encode()
        if len(data) > MAX_REPLY:
            data = (json.dumps({"error": f"an answer of {len(data)} bytes"}) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(replies, view):]

    try:
        code, broken = compile(program, "solution.py", "exec"), None
    except BaseException as e:  # noqa: BLE001 - whatever the program is, it is only reported
        code, broken = None, f"{type(e).__name__}: {e}"
    for line in os.fdopen(requests, "r"):
        req = json.loads(line)
        try:
            if code is None:
                raise SyntaxError(broken)
            if "io" in req:
                out = _run_script(code, req["io"])
            else:
                if "__loaded__" not in ns:
                    ns["__loaded__"] = True
                    exec(code, ns)  # noqa: S102 - this process exists to run it
                fn = ns.get(req["call"])
                if not callable(fn):
                    raise NameError(f"the program defines no function {req['call']!r}")
                out = fn(*decode(req["args"]), **decode(req["kwargs"]))
            reply({"ok": encode(out)})
        except TypeError as e:
            reply({"hack" if str(e).startswith("not plain data") else "error": f"{type(e).__name__}: {e}"})
        except SystemExit as e:
            reply({"exit": f"SystemExit({e.code!r})"})
        except BaseException as e:  # noqa: BLE001
            reply({"error": f"{type(e).__name__}: {e}"})
    os._exit(0)


class _Capped(io.StringIO):
    def write(self, s):
        if self.tell() + len(s) > MAX_OUTPUT:
            raise OverflowError(f"more than {MAX_OUTPUT} characters of output")
        return super().write(s)


def _run_script(code, stdin: str) -> str:
    """One stdin/stdout case: the program run afresh with `stdin`, what it printed."""
    out, saved = _Capped(), (sys.stdin, sys.stdout)
    sys.stdin, sys.stdout = io.StringIO(stdin), out
    try:
        exec(code, {"__name__": "__main__"})  # noqa: S102
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.stdin, sys.stdout = saved
    return out.getvalue()


# ----- the tester --------------------------------------------------------------------------------
def main() -> None:
    secret_fd, report_fd = int(sys.argv[1]), int(sys.argv[2])
    job = json.loads(sys.stdin.read())
    hello = {"pid1": os.getpid() == 1}
    if job.get("root"):
        try:
            hello.update(confine(job["workdir"], job["root"]))
        except OSError as e:
            hello["confine_error"] = f"{e}"
            os.chdir(job["workdir"])
        _drop_capabilities(ctypes.CDLL(None, use_errno=True))  # either way: it cannot remount what it sees
    else:
        os.chdir(job["workdir"])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, no /proc/<pid>/mem or fd of this process
    req_r, req_w = os.pipe()  # tester → runner
    ans_r, ans_w = os.pipe()  # runner → tester
    pid = os.fork()
    if pid == 0:  # the runner: nothing of the tester's channels, nor the tests, survives into it
        for fd in (secret_fd, report_fd, req_w, ans_r, 0):
            os.close(fd)
        program = job.pop("program")
        job.clear()  # the tests' code and data: freed, not reachable from the program's frames
        runner(program, req_r, ans_w)
    os.close(req_r)
    os.close(ans_w)
    secret = os.read(secret_fd, 256).decode().strip()
    os.close(secret_fd)
    report = os.fdopen(report_fd, "w", buffering=1)

    def say(kind: str, index: int = -1, why: str = "") -> None:
        report.write(f"{secret} {kind} {index} {json.dumps(why[:500])}\n")

    say("hello", why=json.dumps(hello))
    requests = os.fdopen(req_w, "w", buffering=1)
    answers = os.fdopen(ans_r, "r")

    def ask(req: dict):
        try:
            requests.write(json.dumps(req) + "\n")
        except BrokenPipeError:
            raise _Gone("the program's process ended") from None
        line = answers.readline()
        if not line:
            raise _Gone("the program's process ended")
        try:
            ans = json.loads(line)
            assert isinstance(ans, dict) and len(ans) == 1
        except (ValueError, AssertionError):
            raise _Failed("hack", "the program wrote on its answer channel") from None
        for kind in ("hack", "exit", "error"):
            if kind in ans:
                raise _Failed(kind, ans[kind])
        return decode(ans["ok"])

    tests = job["tests"]
    for i, test in enumerate(tests):
        try:
            if test["kind"] == "function":
                _function_test(test, ask)
            elif test["kind"] == "output":  # a tool's run (rewards/tools.py): what it printed, nothing judged
                say("output", i, ask({"io": test["stdin"]}))
                continue
            else:
                got = ask({"io": test["stdin"]})
                if _lines(got) != _lines(test["stdout"]):
                    raise _Failed("failed", f"case {i}: printed {got[:200]!r}, expected {test['stdout'][:200]!r}")
            say("pass", i)
        except _Gone:
            _, status = os.waitpid(pid, 0)
            how = (f"exited with code {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status)
                   else f"killed by signal {os.WTERMSIG(status)}")
            say("fail", i, f"gone: the program's process {how} before answering")
            break
        except _Failed as e:
            say("fail", i, f"{e.kind}: {e.why}")
        except BaseException as e:  # noqa: BLE001 - an assertion of the test, or the test's own error
            tb = traceback.extract_tb(e.__traceback__)
            where = f" (test line {tb[-1].lineno})" if tb else ""
            say("fail", i, f"failed: {type(e).__name__}{where}: {str(e)[:200]}")
    say("done", len(tests))
    report.close()
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    os._exit(0)


class _Failed(Exception):
    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


class _Gone(Exception):
    pass


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.strip().splitlines()]


def _function_test(test: dict, ask) -> None:
    """The dataset's check, in a namespace of the tester's own, against a proxy of the program's
    function. The prompt's code (helpers some tests call, e.g. HumanEval's `encode_cyclic`) is
    the dataset's, run here; the model's code runs only in the runner."""
    import builtins

    ns = {"__name__": "__test__", "__builtins__": builtins}
    exec(compile(test.get("prompt", ""), "prompt.py", "exec"), ns)  # noqa: S102 - the dataset's code
    exec(compile(test["test"], "test.py", "exec"), ns)  # noqa: S102
    name = test["entry_point"]

    def candidate(*args, **kwargs):
        return ask({"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)})

    candidate.__name__ = name
    ns[name] = candidate  # a test that calls the function by its name (HumanEval/33) calls the program's too
    ns[test.get("check", "check")](candidate)


if __name__ == "__main__":
    main()
