"""The sandbox's seccomp filter (rlax_tpu.verifiers.seccomp): its call numbers against the
kernel headers installed here, its decisions read by a BPF interpreter written here for every
call it names, and the filter in force on unsandboxed runs, which the launcher filters."""

from __future__ import annotations

import errno
import re
import struct
from pathlib import Path

import pytest

from rlax_tpu.verifiers import seccomp
from rlax_tpu.verifiers.sandbox import RunLimits, Sandbox

HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),  # aarch64 uses the generic table
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
AUDIT_ARCH_I386 = 0x40000003
# Calls every program makes, which must pass: read, write, openat, mmap, exit_group, getpid.
EVERYDAY = {"x86_64": (0, 1, 257, 9, 231, 39), "aarch64": (63, 64, 56, 222, 94, 172)}


def header_numbers(path: Path) -> dict[str, int]:
    text = path.read_text()
    numbers: dict[str, int] = {}
    for match in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text):
        numbers.setdefault(match.group(1), int(match.group(2)))
    return numbers


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_call_numbers_are_the_kernel_headers(arch):
    if not HEADERS[arch].exists():
        pytest.skip(f"{HEADERS[arch]} is not installed (linux-libc-dev)")
    numbers = header_numbers(HEADERS[arch])
    index = 0 if arch == "x86_64" else 1
    table = {**seccomp.DENIED, "clone": seccomp.CLONE, "clone3": seccomp.CLONE3}
    for name, pair in table.items():
        assert numbers.get(name) == pair[index], f"{name} on {arch}"


def run_filter(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """Classic BPF, as the kernel runs a seccomp filter, over one struct seccomp_data."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == 0x06:  # ret k
            return k
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {
                0x15: accumulator == k,
                0x35: accumulator >= k,
                0x45: bool(accumulator & k),
            }[code]
            pc += 1 + (jt if taken else jf)
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_filter_denies_what_it_names_and_passes_the_rest(arch):
    program = seccomp.program(arch)
    assert len(program) % 8 == 0 and len(program) // 8 < 4096  # BPF_MAXINSNS
    index = 0 if arch == "x86_64" else 1
    audit = AUDIT_ARCH[arch]
    eperm = seccomp.RET_ERRNO | errno.EPERM
    enosys = seccomp.RET_ERRNO | errno.ENOSYS
    for name, pair in seccomp.DENIED.items():
        if pair[index] is not None:
            assert run_filter(program, pair[index], audit) == eperm, name
    for nr in EVERYDAY[arch]:
        assert run_filter(program, nr, audit) == seccomp.RET_ALLOW, nr
    clone = seccomp.CLONE[index]
    assert run_filter(program, clone, audit, arg0=0x01200011) == seccomp.RET_ALLOW  # fork()
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000):  # NEWUSER, NEWPID, NEWNET, NEWNS
        assert run_filter(program, clone, audit, arg0=0x11 | flag) == eperm, hex(flag)
    assert run_filter(program, seccomp.CLONE3[index], audit) == enosys
    # Another ABI's numbers are other calls: i386's ptrace is 26, x86_64's msync.
    assert run_filter(program, 26, AUDIT_ARCH_I386) == enosys
    if arch == "x86_64":
        assert run_filter(program, 0x40000000 | 101, audit) == enosys  # x32


def test_an_architecture_without_a_filter_is_named():
    with pytest.raises(seccomp.SeccompUnavailable, match="riscv64.*seccomp.py"):
        seccomp.program("riscv64")


PROBE = """
import ctypes, errno, platform
libc = ctypes.CDLL(None, use_errno=True)
ptrace, pidfd_open = {"x86_64": (101, 434), "aarch64": (117, 434)}[platform.machine()]
for nr, args in ((ptrace, (16, 1, 0, 0)), (pidfd_open, (1, 0))):
    result = libc.syscall(nr, *args)
    print(result, errno.errorcode.get(ctypes.get_errno()))
print([l for l in open("/proc/self/status") if l.startswith("Seccomp:")][0].split()[1])
"""


def test_unsandboxed_runs_are_filtered_by_the_launcher(tmp_path):
    sandbox = Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True)
    with sandbox.workdir() as work:
        outcome = sandbox.run(
            ["python3", "-I", "-c", PROBE], workdir=work, limits=RunLimits(cpu_time_s=2.0)
        )
    assert outcome.ok and not outcome.sandboxed, outcome.describe()
    assert outcome.stdout.decode().split("\n")[:3] == ["-1 EPERM", "-1 EPERM", "2"]
