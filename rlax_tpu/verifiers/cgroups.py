"""Per-run cgroups for the sandbox: each run of untrusted code gets its own leaf with a
process cap (`pids.max`), a memory cap without swap and a CPU bandwidth cap, whatever uid
the program runs as, and the leaf is emptied and removed after the run.

rlimits alone are per process (RLIMIT_AS) or per uid (RLIMIT_NPROC, which root ignores); a
cgroup bounds the whole process tree of one run. The unified hierarchy (cgroup v2) is used
when the pids, memory and cpu controllers are delegated to this process's cgroup; on hosts
whose controllers sit on the legacy hierarchies (cgroup v1) those are used instead. Where
neither can be written (a container without cgroup write access, GKE Sandbox / gVisor),
`detect` says why and the sandbox runs with rlimits under a non-root uid only.

`detect` runs once per sandbox; `Cgroups.create(limits)` makes one run's leaf, whose
`procs_files` the launcher's child joins before it drops privileges and execs the run.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

CONTROLLERS = ("pids", "memory", "cpu")
RUNS_DIR = "rlax-sandbox"  # (v1) the directory under this process's cgroup holding runs
SERVICE_LEAF = "rlax-verifier"  # (v2) where this process moves when its cgroup must delegate
CPU_PERIOD_US = 100_000
_REMOVE_TRIES = 50  # x 20 ms: how long a leaf may take to empty after its processes die


class CgroupUnavailable(RuntimeError):
    """Per-run cgroups cannot be used here; the message says why and what would fix it."""


@dataclasses.dataclass(frozen=True)
class CgroupLimits:
    """What one run's leaf allows: tasks (processes and threads), memory (no swap) and CPU
    bandwidth in cores."""

    pids: int
    memory_bytes: int
    cpu_cores: float


@dataclasses.dataclass(frozen=True)
class CgroupStats:
    """What a run's leaf saw: its most tasks at once, OOM kills, its peak memory (None where
    the kernel does not count it)."""

    peak_pids: int | None
    oom_kills: int
    peak_memory_bytes: int | None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _int_or_none(path: Path) -> int | None:
    try:
        return int(_read(path).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path, key: str) -> int:
    """The value of `key` in a "key value" per line file (memory.events, oom_control)."""
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _pids_in(leaf: Path) -> list[int]:
    try:
        return [int(p) for p in _read(leaf / "cgroup.procs").split()]
    except OSError:
        return []


def _kill_all(leaves: Sequence[Path], use_cgroup_kill: bool) -> None:
    """SIGKILL every process in `leaves` (cgroup.kill where the kernel has it; else one by
    one, again until none is left: a fork bomb may fork while being killed)."""
    for leaf in leaves:
        if use_cgroup_kill and (leaf / "cgroup.kill").exists():
            try:
                _write(leaf / "cgroup.kill", "1")
                continue
            except OSError:
                pass
        for _ in range(200):
            pids = _pids_in(leaf)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _remove(leaves: Sequence[Path]) -> None:
    """rmdir each leaf once its processes are gone (the kernel frees a leaf only after its
    last task has exited, which follows SIGKILL by a little)."""
    for leaf in leaves:
        for _ in range(_REMOVE_TRIES):
            try:
                leaf.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    break
                time.sleep(0.02)


@dataclasses.dataclass
class RunCgroup:
    """One run's leaf (one directory per hierarchy on v1)."""

    version: int
    leaves: tuple[Path, ...]

    @property
    def procs_files(self) -> tuple[str, ...]:
        """Where the run's first process writes its pid to join the leaf."""
        return tuple(str(leaf / "cgroup.procs") for leaf in self.leaves)

    def stats(self) -> CgroupStats:
        if self.version == 2:
            leaf = self.leaves[0]
            return CgroupStats(
                peak_pids=_int_or_none(leaf / "pids.peak"),
                oom_kills=_keyed(leaf / "memory.events", "oom_kill"),
                peak_memory_bytes=_int_or_none(leaf / "memory.peak"),
            )
        pids, memory = self.leaves[0], self.leaves[1]  # v1: (pids, memory, cpu)
        oom = _keyed(memory / "memory.oom_control", "oom_kill")
        return CgroupStats(
            peak_pids=_int_or_none(pids / "pids.peak"),
            oom_kills=oom,
            peak_memory_bytes=_int_or_none(memory / "memory.max_usage_in_bytes"),
        )

    def close(self) -> None:
        """Kill whatever is still in the leaf and remove it."""
        _kill_all(self.leaves, use_cgroup_kill=self.version == 2)
        _remove(self.leaves)


class Cgroups:
    """Creates run leaves under `parents` (one directory on v2; pids, memory, cpu on v1)."""

    def __init__(self, version: int, parents: Sequence[Path], description: str) -> None:
        self.version = version
        self.parents = tuple(parents)
        self.description = description
        self._serial = itertools.count()

    def create(self, limits: CgroupLimits) -> RunCgroup:
        """A new leaf with `limits`; OSError if the kernel refuses one of them."""
        name = f"run-{os.getpid()}-{next(self._serial)}"
        leaves = tuple(parent / name for parent in self.parents)
        made: list[Path] = []
        try:
            for leaf in leaves:
                leaf.mkdir()
                made.append(leaf)
            if self.version == 2:
                _limit_v2(leaves[0], limits)
            else:
                _limit_v1(*leaves, limits=limits)
        except BaseException:
            _remove(made)
            raise
        return RunCgroup(self.version, leaves)


def _limit_v2(leaf: Path, limits: CgroupLimits) -> None:
    _write(leaf / "pids.max", str(limits.pids))
    _write(leaf / "memory.max", str(limits.memory_bytes))
    if (leaf / "memory.swap.max").exists():
        _write(leaf / "memory.swap.max", "0")
    if (leaf / "memory.oom.group").exists():
        _write(leaf / "memory.oom.group", "1")  # an OOM kill takes the whole run
    quota = max(1000, int(limits.cpu_cores * CPU_PERIOD_US))
    _write(leaf / "cpu.max", f"{quota} {CPU_PERIOD_US}")


def _limit_v1(pids: Path, memory: Path, cpu: Path, *, limits: CgroupLimits) -> None:
    _write(pids / "pids.max", str(limits.pids))
    _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
    if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting is on: no swap
        _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    try:
        _write(memory / "memory.swappiness", "0")
    except OSError:
        pass  # not settable in every hierarchy; the memsw limit above is what bounds swap
    _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
    _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(limits.cpu_cores * CPU_PERIOD_US))))


# --- detection ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mount:
    point: Path
    fstype: str
    options: frozenset[str]


def _mounts() -> list[_Mount]:
    out = []
    try:
        lines = _read(Path("/proc/self/mountinfo")).splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        out.append(_Mount(Path(point), tail[0], frozenset(tail[2].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """{controller or "" for v2: path} of this process (from /proc/self/cgroup)."""
    out = {}
    try:
        lines = _read(Path("/proc/self/cgroup")).splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            out[""] = path
        for controller in controllers.split(","):
            if controller:
                out[controller] = path
    return out


def _under(mount: Path, path: str) -> Path:
    return mount / path.lstrip("/")


def _probe_leaf(cgroups: Cgroups) -> None:
    """Remove leaves a killed verifier left behind, then create and remove one leaf with
    small limits: the hierarchy is really writable."""
    for parent in cgroups.parents:
        for stale in parent.glob("run-*-*"):
            pid = stale.name.split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _kill_all([stale], use_cgroup_kill=cgroups.version == 2)
                _remove([stale])
    leaf = cgroups.create(CgroupLimits(pids=8, memory_bytes=64 * 2**20, cpu_cores=1.0))
    leaf.close()


def _detect_v2(base: Path) -> Cgroups:
    available = set(_read(base / "cgroup.controllers").split())
    missing = [c for c in CONTROLLERS if c not in available]
    if missing:
        raise CgroupUnavailable(
            f"cgroup v2 at {base}: controllers {', '.join(missing)} are not delegated to it "
            f"(cgroup.controllers: {' '.join(sorted(available)) or 'none'})"
        )
    enable = " ".join(f"+{c}" for c in CONTROLLERS)
    try:
        _write(base / "cgroup.subtree_control", enable)
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise CgroupUnavailable(f"cgroup v2 at {base}: cannot enable controllers: {e}") from e
        # "No internal processes": a cgroup with processes cannot delegate controllers.
        # Move this process into a leaf of its own, then try again.
        own = base / SERVICE_LEAF
        own.mkdir(exist_ok=True)
        _write(own / "cgroup.procs", str(os.getpid()))
        try:
            _write(base / "cgroup.subtree_control", enable)
        except OSError as e2:
            others = _pids_in(base)
            raise CgroupUnavailable(
                f"cgroup v2 at {base}: cannot delegate controllers while it holds other "
                f"processes ({len(others)}: {e2}); run the verifier as the only process of its "
                "cgroup, or set verifiers.sandbox_cgroup to a cgroup it may manage"
            ) from e2
    cgroups = Cgroups(2, [base], f"cgroup v2 ({', '.join(CONTROLLERS)}) under {base}")
    _probe_leaf(cgroups)
    return cgroups


def _detect_v1(mounts: list[_Mount], own: dict[str, str]) -> Cgroups:
    parents = []
    for controller in CONTROLLERS:
        mount = next((m for m in mounts if m.fstype == "cgroup" and controller in m.options), None)
        if mount is None or controller not in own:
            raise CgroupUnavailable(f"cgroup v1: no {controller} hierarchy is mounted")
        parent = _under(mount.point, own[controller]) / RUNS_DIR
        try:
            parent.mkdir(exist_ok=True)
        except OSError as e:
            raise CgroupUnavailable(f"cgroup v1: cannot create {parent}: {e}") from e
        parents.append(parent)
    cgroups = Cgroups(
        1, parents, f"cgroup v1 ({', '.join(CONTROLLERS)}) under {', '.join(map(str, parents))}"
    )
    _probe_leaf(cgroups)
    return cgroups


def detect(setting: str = "auto") -> Cgroups:
    """The per-run cgroups this process can manage; CgroupUnavailable saying why not.

    setting: "auto" (this process's own cgroup: v2 if the controllers are delegated there,
    else v1), "off" (never), or the path of a cgroup v2 directory to create runs under."""
    if setting == "off":
        raise CgroupUnavailable("per-run cgroups are off (verifiers.sandbox_cgroup = off)")
    if setting != "auto":
        try:
            return _detect_v2(Path(setting))
        except OSError as e:
            raise CgroupUnavailable(f"cgroup {setting}: {e}") from e
    mounts, own = _mounts(), _own_cgroups()
    reasons = []
    unified = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if unified is not None and "" in own:
        try:
            return _detect_v2(_under(unified.point, own[""]))
        except (CgroupUnavailable, OSError) as e:
            reasons.append(str(e))
    else:
        reasons.append("no cgroup v2 hierarchy is mounted")
    try:
        return _detect_v1(mounts, own)
    except (CgroupUnavailable, OSError) as e:
        reasons.append(str(e))
    raise CgroupUnavailable(
        "; ".join(reasons) + " (cgroups cannot be delegated here: a container without "
        "cgroup write access, or GKE Sandbox / gVisor; runs are limited by rlimits only)"
    )
