"""The whole job (`rlax-tpu run` / `resume`) as a child process, and runs of it disturbed by
kills: SIGKILLs of named components at moments of the run, and failpoints
(rlax_tpu/failpoints.py) that make a component die inside a window no outside kill can hit.

Used by tests/test_controller_e2e.py (kill-and-resume, elastic recovery, the chaos test)
and tools/bench_recovery.py (time lost per kill kind).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from jobenv import user_env
from tiny_job import tiny_job_config

from rlax_tpu import failpoints
from rlax_tpu.config import (
    ControllerConfig,
    DatasetConfig,
    DynamicSamplingConfig,
    OptimizerConfig,
    RunConfig,
    StalenessConfig,
    WarmStartConfig,
)
from rlax_tpu.verifiers.tasks import arithmetic_problems

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8


def e2e_config(
    run_dir: Path, data: Path, *, workers: int = 1, restarts: int = 3, **staleness
) -> RunConfig:
    """The e2e job: the tiny model on `data`, STEPS steps of 2 prompts x 4 samples after a
    40-step SFT warm start (so rewards and gradients are not zero), a checkpoint and a
    snapshot every 2 steps, packed training rows; `staleness` picks η and N."""
    return tiny_job_config(
        "e2e",
        run_dir,
        seed=3,
        staleness=StalenessConfig(**staleness),
        inference={"num_workers": workers, "gpu_memory_fraction": 0.2},
        trainer={
            "optimizer": OptimizerConfig(learning_rate=1e-3),
            "warm_start": WarmStartConfig(steps=40, learning_rate=3e-3),
            "checkpoint_every": 2,
            # Packed rows (a mini-batch's 8 short sequences in one micro-batch of 2 rows),
            # with a group's samples sharing their prompt pages (the default): the killed
            # and resumed runs below hold both to the uninterrupted run's weights.
            "micro_batch_size": 2,
            "tokens_per_row": 64,
        },
        controller=ControllerConfig(
            num_steps=STEPS,
            prompts_per_batch=2,
            samples_per_prompt=4,
            datasets=(DatasetConfig(path=str(data), verifier="arithmetic"),),
            dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=2),
            keep_snapshots=10,
            component_restarts=restarts,
        ),
    )


def write_data(path: Path) -> Path:
    """The e2e job's dataset: 64 sums of small numbers."""
    rows = arithmetic_problems(11, 64, max_operand=4, ops=("+",))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Victims whose death stops the job (`rlax-tpu resume` continues it); the launcher starts the
# others again while the run goes on.
FULL_RESTART = ("trainer", "controller")
# Failpoints by the component they kill (the first part of a failpoint's name), in the order
# the chaos schedule takes them by seed.
FULL_RESTART_FAILPOINTS = ("controller.snapshot", "trainer.checkpoint", "trainer.publish")
ELASTIC_FAILPOINTS = ("param_server.persist", "param_server.receive")


class Job:
    """`rlax-tpu run CONFIG` (or `resume`) as a child process; every process it started is
    killed at `cleanup` if still alive (they are found in the run's logs/processes.json)."""

    def __init__(self, args: list[str], run_dir: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.run_dir, self.extra_env = list(args), run_dir, dict(env or {})
        self.log = open(run_dir.parent / f"{run_dir.name}.job.log", "ab")  # noqa: SIM115
        # The job sets its own device count (cpu_devices); the suite's code generation kept.
        env = user_env(JAX_PLATFORMS="cpu", **self.extra_env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlax_tpu", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # a process group of its own, as a terminal's job
        )

    def interrupt(self) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to the job's process group."""
        os.killpg(self.process.pid, signal.SIGINT)

    def children(self) -> dict[str, int]:
        path = self.run_dir / "logs" / "processes.json"
        try:
            entries = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or mid-write
            return {}
        return {name: entry["pid"] for name, entry in entries.items()}

    def wait(self, timeout_s: float = 400) -> int:
        try:
            return self.process.wait(timeout_s)
        finally:
            self.log.flush()

    def output(self) -> str:
        return (self.run_dir.parent / f"{self.run_dir.name}.job.log").read_text(errors="replace")

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        wait_gone(self.children().values(), kill_after_s=30)
        self.log.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def wait_gone(pids, kill_after_s: float) -> None:
    deadline = time.monotonic() + kill_after_s
    for pid in pids:
        while alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


def _stack(pid: int) -> str:
    """What a process left behind is doing: its Python threads (py-spy, when installed)
    and its signal masks."""
    status = Path(f"/proc/{pid}/status")
    signals = ""
    if status.exists():
        signals = " ".join(
            line for line in status.read_text().splitlines() if line.startswith(("Sig", "Shd"))
        )
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return signals
    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
    return f"{signals}\n{dump.stdout}{dump.stderr}"


def consumed_steps(run_dir: Path) -> int:
    directory = run_dir / "consumed"
    return len(list(directory.glob("batch_*.json"))) if directory.exists() else 0


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- disturbed runs -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL `victim` (a name of logs/processes.json, or "controller": the job process,
    launcher and controller in one) `delay_s` after the run has consumed `after_step` steps
    with every component up."""

    victim: str
    after_step: int
    delay_s: float = 0.0

    @property
    def full_restart(self) -> bool:
        return self.victim.rsplit("-", 1)[0] in FULL_RESTART

    def __str__(self) -> str:
        return f"{self.victim} after step {self.after_step} + {self.delay_s:.2f}s"


@dataclasses.dataclass(frozen=True)
class Schedule:
    kills: tuple[Kill, ...]
    failpoints: tuple[str, ...]  # name@key

    def env(self, directory: Path) -> dict[str, str]:
        return {failpoints.ENV: ",".join(self.failpoints), failpoints.DIR_ENV: str(directory)}

    def __str__(self) -> str:
        return "; ".join([*map(str, self.kills), *(f"failpoint {f}" for f in self.failpoints)])


def chaos_schedule(seed: int, *, steps: int, workers: int, keys: Sequence[int]) -> Schedule:
    """A seeded schedule over every component kind: one kill of a worker, the verifier and
    the parameter server at random moments, two of them close together (same step, under
    0.3 s apart); one kill of the trainer or the controller; and two failpoints, one that
    forces a restart (snapshot write, checkpoint save, or publish, in turn by seed) and one
    the run survives (the parameter server in the commit→persist window or mid-publish).
    `keys`: the steps / versions the failpoints may name (snapshots, checkpoints and
    published versions all happen there)."""
    rng = random.Random(seed)
    victims = [f"inference_worker-{rng.randrange(workers)}", "verifier-0", "param_server-0"]
    kills = [Kill(v, rng.randint(1, steps - 2), round(rng.uniform(0.0, 1.5), 2)) for v in victims]
    first, second = rng.sample(range(len(kills)), 2)
    close = kills[first]
    kills[second] = Kill(
        kills[second].victim, close.after_step, round(close.delay_s + rng.uniform(0.0, 0.3), 2)
    )
    full = rng.choice(["trainer-0", "controller"])
    kills.append(Kill(full, rng.randint(2, steps - 2), round(rng.uniform(0.0, 1.5), 2)))
    points = (
        f"{FULL_RESTART_FAILPOINTS[seed % len(FULL_RESTART_FAILPOINTS)]}@{rng.choice(keys)}",
        f"{ELASTIC_FAILPOINTS[seed % len(ELASTIC_FAILPOINTS)]}@{rng.choice(keys)}",
    )
    return Schedule(tuple(sorted(kills, key=lambda k: (k.after_step, k.delay_s))), points)


@dataclasses.dataclass
class Incarnation:
    """One `run` / `resume` process of a disturbed run."""

    command: str
    returncode: int = 0
    wall_s: float = 0.0
    kills: list[str] = dataclasses.field(default_factory=list)  # performed, with pid and step
    fired: list[str] = dataclasses.field(default_factory=list)  # failpoints that fired
    full_restart_kills: int = 0  # of those, the ones that stop the job
    leftovers: list[str] = dataclasses.field(default_factory=list)  # alive 30 s after the job
    stacks: dict[str, str] = dataclasses.field(default_factory=dict)  # theirs, for the report


@dataclasses.dataclass
class Disturbed:
    incarnations: list[Incarnation]
    missed: list[Kill]  # never performed: the run ended before their moment
    pids: set[int]  # every component process seen (processes.json) and every job process
    wall_s: float

    @property
    def restarts(self) -> int:
        return len(self.incarnations) - 1

    def report(self) -> str:
        lines = []
        for i, inc in enumerate(self.incarnations):
            what = ", ".join(inc.kills + [f"failpoint {f}" for f in inc.fired]) or "no kills"
            lines.append(
                f"  {inc.command} #{i}: exit {inc.returncode} in {inc.wall_s:.0f}s; {what}"
            )
            for name, stack in inc.stacks.items():
                lines.append(f"  left behind: {name}; its threads:\n{stack}")
        if self.missed:
            lines.append(f"  not performed (run over first): {', '.join(map(str, self.missed))}")
        return "\n".join(lines)


def run_disturbed(
    start: Callable[[dict[str, str]], Job],
    schedule: Schedule,
    *,
    failpoint_dir: Path,
    max_incarnations: int = 6,
    timeout_s: float = 600.0,
) -> Disturbed:
    """Run `start(env)` (the first `rlax-tpu run`), performing `schedule`'s kills, and
    `rlax-tpu resume` it after every exit that is not a finished run, until it finishes.
    Each incarnation starts only when every process of the one before has exited (a SIGTERMed
    trainer saves before it goes)."""
    failpoint_dir.mkdir(parents=True, exist_ok=True)
    env = schedule.env(failpoint_dir)
    pending = list(schedule.kills)
    incarnations: list[Incarnation] = []
    pids: set[int] = set()
    t_run = time.monotonic()
    job = start(env)
    run_dir = job.run_dir
    while True:
        inc = Incarnation(command=job.args[0])
        incarnations.append(inc)
        pids.add(job.process.pid)
        fired_before = set(os.listdir(failpoint_dir))
        armed: dict[Kill, float] = {}
        t0 = time.monotonic()
        seen: set[tuple[str, int]] = set()
        try:
            while job.process.poll() is None:
                assert time.monotonic() - t0 < timeout_s, f"{inc.command} made no end"
                children = job.children()
                seen.update(children.items())
                pids.update(children.values())
                consumed = consumed_steps(run_dir)
                now = time.monotonic()
                for kill in list(pending):
                    pid = (
                        job.process.pid
                        if kill.victim == "controller"
                        else children.get(kill.victim)
                    )
                    if not children or pid is None or not alive(pid):
                        continue  # components not all up yet, or the victim is restarting
                    if consumed < kill.after_step:
                        continue
                    if now - armed.setdefault(kill, now) < kill.delay_s:
                        continue
                    os.kill(pid, signal.SIGKILL)
                    pending.remove(kill)
                    inc.kills.append(f"{kill.victim} (pid {pid}) at step {consumed}")
                    inc.full_restart_kills += kill.full_restart
                time.sleep(0.05)
        finally:
            inc.returncode = job.wait(60)
            inc.wall_s = time.monotonic() - t0
            job.log.close()
        fired = sorted(set(os.listdir(failpoint_dir)) - fired_before)
        inc.fired = fired
        inc.full_restart_kills += sum(f.split(".")[0] in FULL_RESTART for f in fired)
        # Every process of this incarnation must be gone soon after the job (it stops its
        # children; a SIGKILLed job's children get SIGTERM, and a trainer saves first); any
        # still there is a leftover, ended here before the next incarnation starts.
        deadline = time.monotonic() + 30
        while any(alive(pid) for _, pid in seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        inc.leftovers = sorted(f"{name} (pid {pid})" for name, pid in seen if alive(pid))
        inc.stacks = {name: _stack(pid) for name, pid in seen if alive(pid)}
        wait_gone([pid for _, pid in seen], kill_after_s=0)
        finished = inc.returncode == 0
        if finished or len(incarnations) >= max_incarnations:
            break
        (run_dir / "logs" / "processes.json").unlink(missing_ok=True)
        job = Job(["resume", str(run_dir)], run_dir, env=env)
    return Disturbed(incarnations, pending, pids, time.monotonic() - t_run)
