"""Run one untrusted program with limits, inside a bubblewrap sandbox (DESIGN §7).

The code verifier compiles and runs model-written programs and the problems' checkers
through `Sandbox.run`; docs/verifiers.md describes exactly what the sandbox isolates.
Without a working `bwrap` it refuses to run anything unless told `allow_unsandboxed`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# Inside the sandbox the run's work directory is mounted here and is the cwd.
SANDBOX_WORKDIR = "/box"
# The only environment a sandboxed program sees (bwrap --clearenv, then these).
SANDBOX_PATH = "/usr/bin:/bin:/usr/local/bin"
SANDBOX_ENV = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "HOME": SANDBOX_WORKDIR, "TMPDIR": "/tmp"}
# The unprivileged identity programs run as (nobody:nogroup on Debian).
NOBODY_UID = 65534
NOBODY_GID = 65534

_STDERR_TAIL_BYTES = 8192
_READ_CHUNK = 65536
# After the program exits (or is killed), how long to wait for its pipes and pid namespace
# to drain before giving up on them.
_DRAIN_S = 2.0

# Text a program prints when an allocation failed: Python, libstdc++, glibc/prlimit exec.
_OUT_OF_MEMORY_MARKERS = (
    b"MemoryError",
    b"std::bad_alloc",
    b"Cannot allocate memory",
    b"out of memory",
)


class SandboxUnavailable(RuntimeError):
    """No way to run untrusted code that the configuration allows; the message says the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunLimits:
    """Limits of one run. Set with rlimits inside the sandbox, except the wall clock and the
    output cap, which the parent enforces.

    cpu_time_s:       CPU seconds (RLIMIT_CPU rounds up to whole seconds; the measured time
                      is compared with this exact value afterwards).
    wall_time_s:      killed after this long; None = 2 × cpu_time_s + 1.
    memory_bytes:     address space (RLIMIT_AS).
    output_bytes:     stdout cap; more = killed and `output_limit_exceeded`.
    max_processes:    RLIMIT_NPROC, counted inside the sandbox's own user namespace.
    file_size_bytes:  RLIMIT_FSIZE: largest file the program may write.
    open_files:       RLIMIT_NOFILE.
    stack_bytes:      RLIMIT_STACK.
    tmp_bytes:        size of the private tmpfs at /tmp (and /dev/shm).
    """

    cpu_time_s: float = 2.0
    wall_time_s: float | None = None
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 1 * 2**20
    max_processes: int = 16
    file_size_bytes: int = 16 * 2**20
    open_files: int = 64
    stack_bytes: int = 64 * 2**20
    tmp_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "memory_bytes", "output_bytes", "max_processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RunLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.wall_time_s is not None and self.wall_time_s <= 0:
            raise ValueError(f"RunLimits.wall_time_s must be > 0, got {self.wall_time_s}")

    @property
    def wall_s(self) -> float:
        return self.wall_time_s if self.wall_time_s is not None else 2 * self.cpu_time_s + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What one run did. `exit_code` is None when the program died by `signal`.

    Through bwrap a death by signal N arrives as exit code 128 + N; codes above 128 that
    name a fatal signal are reported as that signal (a program that itself exits with such a
    code is read the same way).
    """

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr_tail: bytes
    cpu_time_s: float
    wall_time_s: float
    peak_rss_bytes: int
    time_limit_exceeded: bool = False
    memory_limit_exceeded: bool = False
    output_limit_exceeded: bool = False
    sandboxed: bool = True

    @property
    def ok(self) -> bool:
        """Exited normally with code 0 and within every limit."""
        return (
            self.exit_code == 0
            and not self.time_limit_exceeded
            and not self.memory_limit_exceeded
            and not self.output_limit_exceeded
        )

    def describe(self) -> str:
        """A short human description of how the run ended."""
        if self.output_limit_exceeded:
            return "output limit exceeded"
        if self.time_limit_exceeded:
            return f"time limit exceeded ({self.cpu_time_s:.2f}s CPU, {self.wall_time_s:.2f}s wall)"
        if self.memory_limit_exceeded:
            return "memory limit exceeded"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exit code {self.exit_code}"


# Fatal signals worth naming when bwrap reports 128 + N.
_FATAL_SIGNALS = frozenset(
    int(s)
    for s in (
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGILL,
        signal.SIGTRAP,
        signal.SIGABRT,
        signal.SIGBUS,
        signal.SIGFPE,
        signal.SIGKILL,
        signal.SIGUSR1,
        signal.SIGSEGV,
        signal.SIGUSR2,
        signal.SIGPIPE,
        signal.SIGALRM,
        signal.SIGTERM,
        signal.SIGXCPU,
        signal.SIGXFSZ,
        signal.SIGSYS,
    )
)


def _is_root() -> bool:
    return os.geteuid() == 0


class Sandbox:
    """Runs argv in a fresh bubblewrap sandbox per call.

    The sandbox sees: /usr (read-only; /bin, /lib, /lib64 as links into it), the dynamic
    loader cache, a new /proc and minimal /dev, a size-capped tmpfs at /tmp, and the run's
    work directory at /box (read-only unless `writable`). It has its own user, PID, network,
    IPC, UTS and cgroup namespaces, no environment but `SANDBOX_ENV`, and runs as uid/gid
    65534. When the verifier runs as root, bwrap itself is started as 65534 so that the
    program is unprivileged on the host too and RLIMIT_NPROC applies.

    bwrap:             the bwrap binary (a path or a name on PATH).
    allow_unsandboxed: without a working bwrap, run with rlimits only instead of refusing.
    prlimit:           util-linux prlimit on the host, for unsandboxed runs (inside the
                       sandbox, /usr's is used).
    work_root:         where work directories are made (default: the temp dir); uid 65534
                       must be able to traverse it.
    """

    def __init__(
        self,
        *,
        bwrap: str = "bwrap",
        allow_unsandboxed: bool = False,
        prlimit: str = "prlimit",
        work_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.bwrap = bwrap
        self.allow_unsandboxed = allow_unsandboxed
        self.prlimit = prlimit
        self.work_root = Path(work_root) if work_root is not None else None

    # --- availability ---------------------------------------------------------------------

    def available(self) -> tuple[bool, str]:
        """Whether bwrap works here (a real sandboxed run of `true`, cached), and why not."""
        probe = _probe(self.bwrap)
        return probe.mode is not None, probe.reason

    @property
    def sandboxed(self) -> bool:
        return self.available()[0]

    def check(self) -> str:
        """Raise `SandboxUnavailable` unless runs are allowed; else describe how they run."""
        probe = _probe(self.bwrap)
        reason = probe.reason
        if probe.mode is not None:
            return reason
        if not self.allow_unsandboxed:
            raise SandboxUnavailable(
                f"refusing to run untrusted code without a sandbox: {reason}. Install "
                "bubblewrap (apt-get install bubblewrap) or set "
                "verifiers.allow_unsandboxed=true to run with rlimits only"
            )
        if shutil.which(self.prlimit) is None:
            raise SandboxUnavailable(
                f"{reason}, and unsandboxed runs need {self.prlimit!r} (util-linux) for their "
                "rlimits; install util-linux"
            )
        return f"UNSANDBOXED (rlimits only; {reason})"

    # --- work directories -----------------------------------------------------------------

    @contextmanager
    def workdir(self, *, writable: bool = False) -> Iterator[Path]:
        """A fresh host directory for one run (or one compile), deleted afterwards.

        `writable`: the sandboxed program may write into it (a compile's output)."""
        path = Path(tempfile.mkdtemp(prefix="rlax-sandbox-", dir=self.work_root))
        try:
            os.chmod(path, 0o755)
            if writable:
                if self._drops_privileges():
                    os.chown(path, NOBODY_UID, NOBODY_GID)
                else:
                    os.chmod(path, 0o777)
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # --- running --------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        workdir: str | os.PathLike[str],
        limits: RunLimits,
        stdin: bytes = b"",
        writable: bool = False,
    ) -> RunOutcome:
        """Run argv (relative paths resolve in `workdir`) with `stdin` and `limits`.

        Raises `SandboxUnavailable` when there is no sandbox and unsandboxed runs are not
        allowed. Every process the run started is gone when this returns."""
        probe = _probe(self.bwrap)
        mode = probe.mode
        if mode is None:
            self.check()  # raises unless allowed
        workdir = Path(workdir)
        inner = [*self._prlimit_argv(limits, sandboxed=mode is not None), "--", *argv]
        if mode is not None:
            bwrap = bwrap_argv(probe.path, workdir, writable=writable, tmp_bytes=limits.tmp_bytes)
            cmd, cwd, env = [*bwrap, *inner], "/", {"PATH": SANDBOX_PATH}
        else:
            cmd, cwd, env = inner, str(workdir), dict(SANDBOX_ENV)
        uid = NOBODY_UID if self._drops_privileges() else -1
        report_r, report_w = os.pipe()
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin)
            stdin_file.flush()
            stdin_file.seek(0)
            try:
                # No preexec_fn: forking a multithreaded process is only safe in
                # subprocess's C code. The launcher (a fresh single-threaded interpreter)
                # becomes a child subreaper and starts the command as `uid`; prlimit in the
                # command sets the rlimits.
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-I",
                        "-S",
                        "-c",
                        _LAUNCHER,
                        str(report_w),
                        str(uid),
                        str(NOBODY_GID),
                        *cmd,
                    ],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(report_w,),
                )
            except BaseException:
                os.close(report_r)
                raise
            finally:
                os.close(report_w)
            try:
                return _supervise(proc, limits, report_fd=report_r, sandboxed=mode is not None)
            finally:
                os.close(report_r)

    # --- command lines --------------------------------------------------------------------

    def _drops_privileges(self) -> bool:
        mode = _probe(self.bwrap).mode
        return mode == "nobody" or (mode is None and _is_root())

    def _prlimit_argv(self, limits: RunLimits, *, sandboxed: bool) -> list[str]:
        cpu_soft = max(1, math.ceil(limits.cpu_time_s))
        nproc = limits.max_processes
        if not sandboxed:
            # Without a user namespace RLIMIT_NPROC counts every process of the uid.
            nproc += _count_tasks_of_uid(NOBODY_UID if _is_root() else os.getuid())
        # In the sandbox, found on SANDBOX_PATH (bwrap and prlimit use execvp).
        prlimit = "prlimit" if sandboxed else (shutil.which(self.prlimit) or self.prlimit)
        return [
            prlimit,
            f"--cpu={cpu_soft}:{cpu_soft + 1}",
            f"--as={limits.memory_bytes}",
            f"--nproc={nproc}",
            f"--fsize={limits.file_size_bytes}",
            f"--nofile={limits.open_files}",
            f"--stack={limits.stack_bytes}",
            "--core=0",
        ]


def bwrap_argv(
    bwrap: str,
    workdir: str | os.PathLike[str],
    *,
    writable: bool = False,
    tmp_bytes: int = 64 * 2**20,
) -> list[str]:
    """The bwrap command line (up to and including "--") that isolates one run."""
    argv = [
        bwrap,
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces
        "--unshare-user",
        "--disable-userns",  # no nested user namespaces (kernel attack surface)
        "--uid",
        str(NOBODY_UID),
        "--gid",
        str(NOBODY_GID),
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]
    for name, value in SANDBOX_ENV.items():
        argv += ["--setenv", name, value]
    argv += [
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/sbin",
        "/sbin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        # The loader cache: libraries in multiarch dirs (libstdc++) are found through it.
        "--ro-bind-try",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
        "--ro-bind-try",
        "/etc/alternatives",
        "/etc/alternatives",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(tmp_bytes),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(tmp_bytes),
        "--tmpfs",
        "/tmp",
        "--bind" if writable else "--ro-bind",
        os.fspath(workdir),
        SANDBOX_WORKDIR,
        "--chdir",
        SANDBOX_WORKDIR,
        "--remount-ro",
        "/",
    ]
    argv.append("--")
    return argv


# --- the self-test ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Probe:
    mode: str | None  # "nobody": bwrap started as 65534; "self": as this user; None: broken
    path: str  # the resolved bwrap binary
    reason: str


_probe_lock = threading.Lock()


@functools.cache
def _probe_cached(bwrap: str, root: bool) -> _Probe:
    path = shutil.which(bwrap)
    if path is None:
        return _Probe(None, bwrap, f"bubblewrap ({bwrap!r}) is not installed")
    errors = []
    for mode in ("nobody", "self") if root else ("self",):
        error = _self_test(path, drop=mode == "nobody")
        if error is None:
            if mode == "nobody":
                reason = f"sandboxed by {path} (bwrap started as uid {NOBODY_UID})"
            elif root:
                reason = (
                    f"sandboxed by {path} (started as root: programs run as uid {NOBODY_UID} "
                    "in their namespace, but RLIMIT_NPROC is not enforced for root)"
                )
            else:
                reason = f"sandboxed by {path}"
            return _Probe(mode, path, reason)
        errors.append(f"{mode}: {error}")
    return _Probe(None, path, f"bubblewrap ({path}) fails its self-test: " + "; ".join(errors))


def _probe(bwrap: str) -> _Probe:
    """How bwrap can be used here, from a real sandboxed run (cached per binary)."""
    with _probe_lock:
        return _probe_cached(bwrap, _is_root())


def _self_test(bwrap_path: str, *, drop: bool) -> str | None:
    """None when a sandboxed `prlimit ... true` runs, else the error."""
    with tempfile.TemporaryDirectory(prefix="rlax-sandbox-probe-") as tmp:
        os.chmod(tmp, 0o755)
        cmd = [*bwrap_argv(bwrap_path, tmp), "prlimit", "--nproc=4", "--", "true"]
        kwargs: dict = {}
        if drop:
            kwargs = {"user": NOBODY_UID, "group": NOBODY_GID, "extra_groups": []}
        try:
            done = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd="/",
                env={"PATH": SANDBOX_PATH},
                timeout=20,
                start_new_session=True,
                **kwargs,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return str(e)
        if done.returncode != 0:
            error = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
            return error[-300:]
    return None


def reset_probe_cache() -> None:
    """Forget the cached self-test results (tests; after installing bubblewrap)."""
    with _probe_lock:
        _probe_cached.cache_clear()


def sandbox_available(bwrap: str = "bwrap") -> tuple[bool, str]:
    """Whether `bwrap` can sandbox programs here (self-test, cached), and a reason."""
    probe = _probe(bwrap)
    return probe.mode is not None, probe.reason


# --- supervision ------------------------------------------------------------------------


def _count_tasks_of_uid(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                count += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            continue
    return count


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# Runs between the verifier and the command (argv: report fd, uid, gid, command...). It
# stays with the verifier's uid, out of the program's reach, and starts the command as
# `uid` (when >= 0). As a child subreaper it inherits every orphan of the run (bwrap's PID-1
# included: bwrap exits without reaping it), kills them once the command has exited, and
# reaps everything, so its RUSAGE_CHILDREN is the whole run's CPU time and peak RSS and
# nothing of the run is left when it exits. SIGTERM = kill the run now. It reports one JSON
# line per event on the report fd: {"error"} if the command could not start, then
# {"status", "cpu_s", "maxrss_kb"}. Being single-threaded, it may fork.
_LAUNCHER = """
import ctypes, json, os, resource, signal, sys
fd, uid, gid, argv = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
os.set_inheritable(fd, False)
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
done = False
def kill_children():
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids = f.read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                os.kill(int(kid), signal.SIGKILL)
            except OSError:
                pass
def tree_cpu_s(root):
    # CPU seconds of a live process tree: a killed PID namespace's processes are reaped
    # without their times reaching anyone's RUSAGE_CHILDREN, so sample before killing.
    ticks, todo = 0, [root]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                ticks += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15])
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")
sampled_cpu_s = 0.0
def on_term(signum, frame):
    global done, sampled_cpu_s
    if not done:
        sampled_cpu_s = tree_cpu_s(pid)
    done = True
    kill_children()
pid = 0
signal.signal(signal.SIGTERM, on_term)
pid = os.fork()
if pid == 0:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if uid >= 0:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        os.execv(argv[0], argv)
    except BaseException as e:
        os.write(fd, (json.dumps({"error": f"cannot start {argv[0]}: {e}"}) + "\\n").encode())
    os._exit(127)
status = None
while True:
    try:
        child, st = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if child == pid:
        status, done = st, True
    if done:
        kill_children()
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
report = {"status": status, "cpu_s": max(ru.ru_utime + ru.ru_stime, sampled_cpu_s),
          "maxrss_kb": ru.ru_maxrss}
os.write(fd, (json.dumps(report) + "\\n").encode())
os._exit(0)
"""


def _supervise(
    proc: subprocess.Popen, limits: RunLimits, *, report_fd: int, sandboxed: bool
) -> RunOutcome:
    """Pump the pipes, enforce the wall clock and the output cap, reap, and classify."""
    start = time.monotonic()
    deadline = start + limits.wall_s
    stdout = bytearray()
    stderr_tail = bytearray()
    report = bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    sel.register(report_fd, selectors.EVENT_READ, "report")
    open_streams = {"out", "err", "report"}
    timed_out = output_exceeded = stopping = False
    try:
        # The run is over when the launcher closed the report fd (it has reaped everything)
        # and the program's pipes are drained.
        while open_streams:
            now = time.monotonic()
            if now >= deadline:
                if stopping:
                    break  # the launcher did not finish in time: SIGKILL below
                timed_out = not output_exceeded
                stopping = True
                _stop(proc)
                deadline = now + _DRAIN_S
                continue
            for key, _ in sel.select(deadline - now):
                data = os.read(key.fd, _READ_CHUNK)
                if not data:
                    sel.unregister(key.fileobj)
                    open_streams.discard(key.data)
                elif key.data == "out":
                    room = limits.output_bytes - len(stdout)
                    stdout += data[: max(room, 0)]
                    if len(data) > room and not stopping:
                        output_exceeded = stopping = True
                        _stop(proc)
                        deadline = time.monotonic() + _DRAIN_S
                elif key.data == "err":
                    stderr_tail += data
                    del stderr_tail[:-_STDERR_TAIL_BYTES]
                else:
                    report += data
    finally:
        sel.close()
        _kill_group(proc.pid)  # a no-op unless the launcher is stuck
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    wall = time.monotonic() - start
    info: dict = {}
    for line in bytes(report).decode(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if "error" in event:
            raise SandboxUnavailable(event["error"])
        info = event
    status = info.get("status")
    cpu = float(info.get("cpu_s", 0.0))
    peak_rss = int(info.get("maxrss_kb", 0)) * 1024
    exit_code: int | None
    sig: int | None = None
    if status is None:  # killed before the command finished
        exit_code, sig = None, signal.SIGKILL
    elif os.WIFSIGNALED(status):
        exit_code, sig = None, os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
        if exit_code > 128 and (exit_code - 128) in _FATAL_SIGNALS:
            exit_code, sig = None, exit_code - 128
    stderr_bytes = bytes(stderr_tail)
    cpu_soft = max(1, math.ceil(limits.cpu_time_s))
    time_exceeded = not output_exceeded and (
        timed_out
        or cpu > limits.cpu_time_s
        or sig == signal.SIGXCPU
        or (sig == signal.SIGKILL and not stopping and cpu >= cpu_soft - 0.05)
    )
    memory_exceeded = (
        exit_code != 0
        and not time_exceeded
        and not output_exceeded
        and (
            any(m in stderr_bytes for m in _OUT_OF_MEMORY_MARKERS)
            or (
                sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGKILL, signal.SIGABRT)
                and peak_rss >= limits.memory_bytes // 2
            )
        )
    )
    return RunOutcome(
        exit_code=exit_code,
        signal=sig,
        stdout=bytes(stdout),
        stderr_tail=stderr_bytes,
        cpu_time_s=cpu,
        wall_time_s=wall,
        peak_rss_bytes=peak_rss,
        time_limit_exceeded=time_exceeded,
        memory_limit_exceeded=memory_exceeded,
        output_limit_exceeded=output_exceeded,
        sandboxed=sandboxed,
    )


def _stop(proc: subprocess.Popen) -> None:
    """Ask the launcher to kill the run (it then reaps it and reports)."""
    try:
        proc.send_signal(signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
