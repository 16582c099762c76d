"""Hostile programs against the real sandbox: each gets its verdict within its limits, leaves
nothing running and nothing changed outside the sandbox, and the verifier then serves the
next request normally.

Every hostile program re-executes itself with a unique marker in its argv, so its processes
(and their forks) can be found by scanning /proc afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlax_tpu.api.verifier import Verdict, VerificationResult
from rlax_tpu.verifiers.code import CodeVerifier
from rlax_tpu.verifiers.problems import write_problem
from rlax_tpu.verifiers.sandbox import NOBODY_GID, NOBODY_UID, RunLimits

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)

WALL_S = 2.0
TIME_LIMITED_S = 6.0  # upper bound of a run that hits a limit (limit + teardown + slack)
QUICK_S = 4.0  # upper bound of a run that ends by itself
PROJECT_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(
        code_time_limit_s=1.0,
        code_memory_limit_bytes=256 * 2**20,
        code_output_limit_bytes=64 * 2**10,
        base_limits=RunLimits(wall_time_s=WALL_S, max_processes=16),
    )


@pytest.fixture(scope="module")
def problem(tmp_path_factory) -> Path:
    return write_problem(tmp_path_factory.mktemp("ok"), name="ok", tests=[("", "ok\n")])


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture
def marker():
    marker = f"rlax-hostile-{uuid.uuid4().hex}"
    yield marker
    for pid in processes_with(marker):  # only if a test failed: leave nothing behind
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def marked(payload: str, marker: str) -> str:
    """A Python program that re-executes `payload` with `marker` in its argv."""
    argv = f"[sys.executable, '-c', {payload!r}, {marker!r}]"
    return f"import os, sys\nos.execv(sys.executable, {argv})\n"


def fenced(code: str, tag: str = "python") -> str:
    return f"```{tag}\n{code}```\n"


def judge(
    verifier: CodeVerifier,
    problem: Path,
    program: str,
    marker: str,
    *,
    max_s: float,
    tag: str = "python",
) -> VerificationResult:
    """Verify `program` and check the aftermath: bounded time, no survivors, next one fine."""
    start = time.monotonic()
    result = verifier.verify(fenced(program, tag), problem)
    elapsed = time.monotonic() - start
    assert elapsed < max_s, f"took {elapsed:.1f}s: {result.reason}"
    assert processes_with(marker) == [], "a process of the program survived"
    follow_up = verifier.verify(fenced("print('ok')\n"), problem)
    assert follow_up.verdict == Verdict.ACCEPTED, follow_up.reason
    return result


def test_marker_scan_sees_sandboxed_processes(verifier, problem, marker):
    # The survivor checks below mean something only if the scan can see sandboxed processes.
    payload = "import time\ntime.sleep(1.5)\nprint('ok')\n"
    seen: list[int] = []
    thread = threading.Thread(
        target=lambda: seen.append(verifier.verify(fenced(marked(payload, marker)), problem))
    )
    thread.start()
    deadline = time.monotonic() + 5
    found = []
    while not found and time.monotonic() < deadline:
        found = processes_with(marker)
        time.sleep(0.02)
    thread.join()
    assert found, "the marked program was never visible in /proc"
    assert seen[0].verdict == Verdict.ACCEPTED
    assert processes_with(marker) == []


def test_fork_bomb(verifier, problem, marker):
    payload = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=TIME_LIMITED_S)
    assert result.verdict == Verdict.TIME_LIMIT


def test_memory_bomb_python(verifier, problem, marker):
    payload = "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.MEMORY_LIMIT


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_memory_bomb_cpp(verifier, problem, marker):
    program = (
        "#include <cstring>\n"
        "#include <unistd.h>\n"
        "#include <vector>\n"
        "int main(int argc, char** argv) {\n"
        f'    if (argc < 2) execl("/proc/self/exe", "main", "{marker}", (char*)nullptr);\n'
        "    std::vector<char*> chunks;\n"
        "    for (;;) {\n"
        "        char* p = new char[1 << 24];\n"
        "        std::memset(p, 1, 1 << 24);\n"
        "        chunks.push_back(p);\n"
        "    }\n"
        "}\n"
    )
    result = judge(verifier, problem, program, marker, max_s=QUICK_S + 2, tag="cpp")
    assert result.verdict == Verdict.MEMORY_LIMIT, result.reason


def test_infinite_loop(verifier, problem, marker):
    result = judge(verifier, problem, marked("while True: pass\n", marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.TIME_LIMIT


def test_sleep_past_the_limit(verifier, problem, marker):
    payload = "import time\ntime.sleep(100)\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=TIME_LIMITED_S)
    assert result.verdict == Verdict.TIME_LIMIT


def test_stopped_program(verifier, problem, marker):
    payload = "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=TIME_LIMITED_S)
    assert result.verdict == Verdict.TIME_LIMIT


def test_busy_children_left_behind(verifier, problem, marker):
    payload = (
        "import os, subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'while True: pass', {marker!r}])\n"
        "if os.fork() == 0:  # a daemon: new session, double fork\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            pass\n"
        "    os._exit(0)\n"
        "print('ok')\n"
    )
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.ACCEPTED


def test_network_is_unreachable(verifier, problem, marker):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    payload = (
        "import socket\n"
        "results = []\n"
        f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    s = socket.socket()\n"
        "    s.settimeout(0.5)\n"
        "    try:\n"
        "        s.connect(address)\n"
        "        results.append(('connected', address))\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80)\n"
        "    results.append('resolved')\n"
        "except OSError:\n"
        "    pass\n"
        "print(results or 'ok')\n"
    )
    try:
        result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
        assert result.verdict == Verdict.ACCEPTED, result.reason
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected to the host
    finally:
        listener.close()


def test_writes_outside_the_sandbox_change_nothing(verifier, problem, marker, tmp_path):
    answer = problem / "tests" / "01.ans"
    targets = [
        tmp_path / "pwned.txt",
        PROJECT_DIR / "pwned_by_sandbox.txt",
        Path("/etc/pwned_by_sandbox"),
        Path("/usr/pwned_by_sandbox"),
        Path("/pwned_by_sandbox"),
    ]
    before = answer.read_bytes()
    payload = (
        "import os\n"
        f"for path in {[str(t) for t in targets] + [str(answer), '/box/pwned']!r}:\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('pwned')\n"
        "    except OSError:\n"
        "        pass\n"
        "print('ok')\n"
    )
    try:
        result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
        assert result.verdict == Verdict.ACCEPTED, result.reason
        assert [t for t in targets if t.exists()] == []
        assert list(tmp_path.iterdir()) == []
        assert answer.read_bytes() == before
    finally:
        for target in targets:
            if target.is_file():
                target.unlink()


def test_environment_secrets_are_invisible(verifier, problem, marker, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLAX_HOSTILE_TEST_SECRET", secret)
    # The program looks for the secret's reverse, so its own argv cannot match.
    payload = (
        "import glob, os\n"
        "blob = repr(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        blob += open(path, 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n"
        "        pass\n"
        f"print('leak' if {secret[::-1]!r}[::-1] in blob else 'ok')\n"
    )
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.ACCEPTED, result.reason


def test_host_files_are_invisible(verifier, problem, marker, tmp_path):
    host_file = tmp_path / "host_secret.txt"
    host_file.write_text("secret")
    paths = [
        host_file,
        PROJECT_DIR / "pyproject.toml",
        Path(__file__),
        Path(sys.executable),
        problem / "tests" / "01.ans",
        Path("/etc/passwd"),
        Path("/etc/shadow"),
        Path("/root"),
        Path("/home"),
    ]
    assert all(p.exists() for p in paths[:5])
    payload = (
        "import os\n"
        f"visible = [p for p in {[str(p) for p in paths]!r} if os.path.exists(p)]\n"
        "print(visible or 'ok')\n"
    )
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.ACCEPTED, result.reason


def test_huge_output(verifier, problem, marker):
    payload = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.OUTPUT_LIMIT


def test_stderr_flood_is_drained_until_the_time_limit(verifier, problem, marker):
    payload = "import sys\nwhile True:\n    sys.stderr.write('x' * 65536)\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=TIME_LIMITED_S)
    assert result.verdict == Verdict.TIME_LIMIT


@pytest.fixture
def host_sentinel():
    """A process with the sandbox's uid outside the sandbox: `kill -1` inside must miss it."""
    kwargs = {}
    if os.geteuid() == 0:
        kwargs = {"user": NOBODY_UID, "group": NOBODY_GID, "extra_groups": []}
    sentinel = subprocess.Popen(["sleep", "60"], cwd="/", **kwargs)
    yield sentinel
    sentinel.kill()
    sentinel.wait()


def test_killing_the_parent_and_everything(verifier, problem, marker, host_sentinel):
    payload = (
        "import os, signal\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('ok')\n"
    )
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.ACCEPTED, result.reason
    assert host_sentinel.poll() is None


def test_shell_kill_minus_one_kills_only_the_sandbox(verifier, problem, marker, host_sentinel):
    payload = f"import subprocess\nsubprocess.run(['sh', '-c', 'kill -9 -1', {marker!r}])\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert "SIGKILL" in result.reason
    assert host_sentinel.poll() is None


def test_closing_stdout_then_spinning(verifier, problem, marker):
    payload = "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.TIME_LIMIT


def test_closing_stdout_then_exiting(verifier, problem, marker):
    payload = "import os, time\nos.close(1)\ntime.sleep(0.1)\n"
    result = judge(verifier, problem, marked(payload, marker), marker, max_s=QUICK_S)
    assert result.verdict == Verdict.WRONG_ANSWER
    assert "got end of output" in result.reason
