"""The sandbox's launcher: the process between the verifier and one sandboxed run.

    python -I -S sandbox_launcher.py REPORT_FD UID GID CGROUP_PROCS COMMAND...

Runs as a fresh single-threaded interpreter (standard library only), so it may fork and
switch uid safely — the verifier, a multithreaded gRPC server, must never fork a child
that changes uid (that fork runs gRPC's fork handlers in the child, which can crash).
It stays with the verifier's uid, out of the program's reach. Its forked child joins the
run's cgroup (CGROUP_PROCS: the leaf's cgroup.procs files joined by ":", or "-"), drops to
UID/GID (when UID >= 0) and execs COMMAND.

As a child subreaper it inherits every orphan of the run (bwrap's PID-1 included: bwrap
exits without reaping it), kills them once the command has exited, and reaps everything,
so its RUSAGE_CHILDREN is the whole run's CPU time and peak RSS and nothing of the run is
left when it exits. SIGTERM = kill the run now. It reports one JSON line per event on
REPORT_FD: {"error"} if the command could not start, then {"status", "cpu_s",
"maxrss_kb"}.
"""

import ctypes
import json
import os
import resource
import signal
import sys

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


def start(report_fd: int, uid: int, gid: int, cgroup_procs: list[str], argv: list[str]) -> None:
    """In the forked child: join the cgroup, drop privileges, exec. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for procs in cgroup_procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        if uid >= 0:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        os.execv(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - reported to the verifier, which raises it
        message = json.dumps({"error": f"cannot start {argv[0]}: {type(e).__name__}: {e}"})
        os.write(report_fd, (message + "\n").encode())
    os._exit(127)


def main() -> None:
    report_fd, uid, gid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cgroup_procs = [] if sys.argv[4] == "-" else sys.argv[4].split(":")
    argv = sys.argv[5:]
    os.set_inheritable(report_fd, False)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    state = {"done": False, "sampled_cpu_s": 0.0, "pid": 0}

    def on_term(signum: int, frame: object) -> None:
        if not state["done"] and state["pid"]:
            state["sampled_cpu_s"] = tree_cpu_s(state["pid"])
        state["done"] = True
        kill_children()

    signal.signal(signal.SIGTERM, on_term)
    pid = os.fork()
    if pid == 0:
        start(report_fd, uid, gid, cgroup_procs, argv)
    state["pid"] = pid
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
    os.write(report_fd, (json.dumps(report) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
