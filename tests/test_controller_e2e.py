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
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_job import (
    ELASTIC_FAILPOINTS,
    FULL_RESTART_FAILPOINTS,
    STEPS,
    Disturbed,
    Job,
    Kill,
    Schedule,
    alive,
    chaos_schedule,
    consumed_steps,
    e2e_config,
    run_disturbed,
    summary,
    wait_gone,
    write_data,
)
from jobenv import codegen_flags
from processes import ProcessGroup
from tiny_job import write_config

from rlax_tpu.config import (
    AlgorithmConfig,
    ReplayConfig,
    StalenessConfig,
    StorageConfig,
)
from rlax_tpu.controller.snapshots import RolloutLog, SnapshotStore, snapshot_name
from rlax_tpu.staleness import StalenessPolicy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = root / "sums.jsonl"
    write_data(data)
    return root, data


def start_run(
    workspace,
    name: str,
    *,
    warm_from: Path | None = None,
    replay: bool = False,
    workers: int = 1,
    restarts: int = 3,
    env: dict[str, str] | None = None,
    controller: dict | None = None,
    overrides: tuple[str, ...] = (),
    **staleness,
) -> Job:
    """The e2e job as `name`; `controller`: ControllerConfig fields to change; `overrides`:
    `--set`s of any field."""
    root, data = workspace
    run_dir = root / name
    staleness = staleness or {"reload_every": 2, "max_staleness": 3}
    config = e2e_config(run_dir, data, workers=workers, restarts=restarts, **staleness)
    if controller:
        config = dataclasses.replace(
            config, controller=dataclasses.replace(config.controller, **controller)
        )
    config = config.apply_overrides(overrides)
    if replay:  # TBA: trajectory balance trained on batches sampled from the replay buffer
        config = dataclasses.replace(
            config,
            controller=dataclasses.replace(
                config.controller,
                replay=ReplayConfig(
                    enabled=True, sync_every=2, per_prompt_cap=6, prefill_batches=1
                ),
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
    return Job(["run", str(path)], run_dir, env=env)


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
    # The job trains packed rows (e2e_config; only packed steps report these). Its
    # sequences are ~45 tokens of a padded 64, one a row: no less padding than padded.
    assert all(
        m["train/packing/padding_fraction"] <= m["train/packing/padding_fraction_padded"]
        for m in metrics
    )
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    snapshots = SnapshotStore(str(reference), keep=10)
    assert snapshots.steps() == [0, 2, 4, 6, 8]
    # The final snapshot resumes from the last step's own checkpoint, which exists (it once
    # named checkpoint 9 of an 8-step run, and a resume fell back and retrained).
    assert snapshots.read(STEPS).checkpoint_step == STEPS
    assert (reference / "checkpoints" / str(STEPS) / "commit_success.txt").exists()
    # Only what a worker may load (multiples of η) and the final version were ever
    # persisted, and the parameter server garbage-collected, on disk too, what neither a
    # resume from the last snapshot nor the worker (which last loaded batch 7's version)
    # still needs.
    kept = sorted(int(v) for v in os.listdir(reference / "params" / "versions"))
    policy = StalenessPolicy(reload_every=2, max_staleness=3)
    oldest = min(policy.oldest_needed(STEPS), policy.scheduled_version(STEPS - 1))
    assert oldest > 0 and kept == policy.published(oldest, STEPS, STEPS), kept
    assert all(v % 2 == 0 or v == STEPS for v in kept)


def test_the_same_config_and_seed_give_the_same_weights_also_after_a_crashed_warm_start(
    workspace, reference
):
    """The run again, its own SFT warm start from scratch, checkpointed every 10 of its 40
    steps (a resumable field: the same run), and its trainer SIGKILLed as SFT step 25 begins
    (a failpoint): the run stops naming the trainer, `rlax-tpu resume` continues the warm
    start from its newest complete checkpoint rather than 0 (step 20, or 10 when step 20's
    asynchronous save had not finished at the kill: never a half-written one), and the run
    ends on the reference's weights."""
    root, _ = workspace

    disturbed = run_disturbed(
        lambda env: start_run(
            workspace,
            "again",
            restarts=0,
            env=env,
            overrides=("trainer.warm_start.checkpoint_every=10",),
        ),
        Schedule(kills=(), failpoints=("trainer.sft_step@25",)),
        failpoint_dir=root / "again.failpoints",
    )
    report = disturbed.report()
    assert [i.returncode == 0 for i in disturbed.incarnations] == [False, True], report
    assert disturbed.incarnations[0].fired == ["trainer.sft_step@25"], report
    output = (root / "again.job.log").read_text(errors="replace")
    assert "ComponentFailed: trainer-0 (pid " in output and "was killed by SIGKILL" in output
    assert "Traceback" not in output
    resumed = re.findall(r"SFT warm start on the trainer: steps (\d+)\.\.39", output)
    assert resumed[0] == "0" and resumed[1:] in (["20"], ["10"]), output[-5000:]
    run_dir = root / "again"
    assert summary(run_dir)["final_digest"] == summary(reference)["final_digest"] != ""
    assert RolloutLog(str(run_dir)).consumed() == RolloutLog(str(reference)).consumed()


# Killing the controller is the default-suite case; the other victims run with -m slow
# (the suite's 20-minute budget; each takes ~30 s).
@pytest.mark.parametrize(
    "victim",
    [
        "controller",
        pytest.param("inference_worker-0", marks=pytest.mark.slow),
        pytest.param("trainer-0", marks=pytest.mark.slow),
        pytest.param("param_server-0", marks=pytest.mark.slow),
    ],
)
def test_a_run_killed_mid_way_resumes_to_the_same_weights(workspace, reference, victim):
    """Killed after 3 steps, then resumed. The first resume's trainer dies as it starts to
    restore the checkpoint (a failpoint): that resume stops saying the trainer did not
    answer and the run directory is intact, never that the snapshots are unusable, and the
    next resume finishes with the uninterrupted run's weights."""
    root, _ = workspace
    name = f"killed_{victim}"
    # No restarts: a lost worker stops the run as a lost trainer does (then resumed).
    schedule = Schedule(kills=(Kill(victim, 3),), failpoints=("trainer.restore@*",))
    disturbed = run_disturbed(
        lambda env: start_run(workspace, name, warm_from=reference, restarts=0, env=env),
        schedule,
        failpoint_dir=root / f"{name}.failpoints",
    )
    report = disturbed.report()
    assert [i.returncode == 0 for i in disturbed.incarnations] == [False, False, True], report
    assert not disturbed.missed and disturbed.incarnations[1].fired, report
    # The job stops soon after the kill: nothing waits out controller.component_wait_s
    # (300 s) for a component that will not come back (a trainer publishing to a lost
    # parameter server did, until the launcher stopped it).
    assert disturbed.incarnations[0].wall_s < 120, report
    assert all(not i.leftovers for i in disturbed.incarnations), report
    output = (root / f"{name}.job.log").read_text(errors="replace")
    assert "start the trainer again, then `rlax-tpu resume`" in output
    assert "Traceback" not in output
    if victim != "controller":  # the stop names the process, how it died, and the resume
        assert f"ComponentFailed: {victim} (pid " in output and "was killed by SIGKILL" in output
        assert f"`rlax-tpu resume {root / name}` continues from there" in output
    assert "is usable" not in output and "start a new run directory" not in output
    run_dir = root / name
    result = summary(run_dir)
    assert 0 < result["start_step"] < STEPS  # it resumed rather than starting over
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(run_dir)).consumed() == RolloutLog(str(reference)).consumed()


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
# by the launcher while the run goes on. The worker dies as the components come up, so its
# share of the first batch certainly moves to the other worker (8 steps on two workers can
# end before a restarted one is back). All -m slow: the default suite's chaos test
# (test_chaos_short_…) kills each of them in one run.
@pytest.mark.parametrize(
    ("victim", "workers", "after_steps"),
    [
        pytest.param("inference_worker-1", 2, 0, marks=pytest.mark.slow),
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
    assert f"{victim} (pid {killed}) was killed by SIGKILL; starting it again" in output
    if victim.startswith("inference_worker"):  # its work moved: the run did not wait for it
        assert "inference worker 1 (" in output and "its requests go to the other" in output
    else:  # the run waited for the restarted component
        assert f"{victim} is back" in output
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(job.run_dir)).consumed() == RolloutLog(str(reference)).consumed()


def test_frozen_components_are_given_up_fenced_and_rejoin_with_the_same_weights(
    workspace, reference
):
    """Liveness: components frozen with SIGSTOP (alive, silent) on a run watching them with
    2-second health checks. Inference worker 1 of 2 is frozen as the components come up: its
    work goes to worker 0. After step 1 the verifier, already connected, is frozen for 5 s
    inside a call: the run waits for it. After step 2 worker 0 is frozen and worker 1 thawed:
    the run goes on only if worker 0's calls are given up and worker 1 rejoins. Worker 0 is
    thawed once worker 1 is back: whatever it still sends is ignored. No resume, and the
    weights are the reference's."""
    job = start_run(
        workspace, "frozen", warm_from=reference, workers=2, controller={"liveness_timeout_s": 2}
    )
    frozen: set[int] = set()

    def freeze(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        frozen.add(pid)

    def thaw(pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        frozen.discard(pid)

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 240
        while not condition():
            assert job.process.poll() is None, (
                f"the run ended before {what}:\n" + job.output()[-5000:]
            )
            assert time.monotonic() < deadline, f"no {what}:\n" + job.output()[-5000:]
            time.sleep(0.05)

    try:
        until(lambda: len(job.children()) == 5, "components")
        pids = job.children()
        freeze(pids["inference_worker-1"])
        until(lambda: consumed_steps(job.run_dir) >= 1, "step 1")
        freeze(pids["verifier-0"])
        time.sleep(5)
        thaw(pids["verifier-0"])
        until(lambda: consumed_steps(job.run_dir) >= 2, "step 2")
        freeze(pids["inference_worker-0"])  # batches 6-8 need version 3: it gets their work
        given_up = f"inference worker 0 ({job_address(job.output(), 0)}) {SILENT}"
        until(lambda: given_up in job.output(), "worker 0 given up")
        thaw(pids["inference_worker-1"])
        back = f"inference worker 1 ({job_address(job.output(), 1)}) answers again"
        until(lambda: back in job.output(), "worker 1 back")
        thaw(pids["inference_worker-0"])
        assert job.wait() == 0, job.output()[-5000:]
        output = job.output()
    finally:
        for pid in list(frozen):
            thaw(pid)
        job.cleanup()
    silent_verifier = "the verifier service does not answer (verifier service 127.0.0.1:"
    assert silent_verifier in output and "waiting up to" in output, output[-5000:]
    assert output.count(SILENT) >= 2, output[-5000:]
    assert "(controller.liveness_timeout_s = 2s)" in output
    result = summary(job.run_dir)
    assert result["start_step"] == 0 and result["end_step"] == STEPS  # it never resumed
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(job.run_dir)).consumed() == RolloutLog(str(reference)).consumed()


def test_ctrl_c_in_generation_is_acknowledged_stops_in_seconds_and_resumes_the_same(
    workspace, reference
):
    """Ctrl-C (SIGINT to the job's process group, as a terminal sends it) while a batch is
    being generated (its worker held with SIGSTOP, so the call cannot end): a line says at
    once what stopping does, the run stops within seconds with a snapshot and the resume
    command, and the resume ends on the uninterrupted run's weights."""
    root, _ = workspace
    job = start_run(workspace, "ctrl_c", warm_from=reference)
    worker = 0
    try:
        deadline = time.monotonic() + 240
        while consumed_steps(job.run_dir) < 1 or "inference_worker-0" not in job.children():
            assert job.process.poll() is None and time.monotonic() < deadline, job.output()
            time.sleep(0.05)
        worker = job.children()["inference_worker-0"]
        os.kill(worker, signal.SIGSTOP)  # the batch in generation cannot finish
        time.sleep(1)
        t0 = time.monotonic()
        job.interrupt()
        while "Ctrl-C: stopping" not in job.output():
            assert time.monotonic() - t0 < 10, job.output()[-5000:]
            time.sleep(0.02)
        acknowledged = time.monotonic() - t0
        os.kill(worker, signal.SIGCONT)
        worker = 0
        code = job.wait(120)
        stopped = time.monotonic() - t0
        output = job.output()
    finally:
        if worker:
            os.kill(worker, signal.SIGCONT)
        job.cleanup()
    assert code == 130, output[-5000:]
    assert acknowledged < 2 and stopped < 30, (acknowledged, stopped)
    assert f"continue with: rlax-tpu resume {root / 'ctrl_c'}" in output
    assert "Traceback" not in output, output[-5000:]
    # Workers stopped by the run itself are not reported as lost.
    after = output[output.index("Ctrl-C: stopping") :]
    assert "does not answer" not in after and SILENT not in after, after[-5000:]
    resumed = Job(["resume", str(root / "ctrl_c")], root / "ctrl_c")
    try:
        assert resumed.wait() == 0, resumed.output()[-5000:]
    finally:
        resumed.cleanup()
    result = summary(root / "ctrl_c")
    assert 0 < result["start_step"] < STEPS  # it resumed from the stop's snapshot
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert RolloutLog(str(root / "ctrl_c")).consumed() == RolloutLog(str(reference)).consumed()


SILENT = "has not answered a health check for"


def job_address(output: str, worker: int) -> str:
    """Worker `worker`'s address, from the run's "components ready" line."""
    ready = re.search(r"'inference_worker': \[([^\]]*)\]", output)
    assert ready, output[-5000:]
    return ready.group(1).replace("'", "").split(", ")[worker]


# -- chaos: components killed at random moments and inside narrow windows ---------------
CHAOS_WORKERS = 2
# Steps and versions where snapshots, checkpoints and publishes happen (η=2, every 2 steps).
CHAOS_KEYS = (2, 4, 6)


def run_chaos(workspace, reference, name: str, schedule: Schedule, **run) -> tuple[Disturbed, Path]:
    """`run`: more of `start_run`'s arguments (overrides, staleness)."""
    root, _ = workspace
    disturbed = run_disturbed(
        lambda env: start_run(
            workspace, name, warm_from=reference, workers=CHAOS_WORKERS, env=env, **run
        ),
        schedule,
        failpoint_dir=root / f"{name}.failpoints",
    )
    print(f"\n{name}: {schedule}\n{disturbed.report()}")
    return disturbed, root / name


def assert_survived(disturbed: Disturbed, run_dir: Path, reference: Path, schedule) -> None:
    """The run finished with the undisturbed run's weights and consumed rollouts (none
    trained twice or lost), left no process behind, and restarted only where a trainer or
    controller died; every failpoint fired."""
    report = disturbed.report()
    incarnations = disturbed.incarnations
    assert incarnations[-1].returncode == 0, report
    for inc in incarnations:
        assert not inc.leftovers, report
        # A job stops only when a trainer or controller died in it; elastic kills never.
        assert (inc.returncode != 0) <= (inc.full_restart_kills > 0), report
    assert disturbed.restarts <= sum(i.full_restart_kills for i in incarnations), report
    fired = sorted(f for inc in incarnations for f in inc.fired)
    assert fired == sorted(schedule.failpoints), report
    assert all(not alive(pid) for pid in disturbed.pids), report
    assert summary(run_dir)["final_digest"] == summary(reference)["final_digest"], report
    assert RolloutLog(str(run_dir)).consumed() == RolloutLog(str(reference)).consumed(), report


def test_chaos_short_every_elastic_kill_at_once_costs_no_restart(workspace, reference):
    """The default suite's chaos run: a worker, then the verifier and the parameter server
    killed 0.1 s apart, and the parameter server killed again inside the window between a
    version's commit in memory and its manifest on storage. The run never restarts."""
    schedule = Schedule(
        kills=(
            Kill("inference_worker-1", 1, 0.3),
            Kill("verifier-0", 2, 0.0),
            Kill("param_server-0", 2, 0.1),
        ),
        failpoints=("param_server.persist@4",),
    )
    disturbed, run_dir = run_chaos(workspace, reference, "chaos_short", schedule)
    assert_survived(disturbed, run_dir, reference, schedule)
    assert disturbed.restarts == 0 and not disturbed.missed, disturbed.report()


# ~2-3 min each; `-m slow`. The schedule draws every component kind (elastic kills at random
# moments, two close together, a trainer or controller kill) and two failpoints, one of
# each list in turn by seed: over seeds 0-4 every failpoint fires.
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_chaos_seeded_kills_of_every_component_end_with_the_same_weights(
    workspace, reference, seed
):
    schedule = chaos_schedule(seed, steps=STEPS, workers=CHAOS_WORKERS, keys=CHAOS_KEYS)
    kinds = {k.victim.rsplit("-", 1)[0] for k in schedule.kills}
    assert {"inference_worker", "verifier", "param_server"} <= kinds
    assert kinds & {"trainer", "controller"}
    names = [f.split("@")[0] for f in schedule.failpoints]
    assert names[0] in FULL_RESTART_FAILPOINTS and names[1] in ELASTIC_FAILPOINTS
    disturbed, run_dir = run_chaos(workspace, reference, f"chaos_{seed}", schedule)
    assert_survived(disturbed, run_dir, reference, schedule)
    assert disturbed.restarts >= 1  # the trainer or controller kill, or the failpoint


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
    # The components set their own device count; the suite's code generation, as the
    # reference run's (tests/jobenv.py).
    token, env = "reattach-token", {"XLA_FLAGS": codegen_flags()}
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
    the newest loadable version at or before their step, and say which; the last one
    measures the final weights (version 24), which workers load for it alone."""
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
            # The held-out set is the training file: a run refuses it unless told to accept.
            max_eval_overlap=1.0,
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
    assert {int(k): v for k, v in result["eval_versions"].items()} == {0: 0, 20: 16, 24: 24}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {m["step"]: m["eval_version"] for m in metrics if "eval_version" in m}
    assert evals == {0: 0, 20: 16, 24: 24}
    output = job.output()
    # The console names the version an evaluation measured where it is not the step's.
    assert "held-out greedy accuracy: " in output and "at step 24\n" in output
    assert any(
        line.startswith("step   20/24") and "(version 16)" in line for line in output.splitlines()
    )
    # It ran with the knob raised, and said how much of the held-out set it trains on.
    assert {m["dataset/eval_overlap"] for m in metrics if "reward_mean" in m} == {1.0}


def test_on_policy_trains_only_on_rollouts_of_the_current_version(workspace, reference):
    """On policy, co-located: each batch generates with the version of the step before it,
    which the worker loads within the trainer's step call; the same run disaggregated (the
    worker Loads each version from the parameter server) trains bitwise the same rollouts
    to the same weights."""
    runs = {}
    for name, overrides in (("on_policy", ("inference.colocated=true",)), ("apart", ())):
        staleness = {"reload_every": 1, "max_staleness": 0}
        job = start_run(workspace, name, warm_from=reference, overrides=overrides, **staleness)
        try:
            assert job.wait() == 0, job.output()[-5000:]
        finally:
            job.cleanup()
        runs[name] = job.run_dir
    run_dir = runs["on_policy"]
    for batch, rows in RolloutLog(str(run_dir)).consumed().items():
        assert {version for _, _, version in rows} == {batch}
    # Each batch but the first started as soon as its version existed, before the previous
    # step's bookkeeping, except where an evaluation of that version came first.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"] for r in rows if "eval_accuracy" in r and 0 < r["step"] < STEPS}
    result = summary(run_dir)
    assert result["batches_launched_early"] == STEPS - 1 - len(evaluated)
    # Each of those batches' version was loaded within the trainer's step call (TrainStep's
    # load_colocated), so the controller made no Load call for it.
    assert result["loads_with_step"] == result["batches_launched_early"]
    loaded_with_step = [r for r in rows if "train/time/colocated_handover_s" in r]
    assert len(loaded_with_step) == result["loads_with_step"]
    apart = summary(runs["apart"])
    assert apart["loads_with_step"] == 0 and apart["final_digest"] == result["final_digest"]
    assert_same_rollouts(runs["apart"], run_dir)


def test_a_colocated_run_killed_with_its_trainer_resumes_to_the_disaggregated_runs_weights(
    workspace, reference
):
    """inference.colocated: the one worker runs inside the trainer's process and takes each
    version from it, not from the parameter server. SIGKILLed with its trainer after 3 steps
    and resumed (co-located again), the run trains bitwise the reference's rollouts and ends
    with its weights: co-location changes where the worker runs, not what it generates."""
    colocated = ("inference.colocated=true",)
    job = start_run(workspace, "colocated", warm_from=reference, restarts=0, overrides=colocated)
    try:
        killed = kill_mid_run(job, "trainer-0")
        children = job.children()
        first = job.output()
        job.cleanup()
        job = Job(["resume", str(job.run_dir)], job.run_dir)
        assert job.wait() == 0, job.output()[-5000:]
        output = job.output()
    finally:
        job.cleanup()
    # One process served both; no worker process was started.
    assert children["inference_worker-0"] == children["trainer-0"] == killed
    assert not (job.run_dir / "logs" / "inference_worker-0.log").exists()
    handed = "loaded the weights of version 0 from the trainer in this process"
    assert handed in first and "[trainer-0]" in first
    assert "ComponentFailed: trainer-0 (pid " in first
    result = summary(job.run_dir)
    # Off policy the next batch is already generating when a step ends: the worker loads
    # each version when its job comes, never within the trainer's step call.
    assert result["loads_with_step"] == 0
    assert 0 < result["start_step"] < STEPS
    assert result["final_digest"] == summary(reference)["final_digest"]
    assert_same_rollouts(job.run_dir, reference)
    assert "loaded the weights of version" in output


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
    shutil.copytree(reference, broken, ignore=shutil.ignore_patterns("logs", "summary.json"))
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
    # (On the reference itself, whose config names its directory; put back afterwards. Its
    # summary goes aside too: a finished run is not started again, whatever it holds.)
    checkpoints, aside = reference / "checkpoints", root / "checkpoints_aside"
    finished, finished_aside = reference / "summary.json", root / "summary_aside.json"
    checkpoints.rename(aside)
    finished.rename(finished_aside)
    job = Job(["resume", str(reference)], reference)
    try:
        assert job.wait() != 0
    finally:
        job.cleanup()
        shutil.rmtree(checkpoints, ignore_errors=True)
        aside.rename(checkpoints)
        finished_aside.rename(finished)
    assert "does not load" in job.output() and "start a new run directory" in job.output()


# -- in-flight weight updates (mixed-version rollouts) ---------------------------------------
def check_mixed_version_run(run_dir: Path) -> list[dict]:
    """Every trained rollout's every token within [b - N, b - 1] of its batch (N = 3, η = 1:
    a response spans 2 ticks), some rollouts generated by two versions; the metrics rows."""
    log = RolloutLog(str(run_dir))
    mixed = 0
    for batch, rows in log.consumed().items():
        logged = log.rollouts(batch)
        for key in rows:
            record = logged[tuple(key)]
            assert all(max(0, batch - 3) <= v <= max(0, batch - 1) for v in record.versions)
            mixed += record.mixed
    assert mixed > 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_rollouts(run_dir: Path, reference: Path) -> None:
    """Every trained rollout is bitwise the reference run's: tokens, behaviour log-probs and
    the version of each token (the weights' digest alone would not see log-probs that
    differ by rounding where the objective recomputes them)."""
    log, ref = RolloutLog(str(run_dir)), RolloutLog(str(reference))
    consumed = log.consumed()
    assert consumed == ref.consumed()
    for batch, rows in consumed.items():
        got, want = log.rollouts(batch), ref.rollouts(batch)
        for key in map(tuple, rows):
            assert got[key] == want[key], (batch, key)


def killed_and_resumed(job: Job) -> Job:
    """`job` with its controller (and so the whole job) killed after 3 steps, then
    `rlax-tpu resume`d to its end: the resumed job."""
    try:
        kill_mid_run(job, "controller", after_steps=3)
        job.cleanup()
        job = Job(["resume", str(job.run_dir)], job.run_dir)
        assert job.wait() == 0, job.output()[-5000:]
    finally:
        job.cleanup()
    return job


IN_FLIGHT = {"reload_every": 1, "max_staleness": 3}
# every response of 2+ tokens spans two ticks
IN_FLIGHT_SET = ("inference.tick_tokens=1",)


def in_flight_run(workspace, reference, mode: str, name: str) -> Job:
    overrides = (f"inference.in_flight_update={mode}", *IN_FLIGHT_SET)
    return start_run(workspace, name, warm_from=reference, overrides=overrides, **IN_FLIGHT)


def finished_in_flight_run(workspace, reference, mode: str, name: str) -> Path:
    """An uninterrupted `mode` run, checked: tokens within the bound, some responses carried
    into a second tick under another version."""
    job = in_flight_run(workspace, reference, mode, name)
    try:
        assert job.wait() == 0, job.output()[-5000:]
    finally:
        job.cleanup()
    metrics = check_mixed_version_run(job.run_dir)
    assert max(m.get("rollout/partial_fraction", 0) for m in metrics) > 0
    assert max(m.get("rollout/version_span", 0) for m in metrics) >= 1
    assert summary(job.run_dir)["continued"] > 0
    return job.run_dir


@pytest.fixture(scope="module")
def in_flight_reference(workspace, reference):
    """The uninterrupted run of each in-flight mode, run once per module on first use."""
    runs: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in runs:
            runs[mode] = finished_in_flight_run(workspace, reference, mode, f"in_flight_{mode}")
        return runs[mode]

    return get


# "keep" in the default suite (its lost KV pages are replayed), "resume" with -m slow.
@pytest.mark.parametrize("mode", ["keep", pytest.param("resume", marks=pytest.mark.slow)])
def test_an_in_flight_run_is_its_own_reproduction_across_a_kill(
    workspace, reference, in_flight_reference, mode
):
    """Responses carried into the next tick under the next version: a run whose controller
    (and with it the whole job) is killed mid-run and resumed ends with the uninterrupted
    run's weights and consumed rollouts — the partials in the rollout log carry each
    response on from where it was; under "keep" the restarted workers replay the KV pages
    they lost under the versions that made them."""
    whole_run = in_flight_reference(mode)
    job = killed_and_resumed(in_flight_run(workspace, reference, mode, f"in_flight_{mode}_killed"))
    check_mixed_version_run(job.run_dir)
    killed, whole = summary(job.run_dir), summary(whole_run)
    assert 0 < killed["start_step"] < STEPS
    assert killed["final_digest"] == whole["final_digest"]
    assert_same_rollouts(job.run_dir, whole_run)


# ~2-3 min each; `-m slow`: the seeded chaos schedules on runs of each in-flight mode.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["keep", "resume"])
@pytest.mark.parametrize("seed", range(3))
def test_chaos_seeded_kills_of_an_in_flight_run_end_with_its_weights(
    workspace, reference, in_flight_reference, mode, seed
):
    schedule = chaos_schedule(seed, steps=STEPS, workers=CHAOS_WORKERS, keys=CHAOS_KEYS)
    overrides = (f"inference.in_flight_update={mode}", *IN_FLIGHT_SET)
    disturbed, run_dir = run_chaos(
        workspace, reference, f"chaos_{mode}_{seed}", schedule, overrides=overrides, **IN_FLIGHT
    )
    assert_survived(disturbed, run_dir, in_flight_reference(mode), schedule)
    assert_same_rollouts(run_dir, in_flight_reference(mode))


# A user environment from a file outside the package: two observations, then the answer.
EPISODE_ENVIRONMENT = """
from rlax_tpu.api.environments import Environment, StepResult

class Counting(Environment):
    def __init__(self, row, limits):
        self.prompt, self.steps = row["prompt"], 0

    def reset(self):
        return ({"role": "user", "content": self.prompt},)

    def step(self, action):
        self.steps += 1
        done = self.steps > 2
        observation = () if done else ({"role": "tool", "content": str(self.steps * 11)},)
        return StepResult(observation, 0.0, done, {"steps": self.steps})

    def state(self):
        return {"steps": self.steps}

    def restore(self, state):
        self.steps = state["steps"]

def factory(row, limits):
    return Counting(row, limits)
"""


def episode_run(workspace, name: str) -> Job:
    root, _ = workspace
    env_file = root / "counting_env.py"
    env_file.write_text(EPISODE_ENVIRONMENT)
    overrides = (
        "model.tokenizer=builtin:char_tools",
        f"controller.environment.name={env_file}:factory",
        "controller.environment.max_turns=3",
        "inference.max_prompt_len=46",
        "inference.max_new_tokens=18",
    )
    return start_run(workspace, name, overrides=overrides, reload_every=1, max_staleness=1)


# ~2 min: `-m slow` (tests/test_episodes.py resumes episodes bitwise at the pool's level in
# the default suite).
@pytest.mark.slow
def test_a_run_killed_in_the_middle_of_episodes_resumes_bitwise(workspace):
    """Multi-turn episodes with a user environment (warm start included, on demonstrations
    built as episodes): the whole job killed mid-run and resumed ends with the uninterrupted
    run's weights and every trained rollout bitwise, observations and masks included."""
    whole = episode_run(workspace, "episodes")
    try:
        assert whole.wait() == 0, whole.output()[-5000:]
    finally:
        whole.cleanup()
    metrics = [json.loads(x) for x in (whole.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("episode/turns", 0) for m in metrics) > 1
    job = killed_and_resumed(episode_run(workspace, "episodes_killed"))
    killed, uninterrupted = summary(job.run_dir), summary(whole.run_dir)
    assert 0 < killed["start_step"] < STEPS
    assert killed["final_digest"] == uninterrupted["final_digest"]
    assert_same_rollouts(job.run_dir, whole.run_dir)
    given = [
        r
        for batch in RolloutLog(str(job.run_dir)).consumed()
        for r in RolloutLog(str(job.run_dir)).rollouts(batch).values()
        if r.loss_mask is not None
    ]
    assert given  # episodes with observations were trained on

    # Each step's episode metrics (from the turns the pool keeps as it logs them, seeded
    # from the log on resume) are the uninterrupted run's.
    def episode_rows(run_dir: Path) -> dict[int, dict]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {
            r["step"]: {
                k: v for k, v in r.items() if k.startswith("episode/") and "seconds" not in k
            }
            for r in rows
            if "episode/turns" in r
        }

    assert episode_rows(job.run_dir) == episode_rows(whole.run_dir)
