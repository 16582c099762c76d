"""The sandbox's PID 1: starts the run's command, reaps, and exits with the command's status.

    python3 -I -S -c <this file> COMMAND...   (bwrap --as-pid-1, as uid 65534)

It stands where bwrap's own init would, with one difference: it makes itself non-dumpable
before anything else, so that no process of the sandbox (same uid) can read its memory, its
maps or its descriptors (/proc/1/mem, pidfd_getfd), and it closes its copies of the run's
stdin, stdout and stderr once the command has them. Nothing of the sandbox is then reachable
from the program but the program's own processes. As PID 1 it gets no signal from inside the
sandbox that it has no handler for; when it exits, the kernel kills every process left in
the sandbox. A command killed by signal N is reported as exit code 128 + N, as bwrap's init
does. Standard library only: it runs under the sandbox's /usr/bin/python3.
"""

import ctypes
import os
import signal
import sys

PR_SET_DUMPABLE = 4


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt from the program
    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        os.write(2, b"sandbox init: prctl(PR_SET_DUMPABLE, 0) failed\n")
        os._exit(125)
    argv = sys.argv[1:]
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(2, f"sandbox init: cannot run {argv[0]}: {e}\n".encode())
        os._exit(127)
    for fd in (0, 1, 2):
        os.close(fd)
    while True:
        child, status = os.wait()
        if child == pid:
            break
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
