"""Run one untrusted program with limits, inside a bubblewrap sandbox (DESIGN §7).

The code verifier compiles and runs model-written programs and the problems' checkers
through `Sandbox.run`; docs/verifiers.md describes exactly what the sandbox isolates.
Every run, and the self-test that decides how runs are made, goes through one launcher
process (sandbox_launcher.py): the verifier never forks a child that switches uid. A
verifier running as root runs bwrap as uid 65534 or not at all: without a working bwrap
(or one that cannot start as 65534) it refuses to run anything unless told
`allow_unsandboxed`. Each run also gets its own cgroup (cgroups.py) where the host allows,
and starts under a seccomp filter (seccomp.py) that denies calls reaching other processes.
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

from rlax_tpu.verifiers import cgroups, seccomp

# Inside the sandbox the run's work directory is mounted here and is the cwd.
SANDBOX_WORKDIR = "/box"
# The only environment a sandboxed program sees (bwrap --clearenv, then these).
SANDBOX_PATH = "/usr/bin:/bin:/usr/local/bin"
SANDBOX_ENV = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "HOME": SANDBOX_WORKDIR, "TMPDIR": "/tmp"}
# The unprivileged identity programs run as (nobody:nogroup on Debian).
NOBODY_UID = 65534
NOBODY_GID = 65534

# A run's cgroup holds bwrap and the PID namespace's init besides the program's processes,
# and their memory (and the loader's) besides the program's.
_SANDBOX_TASKS = 2
_SANDBOX_MEMORY_BYTES = 64 * 2**20
# The launcher between the verifier and each run (a file of this package, run by path).
LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
# The sandbox's PID 1 (sandbox_init.py), run by the sandbox's python3 from its source.
_INIT_ARGV = ["python3", "-I", "-S", "-c", Path(__file__).with_name("sandbox_init.py").read_text()]

_STDERR_TAIL_BYTES = 8192
# Work directories are named rlax-sandbox-<pid of the process that made it>-<random>. One
# whose process is gone (SIGKILLed: its cleanup never ran) and that is older than any run
# (so not another PID namespace's live one, on a shared temp dir) is removed by the next
# process that makes one there.
_WORKDIR_PREFIX = "rlax-sandbox-"
_ORPHAN_AGE_S = 3600.0
_swept: set[str] = set()
_swept_lock = threading.Lock()
_READ_CHUNK = 65536
# After the program exits (or is killed), how long to wait for its pipes and pid namespace
# to drain before giving up on them.
_DRAIN_S = 2.0
# The launcher kills the run itself this long after the wall clock, should the verifier not
# (it is gone, or stuck).
_LAUNCHER_GRACE_S = 1.0

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
    output cap, which the parent enforces; where per-run cgroups are available, the run's
    cgroup also caps its tasks, its memory (no swap) and its CPU bandwidth (`cgroup_limits`).

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
    cpu_cores:        CPU bandwidth of the whole run, in cores (cgroup cpu.max).
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
    cpu_cores: float = 1.0

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "memory_bytes", "output_bytes", "max_processes", "cpu_cores"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RunLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.wall_time_s is not None and self.wall_time_s <= 0:
            raise ValueError(f"RunLimits.wall_time_s must be > 0, got {self.wall_time_s}")

    @property
    def wall_s(self) -> float:
        return self.wall_time_s if self.wall_time_s is not None else 2 * self.cpu_time_s + 1

    def cgroup_limits(self) -> cgroups.CgroupLimits:
        """The run's cgroup: its tasks (the program's `max_processes`, plus bwrap and the
        namespace's init), its memory (the program's, both tmpfs, and headroom for bwrap and
        the loader), and its CPU bandwidth."""
        return cgroups.CgroupLimits(
            pids=self.max_processes + _SANDBOX_TASKS,
            memory_bytes=self.memory_bytes + 2 * self.tmp_bytes + _SANDBOX_MEMORY_BYTES,
            cpu_cores=self.cpu_cores,
        )


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
    stderr_tail: bytes  # the last bytes it wrote to stderr (8 KiB at most)
    cpu_time_s: float
    wall_time_s: float
    peak_rss_bytes: int
    time_limit_exceeded: bool = False
    memory_limit_exceeded: bool = False
    output_limit_exceeded: bool = False
    sandboxed: bool = True
    uid: int = -1  # the host uid the program ran as (-1: this process's own)
    cgroup: bool = False  # the run had its own cgroup
    peak_processes: int | None = None  # most tasks of the run at once (cgroup pids.peak)
    oom_kills: int = 0  # processes of the run the kernel killed for its cgroup's memory
    stderr_bytes: int = 0  # all it wrote to stderr (stderr_tail is shorter when more)

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


def remove_orphaned_workdirs(root: str, *, min_age_s: float = _ORPHAN_AGE_S) -> list[str]:
    """Remove the work directories under `root` left by a process that is gone (a verifier
    SIGKILLed mid-run never ran its cleanup) and untouched for `min_age_s`; returns their
    paths. A directory of a live process, a young one, or one not named by this module is
    left alone."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        rest = entry.name[len(_WORKDIR_PREFIX) :] if entry.name.startswith(_WORKDIR_PREFIX) else ""
        pid_text, _, _ = rest.partition("-")
        if not pid_text.isdigit() or _process_exists(int(pid_text)):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or now - entry.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _is_root() -> bool:
    return os.geteuid() == 0


class Sandbox:
    """Runs argv in a fresh bubblewrap sandbox per call.

    The sandbox sees: /usr (read-only; /bin, /lib, /lib64 as links into it), the dynamic
    loader cache, a new /proc and minimal /dev, a size-capped tmpfs at /tmp, and the run's
    work directory at /box (read-only unless `writable`). It has its own user, PID, network,
    IPC, UTS and cgroup namespaces, no environment but `SANDBOX_ENV`, runs as uid/gid
    65534, and under the seccomp filter of seccomp.py (no ptrace, pidfd_getfd,
    process_vm_readv, namespaces, bpf, ...). When the verifier runs as root, bwrap itself is
    started as 65534 (by the launcher), so that the program is unprivileged on the host too
    and RLIMIT_NPROC applies; if that does not work the sandbox is unavailable (never root).

    bwrap:             the bwrap binary (a path or a name on PATH).
    allow_unsandboxed: without a working bwrap, run with rlimits only instead of refusing.
    prlimit:           util-linux prlimit on the host, for unsandboxed runs (inside the
                       sandbox, /usr's is used).
    work_root:         where work directories are made (default: the temp dir); uid 65534
                       must be able to traverse it.
    cgroup:            per-run cgroups: "auto" (where this process may manage them), "off",
                       or a cgroup v2 directory to create runs under (cgroups.detect).
    """

    def __init__(
        self,
        *,
        bwrap: str = "bwrap",
        allow_unsandboxed: bool = False,
        prlimit: str = "prlimit",
        work_root: str | os.PathLike[str] | None = None,
        cgroup: str = "auto",
    ) -> None:
        self.bwrap = bwrap
        self.allow_unsandboxed = allow_unsandboxed
        self.prlimit = prlimit
        self.work_root = Path(work_root) if work_root is not None else None
        self.cgroup = cgroup

    # --- availability ---------------------------------------------------------------------

    def _probe(self) -> _Probe:
        return _probe(self.bwrap, self.cgroup)

    def available(self) -> tuple[bool, str]:
        """Whether bwrap works here (a real sandboxed run of `true`, cached), and why not."""
        probe = self._probe()
        return probe.mode is not None, probe.reason

    @property
    def sandboxed(self) -> bool:
        return self.available()[0]

    def check(self) -> str:
        """Raise `SandboxUnavailable` unless runs are allowed; else describe how they run."""
        probe = self._probe()
        reason = probe.reason
        if probe.mode is not None:
            return reason
        if not self.allow_unsandboxed:
            raise SandboxUnavailable(
                f"refusing to run untrusted code without a sandbox: {reason}. Install "
                "bubblewrap (apt-get install bubblewrap), make it runnable by uid "
                f"{NOBODY_UID}, or set verifiers.allow_unsandboxed=true to run with rlimits only"
            )
        if shutil.which(self.prlimit) is None:
            raise SandboxUnavailable(
                f"{reason}, and unsandboxed runs need {self.prlimit!r} (util-linux) for their "
                "rlimits; install util-linux"
            )
        return f"UNSANDBOXED (rlimits only; {reason})"

    def identity(self) -> dict[str, str]:
        """How runs are made here, for the service's startup log and metrics: "sandbox"
        (bwrap, unsandboxed or refused), "uid" (the host uid programs run as), "cgroup" (the
        per-run cgroups, or why there are none) and "reason"."""
        probe = self._probe()
        if probe.mode is not None:
            how = "bwrap"
        else:
            how = "unsandboxed" if self.allow_unsandboxed else "refused"
        uid = NOBODY_UID if self._drops_privileges() else os.getuid()
        return {
            "sandbox": how,
            "uid": str(uid),
            "cgroup": probe.cgroups.description if probe.cgroups else f"none: {probe.no_cgroups}",
            "reason": probe.reason,
        }

    # --- work directories -----------------------------------------------------------------

    @contextmanager
    def workdir(self, *, writable: bool = False) -> Iterator[Path]:
        """A fresh host directory for one run (or one compile), deleted afterwards.

        `writable`: the sandboxed program may write into it (a compile's output)."""
        root = str(self.work_root) if self.work_root is not None else tempfile.gettempdir()
        with _swept_lock:
            first = root not in _swept
            _swept.add(root)
        if first:
            remove_orphaned_workdirs(root)
        path = Path(tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-", dir=root))
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
        as_pid_1: bool = False,
    ) -> RunOutcome:
        """Run argv (relative paths resolve in `workdir`) with `stdin` and `limits`.

        The sandbox's PID 1 is sandbox_init.py, which no process of the sandbox can read;
        `as_pid_1`: the program is PID 1 itself, for a trusted program that protects itself
        the same way (the function harness), so that no other process ever holds its stdin.

        Raises `SandboxUnavailable` when there is no sandbox and unsandboxed runs are not
        allowed. Every process the run started is gone when this returns."""
        probe = self._probe()
        mode = probe.mode
        if mode is None:
            self.check()  # raises unless allowed
        workdir = Path(workdir)
        inner = [*self._prlimit_argv(limits, sandboxed=mode is not None), "--", *argv]
        if mode is not None and not as_pid_1:
            inner = [*_INIT_ARGV, *inner]
        uid = NOBODY_UID if self._drops_privileges() else -1
        with _seccomp_filter(required=mode is not None) as filter_fd:
            if mode is not None:
                bwrap = bwrap_argv(
                    probe.path,
                    workdir,
                    writable=writable,
                    tmp_bytes=limits.tmp_bytes,
                    seccomp_fd=filter_fd,
                )
                cmd, cwd, env = [*bwrap, *inner], "/", {"PATH": SANDBOX_PATH}
            else:
                cmd, cwd, env = inner, str(workdir), dict(SANDBOX_ENV)
            return _launch(
                cmd,
                cwd=cwd,
                env=env,
                uid=uid,
                limits=limits,
                stdin=stdin,
                sandboxed=mode is not None,
                cgroups=probe.cgroups,
                seccomp_fd=filter_fd,
            )

    # --- command lines --------------------------------------------------------------------

    def _drops_privileges(self) -> bool:
        mode = self._probe().mode
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
    seccomp_fd: int | None = None,
) -> list[str]:
    """The bwrap command line (up to and including "--") that isolates one run. The command
    is the sandbox's PID 1 (bwrap's own init would be readable by the program).

    seccomp_fd: a descriptor bwrap reads the seccomp filter from (to its end, once)."""
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
        "--as-pid-1",
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
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv.append("--")
    return argv


@contextmanager
def _seccomp_filter(*, required: bool) -> Iterator[int | None]:
    """The read end of a pipe holding the seccomp filter, for one run: bwrap (or, without
    bwrap, the launcher) reads it to its end. None when there is no filter for this machine
    and none is `required` (an unsandboxed run: rlimits only); SandboxUnavailable when one
    is."""
    try:
        program = seccomp.program()
    except seccomp.SeccompUnavailable as e:
        if required:
            raise SandboxUnavailable(str(e)) from None
        yield None
        return
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, program)  # ~1 KiB: far below a pipe's capacity
    finally:
        os.close(write_fd)
    try:
        yield read_fd
    finally:
        os.close(read_fd)


# --- the self-test ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Probe:
    mode: str | None  # "nobody": bwrap started as 65534; "self": as this (non-root) user
    path: str  # the resolved bwrap binary
    reason: str
    cgroups: cgroups.Cgroups | None = None  # per-run cgroups, when usable
    no_cgroups: str = ""  # why there are none


_probe_lock = threading.Lock()
_SELF_TEST_LIMITS = RunLimits(cpu_time_s=5.0, wall_time_s=20.0, max_processes=4)
# A line of /proc/self/status under a seccomp filter (mode 2 = SECCOMP_MODE_FILTER).
_SECCOMP_IN_FORCE = "^Seccomp:[[:space:]]*2$"


@functools.cache
def _probe_cached(bwrap: str, root: bool, cgroup: str) -> _Probe:
    try:
        found: cgroups.Cgroups | None = cgroups.detect(cgroup)
        no_cgroups = ""
    except cgroups.CgroupUnavailable as e:
        found, no_cgroups = None, str(e)
    path = shutil.which(bwrap)
    if path is None:
        return _Probe(None, bwrap, f"bubblewrap ({bwrap!r}) is not installed", found, no_cgroups)
    # As root, only bwrap started as 65534 will do: started as root, the programs would be
    # root on the host, where RLIMIT_NPROC does not apply (a fork bomb takes the host).
    mode = "nobody" if root else "self"
    if found is not None:
        error = _self_test(path, mode=mode, cgroups_=found)
        if error is not None:  # the sandbox may work without the cgroup: try that, say why
            found, no_cgroups = None, f"a sandboxed run cannot join its cgroup: {error}"
    error = _self_test(path, mode=mode, cgroups_=found)
    if error is not None:
        who = f"as uid {NOBODY_UID}" if root else "as this user"
        return _Probe(
            None,
            path,
            f"bubblewrap ({path}) fails its self-test {who}: {error}",
            found,
            no_cgroups,
        )
    if root:
        reason = f"sandboxed by {path} (bwrap started as uid {NOBODY_UID})"
    else:
        reason = f"sandboxed by {path} (as uid {os.getuid()})"
    return _Probe(mode, path, reason, found, no_cgroups)


def _probe(bwrap: str, cgroup: str = "auto") -> _Probe:
    """How bwrap can be used here, from a real sandboxed run (cached per binary)."""
    with _probe_lock:
        return _probe_cached(bwrap, _is_root(), cgroup)


def _self_test(bwrap_path: str, *, mode: str, cgroups_: cgroups.Cgroups | None) -> str | None:
    """None when a sandboxed program runs the way runs will (through the launcher, as 65534
    when `mode` is "nobody", in a cgroup when given, under the seccomp filter, which it
    checks is in force), else the error."""
    with tempfile.TemporaryDirectory(prefix="rlax-sandbox-probe-") as tmp:
        os.chmod(tmp, 0o755)
        try:
            with _seccomp_filter(required=True) as filter_fd:
                cmd = [
                    *bwrap_argv(bwrap_path, tmp, seccomp_fd=filter_fd),
                    *_INIT_ARGV,
                    *("prlimit", "--nproc=4", "--"),
                    *("grep", "-q", _SECCOMP_IN_FORCE, "/proc/self/status"),
                ]
                outcome = _launch(
                    cmd,
                    cwd="/",
                    env={"PATH": SANDBOX_PATH},
                    uid=NOBODY_UID if mode == "nobody" else -1,
                    limits=_SELF_TEST_LIMITS,
                    stdin=b"",
                    sandboxed=True,
                    cgroups=cgroups_,
                    seccomp_fd=filter_fd,
                )
        except (OSError, SandboxUnavailable) as e:
            return str(e)
        if outcome.exit_code == 1:
            return "the program runs without the seccomp filter (bwrap ignored --seccomp)"
        if not outcome.ok:
            detail = outcome.stderr_tail.decode(errors="replace").strip()
            if "python3" in detail:  # bwrap could not execute the init
                detail += (
                    "; the sandbox's PID 1 (sandbox_init.py) and the function harness run on "
                    "a python3 under /usr: install one (apt-get install python3)"
                )
            return (detail or outcome.describe())[-300:]
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


def _launch(
    cmd: Sequence[str],
    *,
    cwd: str,
    env: dict[str, str],
    uid: int,
    limits: RunLimits,
    stdin: bytes,
    sandboxed: bool,
    cgroups: cgroups.Cgroups | None,
    seccomp_fd: int | None,
) -> RunOutcome:
    """Run `cmd` through the launcher (sandbox_launcher.py): as `uid` when >= 0, in a fresh
    cgroup leaf when `cgroups` is given, `stdin` readable (only) on its stdin, with the
    seccomp filter on `seccomp_fd` passed to bwrap (`cmd` names it when `sandboxed`) or
    installed by the launcher; supervise it and remove the leaf. Every process of the run is
    gone when this returns; should this process die first, the launcher ends the run."""
    leaf = cgroups.create(limits.cgroup_limits()) if cgroups is not None else None
    procs = ":".join(leaf.procs_files) if leaf is not None else "-"
    report_r, report_w = os.pipe()
    try:
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin)
            stdin_file.flush()
            # The program gets a read-only descriptor of the file: it cannot write into the
            # verifier's temporary file (reopened through /proc, not shared with the writer).
            with open(f"/proc/self/fd/{stdin_file.fileno()}", "rb") as readonly:
                try:
                    # No preexec_fn, user= or group=: those make subprocess fork (not vfork)
                    # this multithreaded process; the launcher switches uid itself.
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-I",
                            "-S",
                            str(LAUNCHER),
                            str(report_w),
                            str(uid),
                            str(NOBODY_GID),
                            procs,
                            str(os.getpid()),
                            f"{limits.wall_s + _DRAIN_S + _LAUNCHER_GRACE_S:.3f}",
                            "-" if sandboxed or seccomp_fd is None else str(seccomp_fd),
                            *cmd,
                        ],
                        stdin=readonly,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=cwd,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(report_w,) if seccomp_fd is None else (report_w, seccomp_fd),
                    )
                finally:
                    os.close(report_w)
        outcome = _supervise(proc, limits, report_fd=report_r, sandboxed=sandboxed)
    finally:
        os.close(report_r)
        stats = leaf.stats() if leaf is not None else None
        if leaf is not None:
            leaf.close()
    if stats is None:
        return dataclasses.replace(outcome, uid=uid)
    # An OOM kill in the run's cgroup is what ended a run that failed, even when a process
    # left waiting for the killed one then ran into the wall clock.
    oom = stats.oom_kills > 0 and not outcome.ok and not outcome.output_limit_exceeded
    return dataclasses.replace(
        outcome,
        uid=uid,
        cgroup=True,
        peak_processes=stats.peak_pids,
        oom_kills=stats.oom_kills,
        memory_limit_exceeded=outcome.memory_limit_exceeded or oom,
        time_limit_exceeded=outcome.time_limit_exceeded and not oom,
    )


def _supervise(
    proc: subprocess.Popen, limits: RunLimits, *, report_fd: int, sandboxed: bool
) -> RunOutcome:
    """Pump the pipes, enforce the wall clock and the output cap, reap, and classify."""
    start = time.monotonic()
    deadline = start + limits.wall_s
    stdout = bytearray()
    stderr_tail = bytearray()
    stderr_written = 0
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
                    stderr_written += len(data)
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
        stderr_bytes=stderr_written,
    )


def _stop(proc: subprocess.Popen) -> None:
    """Ask the launcher to kill the run (it then reaps it and reports)."""
    try:
        proc.send_signal(signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
