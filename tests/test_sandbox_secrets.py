"""The tests stay secret: candidate programs that try every route we know to a problem's
tests and to the harness's report — other processes' descriptors (pidfd_getfd), memory
(ptrace, process_vm_readv, /proc/PID/mem), /proc files, inherited descriptors, files, shared
memory, sockets, signals, the kernel's namespace and tracing calls, the harness's timing —
each fails, and the problem is judged wrong.

The function problem's expected value is a random 18-digit number made for this module: a
candidate can return it only by reading the test. Every route program searches what it
reaches for `== <digits>`; finding it, it returns the number (and the problem is accepted:
the test fails); else it raises "contained: N attempts; reached: ..." listing every access
to another process that worked (any is a failure, secret or not). The reason must carry that
message, so the harness survived to judge. Run against a real sandbox; the counts are in
docs/verifiers.md.
"""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path

import pytest

from rlax_tpu.api.verifier import Verdict
from rlax_tpu.verifiers.code import CodeVerifier
from rlax_tpu.verifiers.function_problems import write_humaneval_problem
from rlax_tpu.verifiers.problems import write_problem
from rlax_tpu.verifiers.sandbox import RunLimits

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)

SECRET = 10**17 + secrets.randbelow(9 * 10**17)

# What every route program starts with: the search, the tally, system calls by number.
PRELUDE = r'''
import ctypes, errno, os, platform, re, signal, socket, struct, time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {
    "x86_64": dict(ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312,
                   pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424, unshare=272,
                   setns=308, mount=165, bpf=321, perf_event_open=298, userfaultfd=323,
                   keyctl=250, add_key=248, io_uring_setup=425, open_by_handle_at=304,
                   clone=56, clone3=435, shmget=29, shmat=30, msgget=68),
    "aarch64": dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272,
                    pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424, unshare=97,
                    setns=268, mount=40, bpf=280, perf_event_open=241, userfaultfd=282,
                    keyctl=219, add_key=217, io_uring_setup=425, open_by_handle_at=265,
                    clone=220, clone3=435, shmget=194, shmat=196, msgget=186),
}[platform.machine()]
PATTERN = re.compile(rb"== *([0-9]{12,})")
attempts = 0
reached = []


def look(data):
    """The secret, if `data` holds the test's comparison."""
    match = PATTERN.search(data or b"")
    return int(match.group(1)) if match else None


def call(name, *args):
    """A system call by name: (result, errno)."""
    global attempts
    attempts += 1
    result = libc.syscall(NR[name], *[ctypes.c_long(a) for a in args])
    return result, ctypes.get_errno()


def others():
    """Every process this one can see but itself, PID 1 first."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return sorted(p for p in pids if p != os.getpid())


def read_fd(fd):
    """What a descriptor holds, without blocking: from its start, else from where it is."""
    try:
        os.set_blocking(fd, False)
    except OSError:
        pass
    for how in (lambda: os.pread(fd, 1 << 20, 0), lambda: os.read(fd, 1 << 20)):
        try:
            return how()
        except OSError:
            continue
    return b""


def read_path(path, limit=1 << 22):
    global attempts
    attempts += 1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def regions(pid):
    """Readable address ranges of `pid` from its maps (this process's as a guess)."""
    text = read_path(f"/proc/{pid}/maps") or read_path("/proc/self/maps") or b""
    out = []
    for line in text.decode(errors="replace").splitlines():
        span, perms = line.split()[:2]
        if perms.startswith("r"):
            start, end = (int(x, 16) for x in span.split("-"))
            out.append((start, min(end, start + (8 << 20))))
    return out


def read_mem(pid):
    """Read `pid`'s memory through /proc/PID/mem, region by region."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    found = None
    try:
        for start, end in regions(pid):
            try:
                data = os.pread(fd, end - start, start)
            except OSError:
                continue
            if data and f"memory of {pid}" not in reached:
                reached.append(f"memory of {pid}")
            found = found or look(data)
    finally:
        os.close(fd)
    return found
'''

# The function problem's entry point: run the route once, answer with what it found.
FUNCTION_TAIL = r"""
_answer = []


def secret(x):
    if not _answer:
        _answer.append(route())
    if _answer[0] is not None:
        return _answer[0]
    account = ", ".join(reached) or "nothing"
    raise RuntimeError(f"contained: {attempts} attempts; reached: {account}")
"""

ROUTES = {
    "pidfd_getfd": r'''
def route():
    """Every descriptor of every process we can see, through a pidfd (pidfd_getfd needs
    only ptrace access, which the same uid had) or a /proc/PID directory descriptor."""
    for pid in others():
        handles = [call("pidfd_open", pid, 0)[0]]
        try:
            handles.append(os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY))
        except OSError:
            pass
        for handle in (h for h in handles if h >= 0):
            for fd in range(64):
                got, _ = call("pidfd_getfd", handle, fd, 0)
                if got >= 0:
                    reached.append(f"fd {fd} of {pid}")
                    found = look(read_fd(got))
                    if found:
                        return found
    return None
''',
    "ptrace": r'''
def route():
    """Attach (PTRACE_ATTACH, PTRACE_SEIZE) to every process, then read its memory."""
    for pid in others():
        for request in (16, 0x4206):  # PTRACE_ATTACH, PTRACE_SEIZE
            result, _ = call("ptrace", request, pid, 0, 0)
            if result == 0:
                reached.append(f"ptrace of {pid}")
                if request == 16:
                    try:
                        os.waitpid(pid, 0x40000000)  # __WALL: the attach stop
                    except OSError:
                        pass
                found = read_mem(pid)
                call("ptrace", 17, pid, 0, 0)  # PTRACE_DETACH
                if found:
                    return found
    return None
''',
    "process_vm_readv": r'''
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("size", ctypes.c_size_t)]


def route():
    """Another process's memory without attaching: process_vm_readv over its address
    ranges (or this process's ranges, as guesses, where its maps are unreadable)."""
    for pid in others():
        for start, end in regions(pid)[:400]:
            size = min(end - start, 1 << 20)
            buffer = ctypes.create_string_buffer(size)
            local = Iovec(ctypes.addressof(buffer), size)
            remote = Iovec(start, size)
            n, err = call("process_vm_readv", pid, ctypes.addressof(local), 1,
                          ctypes.addressof(remote), 1, 0)
            if n > 0:
                if f"memory of {pid}" not in reached:
                    reached.append(f"memory of {pid}")
                found = look(buffer.raw[:n])
                if found:
                    return found
            elif err == errno.EPERM:
                break
    return None
''',
    "proc_files": r'''
FILES = ("cmdline", "environ", "maps", "smaps", "stack", "syscall", "auxv", "status", "stat",
         "io", "wchan", "schedstat", "sched", "limits", "mountinfo", "cgroup", "personality",
         "attr/current", "timerslack_ns", "comm", "loginuid", "numa_maps", "pagemap")


def route():
    """/proc of every process and thread: its files, its mem, its fd and fdinfo entries,
    its cwd and root."""
    for pid in others():
        tasks = [f"/proc/{pid}"]
        try:
            tasks += [f"/proc/{pid}/task/{t}" for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            pass
        for base in tasks:
            for name in FILES:
                found = look(read_path(f"{base}/{name}"))
                if found:
                    return found
            found = read_mem(pid)
            if found:
                return found
            for directory in ("fd", "fdinfo", "cwd", "root", "map_files"):
                try:
                    entries = os.listdir(f"{base}/{directory}")
                except OSError:
                    continue
                for entry in entries:
                    data = read_path(f"{base}/{directory}/{entry}")
                    if data is not None and directory in ("fd", "map_files"):
                        reached.append(f"{directory}/{entry} of {pid}")
                    found = look(data)
                    if found:
                        return found
    return None
''',
    "own_descriptors": r'''
def route():
    """Every descriptor this process holds or could have inherited (0-1023), by number and
    through /proc/self/fd, /proc/self/fdinfo and /dev/fd."""
    for fd in range(1024):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found = look(read_fd(fd))
        if found:
            return found
    for directory in ("/proc/self/fd", "/proc/self/fdinfo", "/dev/fd"):
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for entry in entries:
            found = look(read_path(f"{directory}/{entry}"))
            if found:
                return found
    return None
''',
    "files": r'''
def route():
    """Every readable file outside /usr, /proc and /sys: the work directory, /tmp, /dev/shm,
    the harness's own cwd and root."""
    skip = {"/usr", "/proc", "/sys"}
    for top in ("/", "/proc/1/cwd", "/proc/1/root/box", "/proc/1/root/tmp"):
        for root, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
            for name in names:
                found = look(read_path(os.path.join(root, name)))
                if found:
                    return found
    return None
''',
    "shared_memory": r'''
def route():
    """System V shared memory and message queues (every id listed, every small id and key
    tried), and POSIX shared memory and queues."""
    ids = set(range(64))
    for table in ("shm", "msg"):
        text = read_path(f"/proc/sysvipc/{table}") or b""
        for line in text.decode(errors="replace").splitlines()[1:]:
            ids.add(int(line.split()[1]))
    for shmid in sorted(ids):
        address, _ = call("shmat", shmid, 0, 0o10000)  # SHM_RDONLY
        if address not in (-1, 0):
            reached.append(f"shm {shmid}")
            found = look(ctypes.string_at(address, 4096))
            if found:
                return found
    for key in range(1, 64):
        for name in ("shmget", "msgget"):
            result, _ = call(name, key, 0, 0) if name == "shmget" else call(name, key, 0)
            if result >= 0:
                reached.append(f"{name} key {key}")
    for directory in ("/dev/shm", "/dev/mqueue"):
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for entry in entries:
            found = look(read_path(f"{directory}/{entry}"))
            if found:
                return found
    return None
''',
    "sockets": r'''
def route():
    """Every Unix socket the kernel lists (abstract names included) and a few guessed
    abstract names, both socket types; every listening TCP port."""
    names = {"\0rlax", "\0harness", "\0sandbox", "\0bwrap"}
    text = read_path("/proc/net/unix") or b""
    for line in text.decode(errors="replace").splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8:
            names.add(parts[7].replace("@", "\0", 1))
    for name in sorted(names):
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            global attempts
            attempts += 1
            s = socket.socket(socket.AF_UNIX, kind)
            s.settimeout(0.2)
            try:
                s.connect(name)
                reached.append(f"unix socket {name!r}")
                found = look(s.recv(1 << 16))
                if found:
                    return found
            except OSError:
                pass
            finally:
                s.close()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = read_path(table) or b""
        for line in text.decode(errors="replace").splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # listening
                port = int(local.rsplit(":", 1)[1], 16)
                attempts += 1
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                        reached.append(f"tcp port {port}")
                        found = look(s.recv(1 << 16))
                        if found:
                            return found
                except OSError:
                    pass
    return None
''',
    "signals": r'''
def route():
    """Every signal to every other process (the harness first), by kill and by pidfd: a
    harness that stops, dies or raises in the test's code would not judge this run."""
    global attempts
    for pid in others():
        pidfd, _ = call("pidfd_open", pid, 0)
        for sig in range(1, 32):
            if sig in (signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG):
                continue
            attempts += 1
            try:
                os.kill(pid, sig)
            except OSError:
                pass
            if pidfd >= 0:
                call("pidfd_send_signal", pidfd, sig, 0, 0)
    time.sleep(0.2)
    return None
''',
    "kernel_calls": r'''
def route():
    """The calls that reach new namespaces, other processes or the kernel's larger attack
    surfaces: each should be refused."""
    probes = [
        ("unshare", (0x10000000,)), ("unshare", (0x00020000,)), ("unshare", (0x20000000,)),
        ("setns", (0, 0)), ("mount", (0, 0, 0, 0, 0)), ("bpf", (0, 0, 0)),
        ("perf_event_open", (0, 0, -1, -1, 0)), ("userfaultfd", (0,)), ("keyctl", (0, 0)),
        ("add_key", (0, 0, 0, 0, 0)), ("io_uring_setup", (1, 0)),
        ("open_by_handle_at", (-100, 0, 0)), ("kcmp", (1, os.getpid(), 0, 0, 0)),
        ("process_vm_writev", (1, 0, 0, 0, 0, 0)), ("clone3", (0, 0)),
    ]
    for name, args in probes:
        result, err = call(name, *args)
        # EFAULT/EINVAL/EBADF: the kernel ran the call and refused its arguments.
        if result >= 0 or err not in (errno.EPERM, errno.ENOSYS, errno.EACCES):
            reached.append(f"{name} ({errno.errorcode.get(err, err)})")
    for flags in (0x10000000, 0x20000000, 0x40000000):  # clone with CLONE_NEWUSER/PID/NET
        result, err = call("clone", flags | signal.SIGCHLD, 0, 0, 0, 0)
        if result == 0:
            os._exit(0)
        if result > 0:
            os.waitpid(result, 0)
            reached.append(f"clone {flags:#x}")
    return None
''',
    "timing": r'''
def route():
    """The harness seen from outside: its state and CPU time in /proc, sampled while it
    waits for this call. What is readable there carries no test data."""
    samples = []
    for _ in range(50):
        for name in ("stat", "schedstat", "status", "io", "sched", "wchan"):
            data = read_path(f"/proc/1/{name}")
            samples.append(data)
            found = look(data)
            if found:
                return found
        time.sleep(0.002)
    return None
''',
}


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(
        code_time_limit_s=4.0,
        code_memory_limit_bytes=256 * 2**20,
        base_limits=RunLimits(wall_time_s=10.0, max_processes=16),
    )


@pytest.fixture(scope="module")
def secret_problem(tmp_path_factory) -> Path:
    record = {
        "task_id": "Local/secret",
        "prompt": 'def secret(x: int) -> int:\n    """A number only the test knows."""\n',
        "entry_point": "secret",
        "test": f"def check(candidate):\n    assert candidate(7) == {SECRET}\n",
    }
    return write_humaneval_problem(tmp_path_factory.mktemp("secret"), record)


def fenced(code: str) -> str:
    return f"```python\n{code}\n```\n"


def attempts_in(reason: str) -> int:
    match = re.search(r"contained: (\d+) attempts", reason)
    assert match, reason
    return int(match.group(1))


@pytest.mark.parametrize("route", ROUTES)
def test_a_route_to_the_tests_fails_and_the_problem_is_judged_wrong(
    verifier, secret_problem, route
):
    program = PRELUDE + ROUTES[route] + FUNCTION_TAIL
    result = verifier.verify(fenced(program), secret_problem)
    assert result.verdict != Verdict.ACCEPTED and result.reward == 0.0, result.reason
    # The harness judged the run (it relayed the candidate's own account) and nothing of
    # another process was reached.
    assert result.verdict == Verdict.RUNTIME_ERROR, result.reason
    assert "reached: nothing" in result.reason, result.reason
    assert attempts_in(result.reason) > 0


def test_the_secret_is_what_an_honest_reader_of_the_tests_returns(verifier, secret_problem):
    # The check of the suite itself: a candidate that knows the value is accepted, so a
    # route that found it would have been too.
    program = f"def secret(x):\n    return {SECRET}\n"
    assert verifier.verify(fenced(program), secret_problem).verdict == Verdict.ACCEPTED


# --- stdio problems: the expected output is never in the sandbox ---------------------------

STDIO_TAIL = r"""
found = route()
if found is not None:
    print(found)
else:
    print("reached:" + ",".join(r.replace(" ", "_") for r in reached) if reached else "nothing")
"""


@pytest.fixture(scope="module")
def stdio_problem(tmp_path_factory) -> Path:
    return write_problem(
        tmp_path_factory.mktemp("stdio-secret"),
        name="secret",
        tests=[("7\n", f"{SECRET}\n")],
    )


@pytest.mark.parametrize("route", ["pidfd_getfd", "ptrace", "process_vm_readv", "proc_files"])
def test_a_stdio_program_reaches_no_other_process(verifier, stdio_problem, route):
    """bwrap's init (the sandbox's PID 1 for a stdio run) holds the run's stdin and stdout:
    with no seccomp filter a program could ptrace it, read its memory and take its
    descriptors. The expected output is never in the sandbox; nothing else is reached."""
    program = PRELUDE + ROUTES[route] + STDIO_TAIL
    result = verifier.verify(fenced(program), stdio_problem)
    assert result.verdict == Verdict.WRONG_ANSWER, result.reason
    assert "got 'nothing'" in result.reason, result.reason
