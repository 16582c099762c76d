"""The bubblewrap sandbox (rlax_tpu.verifiers.sandbox): isolation, limits, outcomes, refusal."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rlax_tpu.verifiers.sandbox import (
    NOBODY_UID,
    SANDBOX_ENV,
    RunLimits,
    Sandbox,
    SandboxUnavailable,
    bwrap_argv,
    sandbox_available,
)

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)

LIMITS = RunLimits(cpu_time_s=1.0, wall_time_s=3.0, memory_bytes=256 * 2**20, output_bytes=4096)
PY = ["python3", "-I", "-B", "-c"]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox()


@pytest.fixture
def workdir(sandbox):
    with sandbox.workdir() as path:
        yield path


def run_py(sandbox, workdir, code: str, limits: RunLimits = LIMITS, stdin: bytes = b""):
    return sandbox.run([*PY, code], workdir=workdir, limits=limits, stdin=stdin)


# --- no bwrap needed --------------------------------------------------------------------


def test_bwrap_command_isolates_namespaces_and_environment():
    argv = bwrap_argv("bwrap", "/some/work", seccomp_fd=7)
    for flag in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"):
        assert flag in argv
    # The command is PID 1 (no init of bwrap's that the program could read), under the filter.
    assert "--as-pid-1" in argv and argv[argv.index("--seccomp") + 1] == "7"
    assert "--clearenv" in argv and "--share-net" not in argv
    assert argv[argv.index("--uid") + 1] == str(NOBODY_UID)
    i = argv.index("/some/work")
    assert argv[i - 1] == "--ro-bind" and argv[i + 1] == "/box"
    assert argv[-1] == "--"
    # Nothing of the host but /usr and the loader's files is bound.
    sources = [argv[j + 1] for j, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
    assert sources == ["/usr", "/some/work"]


def test_writable_workdir_is_bound_read_write():
    argv = bwrap_argv("bwrap", "/some/work", writable=True)
    assert argv[argv.index("/some/work") - 1] == "--bind"


def test_missing_bwrap_is_reported_unavailable():
    available, reason = sandbox_available("/nonexistent/bwrap")
    assert not available
    assert "not installed" in reason


def test_missing_bwrap_refuses_to_run(tmp_path):
    sandbox = Sandbox(bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed") as info:
        sandbox.run(["true"], workdir=tmp_path, limits=LIMITS)
    assert "bubblewrap" in str(info.value)


def test_unsandboxed_runs_with_rlimits_only_when_allowed(tmp_path):
    sandbox = Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True)
    assert sandbox.check().startswith("UNSANDBOXED")
    with sandbox.workdir() as work:
        ok = run_py(sandbox, work, "import sys; print(sys.stdin.read().upper())", stdin=b"hi")
        assert ok.ok and ok.stdout == b"HI\n" and not ok.sandboxed
        looping = run_py(sandbox, work, "while True: pass")
        assert looping.time_limit_exceeded
        hog = run_py(sandbox, work, "x = bytearray(1 << 30)")
        assert hog.memory_limit_exceeded


def test_run_limits_are_validated():
    with pytest.raises(ValueError, match="cpu_time_s"):
        RunLimits(cpu_time_s=0)
    with pytest.raises(ValueError, match="wall_time_s"):
        RunLimits(wall_time_s=-1)
    assert RunLimits(cpu_time_s=2).wall_s == 5


# --- real sandboxed runs ------------------------------------------------------------------


@needs_bwrap
def test_self_test_passes():
    available, reason = sandbox_available()
    assert available, reason


@needs_bwrap
def test_stdin_reaches_program_and_stdout_comes_back(sandbox, workdir):
    out = run_py(
        sandbox,
        workdir,
        "import sys; print(sum(map(int, sys.stdin.read().split())))",
        stdin=b"1 2 3\n",
    )
    assert out.ok and out.sandboxed
    assert out.stdout == b"6\n"
    assert out.exit_code == 0 and out.signal is None


@needs_bwrap
def test_program_runs_unprivileged_with_a_minimal_environment(sandbox, workdir, monkeypatch):
    monkeypatch.setenv("RLAX_SANDBOX_TEST_SECRET", "hunter2")
    out = run_py(
        sandbox, workdir, "import os; print(os.getuid(), os.getgid()); print(sorted(os.environ))"
    )
    uid_line, env_line = out.stdout.decode().splitlines()
    assert uid_line == f"{NOBODY_UID} {NOBODY_UID}"
    assert set(ast.literal_eval(env_line)) <= {*SANDBOX_ENV, "PWD"}


@needs_bwrap
def test_filesystem_view_is_minimal_and_read_only(sandbox, workdir):
    code = (
        "import os\n"
        "print(sorted(os.listdir('/')))\n"
        "for p in ['/usr/x', '/x', '/box/x']:\n"
        "    try:\n"
        "        open(p, 'w')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p)\n"
        "open('/tmp/x', 'w').write('fine')\n"
        "print(open('/tmp/x').read())\n"
    )
    out = run_py(sandbox, workdir, code)
    lines = out.stdout.decode().splitlines()
    assert ast.literal_eval(lines[0]) == sorted(
        ["bin", "box", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr"]
    )
    assert lines[1:] == ["refused /usr/x", "refused /x", "refused /box/x", "fine"]
    assert list(workdir.iterdir()) == []


@needs_bwrap
def test_writable_workdir_receives_files(sandbox):
    with sandbox.workdir(writable=True) as work:
        out = sandbox.run(
            [*PY, "open('made', 'w').write('x')"], workdir=work, limits=LIMITS, writable=True
        )
        assert out.ok
        assert (work / "made").read_text() == "x"


@needs_bwrap
def test_exit_code_and_signal_are_reported(sandbox, workdir):
    code3 = run_py(sandbox, workdir, "raise SystemExit(3)")
    assert code3.exit_code == 3 and code3.signal is None and not code3.ok
    segv = run_py(sandbox, workdir, "import os, sys; sys.stdout.flush(); os.kill(os.getpid(), 11)")
    assert segv.exit_code is None and segv.signal == signal.SIGSEGV
    assert segv.describe() == "killed by SIGSEGV"
    assert not segv.memory_limit_exceeded  # small RSS: a crash, not a memory limit


@needs_bwrap
def test_cpu_time_is_measured(sandbox, workdir):
    out = run_py(
        sandbox,
        workdir,
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass",
    )
    assert out.ok
    assert 0.25 <= out.cpu_time_s < 1.0


@needs_bwrap
def test_cpu_limit_gives_time_limit(sandbox, workdir):
    out = run_py(sandbox, workdir, "while True: pass")
    assert out.time_limit_exceeded and not out.ok
    assert out.wall_time_s < LIMITS.wall_s + 1


@needs_bwrap
def test_fractional_cpu_limit_is_enforced_after_the_run(sandbox, workdir):
    limits = RunLimits(cpu_time_s=0.2, wall_time_s=10.0)
    out = run_py(
        sandbox,
        workdir,
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass",
        limits,
    )
    assert out.exit_code == 0 and out.time_limit_exceeded


@needs_bwrap
def test_wall_clock_limit_kills_a_sleeper(sandbox, workdir):
    limits = RunLimits(cpu_time_s=1.0, wall_time_s=0.5)
    out = run_py(sandbox, workdir, "import time; time.sleep(30)", limits)
    assert out.time_limit_exceeded
    assert out.wall_time_s < 2.0


@needs_bwrap
def test_address_space_limit_gives_memory_limit(sandbox, workdir):
    out = run_py(sandbox, workdir, "x = bytearray(1 << 30)")
    assert out.memory_limit_exceeded and not out.time_limit_exceeded
    assert b"MemoryError" in out.stderr_tail


@needs_bwrap
def test_output_cap_kills_the_program(sandbox, workdir):
    out = run_py(sandbox, workdir, "import sys\nwhile True: sys.stdout.write('x' * 1000)")
    assert out.output_limit_exceeded and not out.time_limit_exceeded
    assert len(out.stdout) == LIMITS.output_bytes
    assert out.wall_time_s < 2.0


@needs_bwrap
def test_process_limit_caps_forks(sandbox, workdir):
    code = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    limits = RunLimits(cpu_time_s=1.0, wall_time_s=5.0, max_processes=8)
    out = run_py(sandbox, workdir, code, limits)
    assert out.ok, out.describe()
    assert 0 < int(out.stdout) < 8
    assert out.wall_time_s < 2.0  # the sleeping children died with the namespace


@needs_bwrap
def test_tmp_is_size_capped(sandbox, workdir):
    limits = RunLimits(cpu_time_s=1.0, tmp_bytes=1 * 2**20, file_size_bytes=64 * 2**20)
    code = (
        "try:\n"
        "    open('/tmp/big', 'wb').write(b'x' * (4 << 20))\n"
        "    print('wrote')\n"
        "except OSError as e:\n"
        "    print('full', e.errno)\n"
    )
    out = run_py(sandbox, workdir, code, limits)
    assert out.stdout.startswith(b"full")


@needs_bwrap
def test_file_size_limit_stops_large_files(sandbox, workdir):
    limits = RunLimits(cpu_time_s=1.0, file_size_bytes=1 * 2**20)
    code = (
        "import signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "try:\n"
        "    open('/tmp/big', 'wb').write(b'x' * (2 << 20))\n"
        "except OSError as e:\n"
        "    print('too big', e.errno)\n"
    )
    out = run_py(sandbox, workdir, code, limits)
    assert out.stdout == b"too big 27\n"  # EFBIG


@needs_bwrap
def test_network_is_unreachable(sandbox, workdir):
    code = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(1)\n"
        "try:\n"
        "    s.connect(('1.1.1.1', 80))\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('blocked')\n"
    )
    assert run_py(sandbox, workdir, code).stdout == b"blocked\n"


@needs_bwrap
def test_runs_in_parallel_threads(sandbox, workdir):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: run_py(sandbox, workdir, f"print({i} * 2)"), range(8)))
    assert [o.stdout for o in outs] == [f"{i * 2}\n".encode() for i in range(8)]


@needs_bwrap
def test_workdir_is_removed_afterwards(sandbox):
    with sandbox.workdir(writable=True) as work:
        sandbox.run([*PY, "open('f', 'w').write('x')"], workdir=work, limits=LIMITS, writable=True)
    assert not os.path.exists(work)


def test_the_work_directories_of_a_killed_process_are_removed_by_the_next_one(tmp_path):
    """A verifier SIGKILLed mid-run leaves its work directory (its cleanup never ran): the
    next sandbox to make one there removes it, once it is older than any run; a live
    process's, a young one and directories named otherwise stay."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"rlax-sandbox-{gone.pid}-k1ll3d"
    young = tmp_path / f"rlax-sandbox-{gone.pid}-y0ung"
    live = tmp_path / f"rlax-sandbox-{os.getpid()}-l1ve"
    other = tmp_path / "rlax-sandbox-probe-x"
    for directory in (orphan, young, live, other):
        directory.mkdir()
        (directory / "main.py").write_text("print(1)\n")
    hours_ago = time.time() - 2 * 3600
    for directory in (orphan, live, other):
        os.utime(directory, (hours_ago, hours_ago))
    with Sandbox(work_root=tmp_path, allow_unsandboxed=True).workdir() as path:
        assert path.name.startswith(f"rlax-sandbox-{os.getpid()}-")
    assert not orphan.exists()
    assert young.exists() and live.exists() and other.exists()
