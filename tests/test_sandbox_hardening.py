"""The sandbox's hardening: runs start through the launcher (never a uid-switching fork of
the verifier), never as root, each in its own cgroup where the host allows one; a fork bomb
or a thread bomb stays bounded in every mode; stdin is read-only; the self-test leaves no
zombie; `serve verifier` runs its sandboxes as uid 65534 on every start, and refuses code
requests, saying why, when it cannot.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent import futures

import grpc
import pytest
from processes import ProcessGroup

from rlax_tpu.api.verifier import Verdict, VerificationRequest, VerifierClient
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.verifiers import cgroups
from rlax_tpu.verifiers.code import CodeVerifier
from rlax_tpu.verifiers.function_problems import write_humaneval_problem
from rlax_tpu.verifiers.problems import write_problem
from rlax_tpu.verifiers.repository import TestDataRepository
from rlax_tpu.verifiers.sandbox import (
    NOBODY_UID,
    RunLimits,
    Sandbox,
    SandboxUnavailable,
    reset_probe_cache,
    sandbox_available,
)

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="bwrap is started as uid 65534 only by a root verifier"
)

# Programs run as this host uid: 65534 under a root verifier, else the verifier's own.
RUN_UID = NOBODY_UID if os.geteuid() == 0 else os.getuid()
MAX_PROCESSES = 16
BOMB_LIMITS = RunLimits(cpu_time_s=2.0, wall_time_s=3.0, max_processes=MAX_PROCESSES)
# bwrap and the PID namespace's init run as the program's uid besides its own processes.
SANDBOX_TASKS = 2
PY = ["python3", "-I", "-B", "-c"]

FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n"
)
THREAD_BOMB = (
    "import threading, time\n"
    "threading.stack_size(64 << 10)  # small stacks: the task limit binds first\n"
    "while True:\n"
    "    try:\n"
    "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "    except Exception:\n"
    "        pass\n"
)


def marked(payload: str, marker: str) -> str:
    """A program that re-executes `payload` with `marker` in its argv (forks keep it)."""
    argv = f"[sys.executable, '-c', {payload!r}, {marker!r}]"
    return f"import os, sys\nos.execv(sys.executable, {argv})\n"


def cgroup_modes() -> list:
    try:
        cgroups.detect("auto")
        auto = pytest.param("auto")
    except cgroups.CgroupUnavailable as e:
        auto = pytest.param("auto", marks=pytest.mark.skip(reason=f"no per-run cgroups: {e}"))
    return [auto, pytest.param("off")]


def tasks_with(marker: str) -> tuple[int, int]:
    """(processes, tasks) on the host whose command line holds `marker`."""
    processes = tasks = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() not in f.read():
                        continue
                tasks += len(os.listdir(f"/proc/{entry.name}/task"))
                processes += 1
            except OSError:
                continue
    return processes, tasks


def host_processes() -> int:
    return sum(1 for entry in os.scandir("/proc") if entry.name.isdigit())


class PeakSampler:
    """Samples the marked program's tasks and the host's process count until stopped;
    keeps the peaks."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.peak_tasks = 0
        self.peak_host = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_tasks = max(self.peak_tasks, tasks_with(self.marker)[1])
            self.peak_host = max(self.peak_host, host_processes())
            time.sleep(0.005)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def run_py(sandbox: Sandbox, code: str, limits: RunLimits, stdin: bytes = b""):
    with sandbox.workdir() as work:
        return sandbox.run([*PY, code], workdir=work, limits=limits, stdin=stdin)


# Measured peaks, printed at the end of the module (the hostile-suite table).
TABLE: list[tuple[str, str, int | None, int, int, float]] = []


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if TABLE:
        print("\nprogram  cgroup  peak tasks (cgroup)  peak tasks (scan)  host +procs  wall s")
        for bomb, mode, cgroup_peak, scan_peak, host, wall in TABLE:
            print(
                f"{bomb:<7}  {mode:<6}  {cgroup_peak!s:>19}  {scan_peak:>17}  {host:>11}  "
                f"{wall:6.2f}"
            )


@pytest.mark.parametrize("bomb", ["fork", "thread"])
@pytest.mark.parametrize("mode", cgroup_modes())
def test_bombs_stay_bounded_and_the_next_run_is_prompt(mode, bomb):
    marker = f"rlax-bomb-{uuid.uuid4().hex}"
    program = marked(FORK_BOMB if bomb == "fork" else THREAD_BOMB, marker)
    sandbox = Sandbox(cgroup=mode)
    sandbox.check()
    baseline = host_processes()
    start = time.monotonic()
    with PeakSampler(marker) as peaks:
        outcome = run_py(sandbox, program, BOMB_LIMITS)
    wall = time.monotonic() - start
    TABLE.append(
        (bomb, mode, outcome.peak_processes, peaks.peak_tasks, peaks.peak_host - baseline, wall)
    )
    assert outcome.time_limit_exceeded, outcome.describe()
    assert outcome.uid == RUN_UID and outcome.cgroup == (mode == "auto")
    assert wall < BOMB_LIMITS.wall_s + 2.0
    # The scan sees bwrap and its init too (their command lines hold the program's text).
    bound = MAX_PROCESSES + SANDBOX_TASKS
    assert MAX_PROCESSES // 2 <= peaks.peak_tasks <= bound  # it did bomb, up to the cap
    if outcome.peak_processes is not None:  # the cgroup's count (pids.peak, v2 / newer v1)
        assert MAX_PROCESSES // 2 <= outcome.peak_processes <= bound
    # The host: the program's tasks, bwrap, its init, the launcher, prlimit; a scan of /proc
    # is not atomic (pids exit and new ones appear while it runs), hence the slack. An
    # unbounded bomb reaches thousands.
    assert peaks.peak_host - baseline <= 3 * bound
    assert tasks_with(marker) == (0, 0), "a process of the bomb survived"
    start = time.monotonic()
    follow_up = run_py(sandbox, "print('ok')", RunLimits(cpu_time_s=1.0))
    assert follow_up.ok and follow_up.stdout == b"ok\n", follow_up.describe()
    assert time.monotonic() - start < 1.0


def test_a_cgroup_leaf_holds_the_run_and_is_removed():
    try:
        found = cgroups.detect("auto")
    except cgroups.CgroupUnavailable as e:
        pytest.skip(f"no per-run cgroups: {e}")
    mine = f"run-{os.getpid()}-*"  # this process's leaves (other verifiers may run here)
    sandbox = Sandbox(cgroup="auto")
    code = "print(open('/proc/self/cgroup').read())"
    outcome = run_py(sandbox, code, RunLimits(cpu_time_s=1.0))
    assert outcome.ok and outcome.cgroup, outcome.describe()
    # In its cgroup namespace the run sees itself at its leaf's root.
    assert all(line.endswith(":/") for line in outcome.stdout.decode().split())
    assert [leaf for p in found.parents for leaf in p.glob(mine)] == []  # the leaf is gone
    memory_bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    limits = RunLimits(cpu_time_s=2.0, memory_bytes=64 * 2**20)
    assert run_py(sandbox, memory_bomb, limits).memory_limit_exceeded


def test_stdin_is_read_only():
    code = (
        "import os\n"
        "for attempt in (lambda: os.write(0, b'x'), lambda: os.ftruncate(0, 0),\n"
        "                lambda: open('/proc/self/fd/0', 'wb')):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('wrote')\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
        "print(os.read(0, 100).decode())\n"
    )
    outcome = run_py(Sandbox(), code, RunLimits(cpu_time_s=1.0), stdin=b"the input")
    assert outcome.ok, outcome.describe()
    lines = outcome.stdout.decode().splitlines()
    assert "wrote" not in lines and len(lines) == 4, lines
    assert lines[-1] == "the input"


# A child subreaper (as a verifier that is its container's PID 1 is) inherits every orphan
# of what it starts: it lists the children it was left, their states, after a self-test.
_SUBREAPER_PROBE = """
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
from rlax_tpu.verifiers.sandbox import sandbox_available
ok, reason = sandbox_available()
assert ok, reason
time.sleep(0.2)  # an orphan would have been reparented to this process by now
left = []
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/children") as f:
        for pid in f.read().split():
            with open(f"/proc/{pid}/stat") as stat:
                left.append(stat.read().rsplit(")", 1)[1].split()[0])
print(" ".join(left) or "none")
"""


def test_the_self_test_leaves_no_zombie_and_no_process():
    """bwrap exits without reaping its PID namespace's init: started directly, the init
    becomes a zombie of the verifier when the verifier is a subreaper (or PID 1)."""
    done = subprocess.run(
        [sys.executable, "-c", _SUBREAPER_PROBE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["none"], done.stdout


@needs_root
def test_a_root_verifier_never_runs_bwrap_as_root(tmp_path):
    """bwrap that uid 65534 cannot execute: the sandbox is refused, not run as root."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    bwrap = private / "bwrap"
    shutil.copy(shutil.which("bwrap"), bwrap)
    os.chmod(bwrap, 0o700)
    sandbox = Sandbox(bwrap=str(bwrap))
    ok, reason = sandbox.available()
    assert not ok and f"as uid {NOBODY_UID}" in reason, reason
    assert sandbox.identity()["sandbox"] == "refused"
    with pytest.raises(SandboxUnavailable, match=f"runnable by uid {NOBODY_UID}"):
        sandbox.check()
    with sandbox.workdir() as work, pytest.raises(SandboxUnavailable):
        sandbox.run(["true"], workdir=work, limits=RunLimits())


class _Health(grpc.GenericRpcHandler):
    """Answers every call with an empty ComponentStatus: load for the server's threads."""

    def service(self, handler_call_details):
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: common_pb2.ComponentStatus(component="load"),
            request_deserializer=lambda data: data,
            response_serializer=common_pb2.ComponentStatus.SerializeToString,
        )


def test_the_launcher_path_survives_concurrent_grpc_load():
    """The self-test (a sandboxed run through the launcher, as uid 65534 under root) 25 times
    in a process whose gRPC server and clients are busy: no crash, the same mode each time.
    (The crash it guards against hit about half the starts: 25 miss it with odds 3e-8.)"""
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((_Health(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    calls = [0]

    def load() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                "/load/Call",
                request_serializer=lambda data: data,
                response_deserializer=common_pb2.ComponentStatus.FromString,
            )
            while not stop.is_set():
                call(b"", timeout=10)
                calls[0] += 1

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        reasons = set()
        for _ in range(25):
            reset_probe_cache()
            ok, reason = sandbox_available()
            assert ok, reason
            reasons.add(reason)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        server.stop(None)
    assert calls[0] > 25  # the load really ran alongside
    expected = f"bwrap started as uid {NOBODY_UID}" if os.geteuid() == 0 else "as uid"
    assert len(reasons) == 1 and expected in reasons.pop()


# -- `rlax-tpu serve verifier` -------------------------------------------------------------------
TOKEN = "hardening-token"
WHOAMI = "```python\nprint(input())\n```"


@pytest.fixture(scope="module")
def echo_problem(tmp_path_factory):
    """A repository holding `echo` (one test); (link, cache directory)."""
    tmp = tmp_path_factory.mktemp("test-data")
    problem = write_problem(tmp / "echo", name="echo", tests=[("hi\n", "hi\n")])
    link = TestDataRepository(str(tmp / "repo"), tmp / "upload-cache").upload(problem, "echo")
    return link, str(tmp / "cache")


def code_request(link: str) -> VerificationRequest:
    return VerificationRequest(kind="code", response=WHOAMI, problem=link)


@needs_root
@pytest.mark.parametrize(
    "starts", [pytest.param(5, id="5"), pytest.param(50, id="50", marks=pytest.mark.slow)]
)
def test_every_start_of_serve_verifier_runs_sandboxes_as_nobody(echo_problem, starts):
    """The self-test once crashed in about half the starts (a uid-switching fork of the gRPC
    process) and the service then ran programs as root; 50 starts take 35-75 s on a
    2-core host, hence slow."""
    link, cache = echo_problem
    group = ProcessGroup()
    try:
        for start in range(starts):
            process = group.start_verifier(
                token=TOKEN, test_data_cache=cache, args=["--num-workers=1"]
            )
            assert f"sandbox=bwrap uid={NOBODY_UID}" in process.stderr(), process.stderr()
            client = VerifierClient(process.address, auth_token=TOKEN)
            sandbox = client.metrics()["sandbox"]
            assert (sandbox["sandbox"], sandbox["uid"]) == ("bwrap", str(NOBODY_UID)), sandbox
            if start % 5 == 0:  # and a program really runs there
                result = client.verify([code_request(link)])[0]
                assert result.verdict == Verdict.ACCEPTED, result.reason
            client.close()
            assert process.stop() == 0
            group.processes.remove(process)
    finally:
        group.stop_all()


@needs_root
def test_serve_verifier_refuses_code_requests_when_the_uid_switch_fails(echo_problem, tmp_path):
    link, cache = echo_problem
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    bwrap = private / "bwrap"
    shutil.copy(shutil.which("bwrap"), bwrap)
    os.chmod(bwrap, 0o700)
    group = ProcessGroup()
    try:
        process = group.start_verifier(
            token=TOKEN,
            test_data_cache=cache,
            overrides=[f"verifiers.sandbox_bwrap={bwrap}"],
            args=["--num-workers=1"],
        )
        log = process.stderr()
        assert "ERROR: code requests will be refused" in log and "runnable by uid" in log, log
        client = VerifierClient(process.address, auth_token=TOKEN)
        assert client.metrics()["sandbox"]["sandbox"] == "refused"
        result = client.verify([code_request(link)])[0]
        assert result.verdict == Verdict.VERIFIER_ERROR
        assert "refusing to run untrusted code" in result.reason
        math = VerificationRequest(kind="math", response=r"\boxed{4}", reference="4")
        assert client.verify([math])[0].verdict == Verdict.ACCEPTED  # the rest still serves
        client.close()
    finally:
        group.stop_all()


# A program that keeps a CPU busy, and a child of it that respawns itself: every generation
# forks the next and exits, so that its pid changes all the time.
RESPAWN = """import os
input()
if os.fork() == 0:
    while True:
        for _ in range(200_000):
            pass
        if os.fork() != 0:
            os._exit(0)
while True:
    pass
"""


def pids_of(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def descendants(root: int) -> dict[int, str]:
    """Live descendants of `root`: pid -> start time (field 22 of stat), so that a reused
    pid is not mistaken for a survivor."""
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    for child in map(int, f.read().split()):
                        started = _start_time(child)
                        if started:
                            out[child] = started
                        todo.append(child)
        except OSError:
            continue
    return out


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return ""
    return "" if fields[0] == "Z" else fields[19]  # a zombie is dead


@pytest.mark.parametrize("mode", cgroup_modes())
def test_a_killed_verifier_leaves_no_process_of_its_runs(echo_problem, mode):
    """SIGKILL of `serve verifier` mid-run (an OOM kill, an eviction): its launchers, bwraps
    and the program (which respawns itself) are all gone within 2 s, cgroups on or off."""
    link, cache = echo_problem
    marker = f"rlax-orphan-{uuid.uuid4().hex}"
    program = f"```python\n{marked(RESPAWN, marker)}```"
    group = ProcessGroup()
    try:
        process = group.start_verifier(
            token=TOKEN,
            test_data_cache=cache,
            overrides=["verifiers.code_time_limit_s=30", f"verifiers.sandbox_cgroup={mode}"],
            args=["--num-workers=1"],
        )
        client = VerifierClient(process.address, auth_token=TOKEN)
        request = VerificationRequest(kind="code", response=program, problem=link)
        caller = threading.Thread(target=_ignore_errors, args=(client.verify, [request]))
        caller.start()
        deadline = time.monotonic() + 30
        while not pids_of(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_of(marker), f"the program never started: {process.stderr()}"
        run = descendants(process.pid)  # launcher, bwrap, init, the program
        assert len(run) >= 3, run
        process.kill()
        killed = time.monotonic()
        while time.monotonic() - killed < 2.0:
            left = {p: t for p, t in run.items() if _start_time(p) == t}
            if not left and not pids_of(marker):
                break
            time.sleep(0.05)
        assert not left, f"left after 2 s: {left}"
        assert not pids_of(marker), "the program survived its verifier"
        client.close()
        caller.join(30)
    finally:
        group.stop_all()
        for pid in pids_of(marker):  # only if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
        if mode == "auto":
            cgroups.detect("auto")  # removes the leaf the killed verifier left


def _ignore_errors(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the verifier is killed under the call
        pass


# Children that together outgrow the run's cgroup (each within its own address-space limit)
# while the parent waits past the wall clock for nothing.
OOM_THEN_WALL_CLOCK = """import os, time
for _ in range(4):
    if os.fork() == 0:
        block = bytearray(b"x") * (56 << 20)  # touched: resident
        time.sleep(60)
time.sleep(60)
"""


def test_an_oom_kill_is_a_memory_limit_even_when_the_wall_clock_then_runs_out():
    try:
        cgroups.detect("auto")
    except cgroups.CgroupUnavailable as e:
        pytest.skip(f"no per-run cgroups: {e}")
    limits = RunLimits(
        cpu_time_s=1.0, wall_time_s=2.0, memory_bytes=96 * 2**20, tmp_bytes=8 * 2**20
    )
    outcome = run_py(Sandbox(cgroup="auto"), OOM_THEN_WALL_CLOCK, limits)
    assert outcome.oom_kills > 0, outcome
    assert outcome.memory_limit_exceeded and not outcome.time_limit_exceeded, outcome.describe()


def test_a_function_candidate_killed_for_the_runs_memory_is_a_memory_limit(tmp_path):
    """The harness sees only its candidate die of SIGKILL; the run's cgroup says why."""
    try:
        cgroups.detect("auto")
    except cgroups.CgroupUnavailable as e:
        pytest.skip(f"no per-run cgroups: {e}")
    record = {
        "task_id": "Local/add",
        "prompt": 'def add(a, b):\n    """a + b"""\n',
        "entry_point": "add",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    }
    problem = write_humaneval_problem(tmp_path / "add", record)
    verifier = CodeVerifier(
        code_time_limit_s=2.0,
        code_memory_limit_bytes=128 * 2**20,
        base_limits=RunLimits(wall_time_s=10.0, tmp_bytes=8 * 2**20),
    )
    # Three children take 45 MiB each, then the candidate's own process takes 90 MiB: the
    # largest in a cgroup of 208 MiB, it is the one the kernel kills, and the harness (which
    # survives, and whose pipes the children closed) reports a SIGKILL.
    program = textwrap.dedent(
        """\
        import os, time
        def add(a, b):
            for _ in range(3):
                if os.fork() == 0:
                    os.closerange(3, 256)
                    block = bytearray(b'x') * (45 << 20)
                    time.sleep(60)
            time.sleep(0.5)
            block = bytearray(b'x') * (90 << 20)
            return a + b
        """
    )
    result = verifier.verify(f"```python\n{program}```", problem)
    assert result.verdict == Verdict.MEMORY_LIMIT, result.reason
    assert "SIGKILL" in result.reason, result.reason  # the harness's report, read right
