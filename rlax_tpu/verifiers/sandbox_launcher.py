"""The sandbox's launcher: the process between the verifier and one sandboxed run.

    python -I -S sandbox_launcher.py REPORT_FD UID GID CGROUP_PROCS PARENT_PID WALL_S \
        SECCOMP_FD COMMAND...

Runs as a fresh single-threaded interpreter (standard library only), so it may fork and
switch uid safely — the verifier, a multithreaded gRPC server, must never fork a child
that changes uid (that fork runs gRPC's fork handlers in the child, which can crash).
It stays with the verifier's uid, out of the program's reach. Its forked child joins the
run's cgroup (CGROUP_PROCS: the leaf's cgroup.procs files joined by ":", or "-"), drops to
UID/GID (when UID >= 0), installs the seccomp filter read from SECCOMP_FD (a run without
bwrap; "-": bwrap installs it) and execs COMMAND.

As a child subreaper it inherits every orphan of the run (bwrap's PID-1 included: bwrap
exits without reaping it), kills them once the command has exited, and reaps everything,
so its RUSAGE_CHILDREN is the whole run's CPU time and peak RSS and nothing of the run is
left when it exits. SIGTERM = kill the run now. The run dies with the verifier: the launcher
gets SIGTERM when PARENT_PID (the verifier) dies, and kills the run itself after WALL_S
seconds, so nothing of a run outlives a verifier killed with SIGKILL, cgroups or not. It
reports one JSON line per event on REPORT_FD: {"error"} if the command could not start, then
{"status", "cpu_s", "maxrss_kb"}.
"""

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_SET_CHILD_SUBREAPER = 36


def kill_children() -> None:
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


def tree_cpu_s(root: int) -> float:
    """CPU seconds of a live process tree: a killed PID namespace's processes are reaped
    without their times reaching anyone's RUSAGE_CHILDREN, so sample before killing."""
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


def install_seccomp(program: bytes) -> None:
    """Install a seccomp filter (a raw `struct sock_filter` array) on this process, after
    PR_SET_NO_NEW_PRIVS. It holds for everything this process executes."""
    libc = ctypes.CDLL(None, use_errno=True)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def start(
    report_fd: int,
    uid: int,
    gid: int,
    cgroup_procs: list[str],
    seccomp_fd: int,
    argv: list[str],
) -> None:
    """In the forked child: join the cgroup, drop privileges, filter, exec. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        for procs in cgroup_procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        if uid >= 0:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        if seccomp_fd >= 0:
            install_seccomp(read_all(seccomp_fd))
        os.execv(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - reported to the verifier, which raises it
        message = json.dumps({"error": f"cannot start {argv[0]}: {type(e).__name__}: {e}"})
        os.write(report_fd, (message + "\n").encode())
    os._exit(127)


def main() -> None:
    report_fd, uid, gid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cgroup_procs = [] if sys.argv[4] == "-" else sys.argv[4].split(":")
    parent, wall_s = int(sys.argv[5]), float(sys.argv[6])
    seccomp_fd = -1 if sys.argv[7] == "-" else int(sys.argv[7])
    argv = sys.argv[8:]
    os.set_inheritable(report_fd, False)
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    state = {"done": False, "sampled_cpu_s": 0.0, "pid": 0}

    def on_term(signum: int, frame: object) -> None:
        if not state["done"] and state["pid"]:
            state["sampled_cpu_s"] = tree_cpu_s(state["pid"])
        state["done"] = True
        kill_children()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGALRM, on_term)
    # SIGTERM when the verifier dies; checked after, for a verifier that died before.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    pid = os.fork()
    if pid == 0:
        start(report_fd, uid, gid, cgroup_procs, seccomp_fd, argv)
    state["pid"] = pid
    if state["done"]:  # stopped (or the verifier died) before the fork
        kill_children()
    if seccomp_fd >= 0:
        os.close(seccomp_fd)
    status = None
    while True:
        try:
            child, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if child == pid:
            status, state["done"] = st, True
        if state["done"]:
            kill_children()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = {
        "status": status,
        "cpu_s": max(ru.ru_utime + ru.ru_stime, state["sampled_cpu_s"]),
        "maxrss_kb": ru.ru_maxrss,
    }
    try:
        os.write(report_fd, (json.dumps(report) + "\n").encode())
    except OSError:  # the verifier is gone
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
