"""The seccomp filter every sandboxed run starts under: a small classic-BPF program, written
here, that denies the system calls a program under test has no use for and that reach other
processes, the kernel's larger attack surfaces, or new namespaces (docs/verifiers.md).

bwrap loads it (`--seccomp FD`) just before it executes the run's command; an unsandboxed run
gets it from the launcher (sandbox_launcher.py), which installs it before its exec. A denied
call fails with EPERM (ENOSYS for clone3, so that libc falls back to clone, whose namespace
flags the filter can read). Calls through another ABI (i386 or x32 on x86_64, arm32 on
aarch64) fail with ENOSYS: their numbers are other calls'.
"""

from __future__ import annotations

import errno
import platform
import struct

# Denied calls by name: (x86_64 number, aarch64 number); None where the ABI has no such call.
# The numbers are the kernel's (arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h), checked against the installed headers by the tests.
DENIED: dict[str, tuple[int | None, int | None]] = {
    # Reaching into another process: its memory, its descriptors, its signals.
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424),
    # Namespaces, mounts and file handles (bwrap is done with all of them before the exec).
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    # The kernel's larger attack surfaces.
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "fanotify_init": (300, 262),
    "lookup_dcookie": (212, 18),
    # The host's business (root's anyway; denied so no bug in a check is ever reached).
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "acct": (163, 89),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "syslog": (103, 116),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "vhangup": (153, 58),
    "iopl": (172, None),
    "ioperm": (173, None),
    "modify_ldt": (154, None),
    "uselib": (134, None),
}
# clone3 passes its flags in memory the filter cannot read: ENOSYS makes libc use clone.
CLONE3: tuple[int, int] = (435, 435)
CLONE: tuple[int, int] = (56, 220)
# clone() flags that make namespaces: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
# NEWNET. (CLONE_NEWTIME, 0x80, is only valid for unshare and clone3, both denied.)
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NAMESPACE_FLAGS |= 0x20000000 | 0x40000000

# Architectures: (index into the number pairs, AUDIT_ARCH_*). x86_64's x32 ABI sets this bit
# in the call number.
_ARCHES = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
_ARCHES["arm64"] = _ARCHES["aarch64"]
_X32_SYSCALL_BIT = 0x40000000

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_OFFSET_NR = 0
_OFFSET_ARCH = 4
_OFFSET_ARG0_LOW = 16  # little-endian: the low 32 bits of args[0]


class SeccompUnavailable(RuntimeError):
    """No filter is written for this machine's architecture."""


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _deny(errno_value: int) -> bytes:
    return _insn(_RET_K, RET_ERRNO | errno_value)


def architecture(machine: str | None = None) -> str:
    """The name `program` knows this machine's (or `machine`'s) architecture by; raises
    SeccompUnavailable naming the machine when there is no filter for it."""
    machine = (machine or platform.machine()).lower()
    if machine not in _ARCHES:
        raise SeccompUnavailable(
            f"no seccomp filter is written for the {machine!r} architecture (only x86_64 and "
            "aarch64): untrusted code is not run here; add its call numbers to "
            "rlax_tpu/verifiers/seccomp.py"
        )
    return "x86_64" if _ARCHES[machine][0] == 0 else "aarch64"


def program(machine: str | None = None) -> bytes:
    """The filter as the raw `struct sock_filter` array bwrap's --seccomp reads."""
    index, audit_arch = _ARCHES[architecture(machine)]
    out = [
        _insn(_LD_W_ABS, _OFFSET_ARCH),
        _insn(_JEQ_K, audit_arch, jt=1, jf=0),
        _deny(errno.ENOSYS),  # another ABI
        _insn(_LD_W_ABS, _OFFSET_NR),
    ]
    if index == 0:
        out += [_insn(_JGE_K, _X32_SYSCALL_BIT, jt=0, jf=1), _deny(errno.ENOSYS)]
    for numbers in DENIED.values():
        if numbers[index] is not None:
            out += [_insn(_JEQ_K, numbers[index], jt=0, jf=1), _deny(errno.EPERM)]
    out += [_insn(_JEQ_K, CLONE3[index], jt=0, jf=1), _deny(errno.ENOSYS)]
    out += [
        _insn(_JEQ_K, CLONE[index], jt=0, jf=3),
        _insn(_LD_W_ABS, _OFFSET_ARG0_LOW),
        _insn(_JSET_K, CLONE_NAMESPACE_FLAGS, jt=0, jf=1),
        _deny(errno.EPERM),
        _insn(_RET_K, RET_ALLOW),
    ]
    return b"".join(out)
