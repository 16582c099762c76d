"""End-to-end runs of `rlax-tpu run` (launcher + every component + controller) on loopback.

One small off-policy run (η=2, N=3) is the reference. The same config run again gives the
same weights; runs whose controller, inference worker or trainer is SIGKILLed mid-run and
then resumed end with the same weights too, never train a rollout twice, and never train
on a rollout staler than N. A tiny SFT warm start makes rewards (and so gradients) non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import ProcessGroup
from tiny_job import tiny_job_config, write_config

from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    DatasetConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
)
from rlax_tpu.controller.snapshots import RolloutLog, SnapshotStore, snapshot_name
from rlax_tpu.staleness import StalenessPolicy
from rlax_tpu.verifiers.tasks import arithmetic_problems

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8


def e2e_config(
    run_dir: Path, data: Path, *, workers: int = 1, restarts: int = 3, **staleness
) -> RunConfig:
    return tiny_job_config(
        "e2e",
        run_dir,
        seed=3,
        staleness=StalenessConfig(**staleness),
        inference={"num_workers": workers, "gpu_memory_fraction": 0.2},
        trainer={"learning_rate": 1e-3, "checkpoint_every": 2},
        controller=ControllerConfig(
            num_steps=STEPS,
            prompts_per_batch=2,
            samples_per_prompt=4,
            datasets=(DatasetConfig(path=str(data), verifier="arithmetic"),),
            dynamic_sampling=True,
            dynamic_sampling_max_rounds=2,
            sft_steps=40,
            sft_learning_rate=3e-3,
            keep_snapshots=10,
            component_restarts=restarts,
        ),
    )


class Job:
    """`rlax-tpu run CONFIG` (or `resume`) as a child process; every process it started is
    killed at `cleanup` if still alive (they are found in the run's logs/processes.json)."""

    def __init__(self, args: list[str], run_dir: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.log = open(run_dir.parent / f"{run_dir.name}.job.log", "ab")  # noqa: SIM115
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        env.pop("XLA_FLAGS", None)  # the job sets its own device count (cpu_devices)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlax_tpu", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )

    def children(self) -> dict[str, int]:
        path = self.run_dir / "logs" / "processes.json"
        if not path.exists():
            return {}
        return {name: entry["pid"] for name, entry in json.loads(path.read_text()).items()}

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


def consumed_steps(run_dir: Path) -> int:
    directory = run_dir / "consumed"
    return len(list(directory.glob("batch_*.json"))) if directory.exists() else 0


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = root / "sums.jsonl"
    rows = arithmetic_problems(11, 64, max_operand=4, ops=("+",))
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, data


def start_run(
    workspace,
    name: str,
    *,
    warm_from: Path | None = None,
    replay: bool = False,
    workers: int = 1,
    restarts: int = 3,
    **staleness,
) -> Job:
    root, data = workspace
    run_dir = root / name
    staleness = staleness or {"reload_every": 2, "max_staleness": 3}
    config = e2e_config(run_dir, data, workers=workers, restarts=restarts, **staleness)
    if replay:  # TBA: trajectory balance trained on batches sampled from the replay buffer
        config = dataclasses.replace(
            config,
            controller=dataclasses.replace(
                config.controller,
                replay=True,
                replay_sync_every=2,
                replay_per_prompt_cap=6,
                replay_prefill_batches=1,
            ),
            trainer=dataclasses.replace(
                config.trainer, algorithm=AlgorithmConfig(name="trajectory_balance")
            ),
        )
    if warm_from is not None:  # reuse the reference's SFT warm start: same bits, less time
        run_dir.mkdir()
        for part in ("checkpoints_warm_start", "tokenizer"):
            shutil.copytree(warm_from / part, run_dir / part)
    path = write_config(config, root / f"{name}.json")
    return Job(["run", str(path)], run_dir)


@pytest.fixture(scope="module")
def reference(workspace):
    job = start_run(workspace, "reference")
    try:
        assert job.wait() == 0, job.output()[-5000:]
    finally:
        job.cleanup()
    return job.run_dir


def test_an_off_policy_run_trains_every_batch_once_within_the_staleness_bound(reference):
    result = summary(reference)
    assert result["start_step"] == 0 and result["end_step"] == STEPS
    assert result["rejected_stale"] == 0
    log = RolloutLog(str(reference))
    consumed = log.consumed()
    assert sorted(consumed) == list(range(STEPS))
    seen = set()
    for batch, rows in consumed.items():
        assert len(rows) == len(set(rows)) == 2 * 4
        logged = log.read_batch(batch)
        for prompt_id, sample, version in rows:
            assert 0 <= batch - version <= 3  # b - version <= N
            assert version % 2 == 0  # workers load only multiples of η
            assert (prompt_id, sample, version) in logged  # persisted before it was trained
            assert (prompt_id, sample) not in seen  # no rollout trained twice
            seen.add((prompt_id, sample))
    # Generation ran ahead: batch 3 was generated with version 0 (g(3) = 0 for η=2, N=3).
    assert {v for _, _, v in consumed[3]} == {0}
    # Training changed the weights, and the metrics say what happened.
    metrics = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert any(m["reward_mean"] > 0 for m in metrics)
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    assert SnapshotStore(str(reference), keep=10).steps() == [0, 2, 4, 6, 8]
    # Only what a worker may load (multiples of η) and the final version were ever
    # persisted, and the parameter server garbage-collected, on disk too, what neither a
    # resume from the last snapshot nor the worker (which last loaded batch 7's version)
    # still needs.
    kept = sorted(int(v) for v in os.listdir(reference / "params" / "versions"))
    policy = StalenessPolicy(reload_every=2, max_staleness=3)
    oldest = min(policy.oldest_needed(STEPS), policy.scheduled_version(STEPS - 1))
    assert oldest > 0 and kept == policy.published(oldest, STEPS, STEPS), kept
    assert all(v % 2 == 0 or v == STEPS for v in kept)


def test_the_same_config_and_seed_give_the_same_weights(workspace, reference):
    job = start_run(workspace, "again")  # its own SFT warm start, from scratch
    try:
        assert job.wait() == 0, job.output()[-5000:]
    finally:
        job.cleanup()
    assert summary(job.run_dir)["final_digest"] == summary(reference)["final_digest"] != ""
    assert RolloutLog(str(job.run_dir)).consumed() == RolloutLog(str(reference)).consumed()


# Killing the controller is the default-suite case; the other victims run with -m slow
# (the suite's 20-minute budget; each takes ~30 s).
@pytest.mark.parametrize(
    "victim",
    [
        "controller",
        pytest.param("inference_worker-0", marks=pytest.mark.slow),
        pytest.param("trainer-0", marks=pytest.mark.slow),
    ],
)
def test_a_run_killed_mid_way_resumes_to_the_same_weights(workspace, reference, victim):
    # No restarts: a lost worker stops the run as a lost trainer does (then resumed).
    job = start_run(workspace, f"killed_{victim}", warm_from=reference, restarts=0)
    try:
        kill_mid_run(job, victim)
    finally:
        job.cleanup()

    resumed = Job(["resume", str(job.run_dir)], job.run_dir)
    try:
        assert resumed.wait() == 0, resumed.output()[-5000:]
    finally:
        resumed.cleanup()
    result = summary(job.run_dir)
    assert 0 < result["start_step"] < STEPS  # it resumed rather than starting over
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(job.run_dir)).consumed() == RolloutLog(str(reference)).consumed()


def kill_mid_run(
    job: Job, victim: str = "controller", *, wait: bool = True, after_steps: int = 3
) -> int:
    """SIGKILL `victim` once `after_steps` steps are consumed and the components run
    (`wait`: until the job exits); its pid."""
    deadline = time.monotonic() + 300
    while consumed_steps(job.run_dir) < after_steps or (
        victim != "controller" and not job.children()
    ):
        assert job.process.poll() is None, job.output()[-5000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    children = job.children()
    if victim == "controller":
        pid = job.process.pid
        job.process.kill()  # the launcher and controller die at once; children get SIGTERM
    else:
        pid = children[victim]
        os.kill(pid, signal.SIGKILL)
    if wait:
        job.wait(120)
        assert consumed_steps(job.run_dir) < STEPS, "the run finished before the kill"
        wait_gone(children.values(), kill_after_s=60)
    return pid


# Elastic recovery: a lost worker (one of two), verifier or parameter server is started again
# by the launcher while the run goes on. Killing a worker is the default-suite case: it dies
# as the components come up, so its share of the first batch certainly moves to the other
# worker (8 steps on two workers can end before a restarted one is back).
@pytest.mark.parametrize(
    ("victim", "workers", "after_steps"),
    [
        ("inference_worker-1", 2, 0),
        pytest.param("verifier-0", 1, 3, marks=pytest.mark.slow),
        pytest.param("param_server-0", 1, 3, marks=pytest.mark.slow),
    ],
)
def test_a_lost_component_costs_a_restart_of_it_alone_and_the_same_weights(
    workspace, reference, victim, workers, after_steps
):
    job = start_run(workspace, f"elastic_{victim}", warm_from=reference, workers=workers)
    try:
        killed = kill_mid_run(job, victim, wait=False, after_steps=after_steps)
        assert job.wait() == 0, job.output()[-5000:]
        output = job.output()
    finally:
        job.cleanup()
    assert not alive(killed)
    result = summary(job.run_dir)
    assert result["start_step"] == 0 and result["end_step"] == STEPS  # it never resumed
    assert f"{victim} (pid {killed}) exited" in output
    if victim.startswith("inference_worker"):  # its work moved: the run did not wait for it
        assert "inference worker 1 (" in output and "its requests go to the other" in output
    else:  # the run waited for the restarted component
        assert f"{victim} is back" in output
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(job.run_dir)).consumed() == RolloutLog(str(reference)).consumed()


@pytest.mark.slow  # ~40 s: the default suite runs close to its 20-minute budget
def test_a_restarted_controller_reattaches_to_the_components_still_running(workspace, reference):
    """`run --connect` (components elsewhere, as on GKE) killed mid-run and started again: it
    drives the same processes, the trainer keeps its state rather than restoring a
    checkpoint, and the weights equal the uninterrupted run's."""
    root, data = workspace
    run_dir = root / "reattach"
    run_dir.mkdir()
    for part in ("checkpoints_warm_start", "tokenizer"):
        shutil.copytree(reference / part, run_dir / part)
    config = e2e_config(run_dir, data, reload_every=2, max_staleness=3)
    path = str(write_config(config, root / "reattach.json"))
    token, env = "reattach-token", {"XLA_FLAGS": ""}
    group = ProcessGroup()
    try:
        ps, trainer, worker = group.start_run_components(path, str(run_dir), token=token, env=env)
        verifier = group.start_verifier(token=token, test_data_cache=str(root / "cache"))
        connect = {
            "RLAX_TPU_AUTH_TOKEN": token,
            "RLAX_TPU_PARAM_SERVER": ps.address,
            "RLAX_TPU_TRAINER": trainer.address,
            "RLAX_TPU_INFERENCE": worker.address,
            "RLAX_TPU_VERIFIER": verifier.address,
        }
        first = Job(["run", path, "--connect"], run_dir, env=connect)
        try:
            kill_mid_run(first, "controller")
        finally:
            first.cleanup()
        second = Job(["run", path, "--connect"], run_dir, env=connect)
        try:
            assert second.wait() == 0, second.output()[-5000:]
        finally:
            second.cleanup()
        assert all(p.running() for p in (ps, trainer, worker, verifier))  # none restarted
        trainer_lines = "\n".join(trainer.stdout_lines)
    finally:
        group.stop_all()
    result = summary(run_dir)
    assert 0 < result["start_step"] < STEPS  # it resumed from its snapshot ...
    assert "kept its state at step" in trainer_lines  # ... without restoring the trainer
    assert "restoring the checkpoint" not in trainer_lines
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(run_dir)).consumed() == RolloutLog(str(reference)).consumed()


@pytest.mark.slow  # ~50 s: over the default suite's budget
def test_replay_mode_samples_within_the_staleness_bound_and_resumes_exactly(workspace, reference):
    uninterrupted = start_run(
        workspace, "replay", warm_from=reference, replay=True, reload_every=1, max_staleness=2
    )
    try:
        assert uninterrupted.wait() == 0, uninterrupted.output()[-5000:]
    finally:
        uninterrupted.cleanup()
    consumed = RolloutLog(str(uninterrupted.run_dir)).consumed()
    assert sorted(consumed) == list(range(STEPS))
    for batch, rows in consumed.items():
        assert all(0 <= batch - version <= 2 for _, _, version in rows)
    # Older batches' rollouts were replayed: some step trains on data of an earlier batch.
    assert any(
        not p.startswith(f"b{batch}:") for batch, rows in consumed.items() for p, _, _ in rows
    )
    # The buffer was pre-filled before step 0: one batch of "pre0:" prompts, version 0.
    logged = RolloutLog(str(uninterrupted.run_dir)).read_batch(0)
    prefilled = [key for key in logged if key[0].startswith("pre0:")]
    assert len(prefilled) == 2 * 4 and {v for _, _, v in prefilled} == {0}

    killed = start_run(
        workspace,
        "replay_killed",
        warm_from=reference,
        replay=True,
        reload_every=1,
        max_staleness=2,
    )
    try:
        kill_mid_run(killed)
    finally:
        killed.cleanup()
    resumed = Job(["resume", str(killed.run_dir)], killed.run_dir)
    try:
        assert resumed.wait() == 0, resumed.output()[-5000:]
    finally:
        resumed.cleanup()
    assert 0 < summary(killed.run_dir)["start_step"] < STEPS
    assert summary(killed.run_dir)["final_digest"] == summary(uninterrupted.run_dir)["final_digest"]
    assert RolloutLog(str(killed.run_dir)).consumed() == consumed


def test_the_off_policy_preset_evaluates_the_newest_version_workers_may_load(workspace, reference):
    """`--set staleness=off_policy` (η = 16, N = 32) with the demo's eval_every = 20 used to
    die at step 20, asking workers for version 20, which they refuse. Evaluations measure
    the newest loadable version at or before their step, and say which."""
    root, data = workspace
    run_dir = root / "off_policy_eval"
    config = e2e_config(run_dir, data)
    config = dataclasses.replace(
        config,
        staleness=StalenessConfig.PRESETS["off_policy"](),
        controller=dataclasses.replace(
            config.controller,
            num_steps=24,
            eval_dataset=str(data),
            eval_size=8,
            eval_every=20,
        ),
    )
    run_dir.mkdir()
    for part in ("checkpoints_warm_start", "tokenizer"):
        shutil.copytree(reference / part, run_dir / part)
    job = Job(["run", str(write_config(config, root / "off_policy_eval.json"))], run_dir)
    try:
        assert job.wait() == 0, job.output()[-5000:]
    finally:
        job.cleanup()
    result = summary(run_dir)
    assert result["end_step"] == 24
    assert {int(k): v for k, v in result["eval_versions"].items()} == {0: 0, 20: 16, 24: 16}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {m["step"]: m["eval_version"] for m in metrics if "eval_version" in m}
    assert evals == {0: 0, 20: 16, 24: 16}


def test_on_policy_trains_only_on_rollouts_of_the_current_version(workspace, reference):
    job = start_run(workspace, "on_policy", warm_from=reference, reload_every=1, max_staleness=0)
    try:
        assert job.wait() == 0, job.output()[-5000:]
    finally:
        job.cleanup()
    for batch, rows in RolloutLog(str(job.run_dir)).consumed().items():
        assert {version for _, _, version in rows} == {batch}


def test_resume_refuses_a_changed_config_and_a_run_with_only_corrupt_snapshots(
    workspace, reference, tmp_path
):
    root, data = workspace
    # A different config on the run directory: refused before anything starts.
    changed = dataclasses.replace(e2e_config(reference, data), seed=4)
    result = subprocess.run(
        [sys.executable, "-m", "rlax_tpu", "run", str(write_config(changed, tmp_path / "c.json"))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "holds a run with config digest" in result.stderr

    # Every snapshot truncated: a clear error, never a fresh (divergent) start.
    broken = root / "broken"
    shutil.copytree(reference, broken, ignore=shutil.ignore_patterns("logs"))
    config = dataclasses.replace(
        e2e_config(broken, data), storage=StorageConfig(run_dir=str(broken))
    )
    (broken / "config.json").write_text(json.dumps(config.to_dict()))
    (broken / "config.sha256").write_text(config.digest() + "\n")
    for step in SnapshotStore(str(broken), keep=10).steps():
        path = broken / "snapshots" / snapshot_name(step)
        path.write_text(path.read_text()[:40])
    job = Job(["resume", str(broken)], broken)
    try:
        assert job.wait() != 0
    finally:
        job.cleanup()
    assert "no snapshot" in job.output() and "start a new run directory" in job.output()

    # Every checkpoint gone: the same refusal (the snapshots are intact but unusable).
    # (On the reference itself, whose config names its directory; put back afterwards.)
    checkpoints, aside = reference / "checkpoints", root / "checkpoints_aside"
    checkpoints.rename(aside)
    job = Job(["resume", str(reference)], reference)
    try:
        assert job.wait() != 0
    finally:
        job.cleanup()
        shutil.rmtree(checkpoints, ignore_errors=True)
        aside.rename(checkpoints)
    assert "does not load" in job.output() and "start a new run directory" in job.output()
