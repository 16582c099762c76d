"""Rewards carry their verdicts, end to end: `run --connect` (the controller in this process,
no JAX) drives a parameter server, a trainer and an inference worker started as processes,
and a verifier service that fails on chosen request ids (tests/faulty_verifier.py). The
warm start goes through the trainer's SftStep like every other step.

A transient fault is retried and judged; a sample still unjudged after the retries drops its
group, which the refill stream replaces, so nothing is trained on a missing reward; two runs
with the same faults train the same weights; a verifier that fails on everything stops the
run with a message that says what to fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from jobenv import codegen_flags
from processes import ProcessGroup
from tiny_job import tiny_job_config, write_config

from rlax_tpu.config import (
    ControllerConfig,
    DatasetConfig,
    OptimizerConfig,
    VerifyConfig,
    WarmStartConfig,
)
from rlax_tpu.controller.errors import UnjudgedError
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.launch.job import run_connected
from rlax_tpu.launch.remote import ComponentAddresses
from rlax_tpu.verifiers.tasks import arithmetic_problems

TOKEN = "verdicts-token"
FAULTY = str(Path(__file__).resolve().parent / "faulty_verifier.py")
STEPS = 6
# Batch 2's sample 1 of each prompt fails on every attempt; batch 4's sample 0 only once.
# Request ids start with the run's namespace (scoring.run_prefix: 12 hex digits and ":").
ALWAYS, ONCE = r"^[0-9a-f]{12}:b2:[^/]*/s1/", r"^[0-9a-f]{12}:b4:[^/]*/s0/"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts")
    data = root / "sums.jsonl"
    rows = arithmetic_problems(11, 64, max_operand=4, ops=("+",))
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"XLA_FLAGS": codegen_flags()}  # each process sets its own device count (cpu_devices)
    return root, data, env


def connected_run(
    workspace, monkeypatch, name, *, fail_always="(?!)", fail_once="(?!)", warm_steps=40, **ctl
):
    """The whole run against freshly started components; (summary, run dir)."""
    root, data, env = workspace
    run_dir = root / name
    controller = {
        "num_steps": STEPS,
        "prompts_per_batch": 2,
        "samples_per_prompt": 4,
        "datasets": (DatasetConfig(path=str(data), verifier="arithmetic"),),
        "verify": VerifyConfig(retries=2, retry_backoff_s=0.01, max_unjudged_fraction=0.3),
        **ctl,
    }
    config = tiny_job_config(
        name,
        run_dir,
        seed=3,
        trainer={
            "optimizer": OptimizerConfig(learning_rate=1e-3),
            "warm_start": WarmStartConfig(steps=warm_steps, learning_rate=3e-3),
            "checkpoint_every": 2,
        },
        controller=ControllerConfig(**controller),
    )
    path = str(write_config(config, root / f"{name}.json"))
    monkeypatch.setenv("RLAX_TPU_AUTH_TOKEN", TOKEN)
    group = ProcessGroup()
    try:
        ps, trainer, worker = group.start_run_components(path, str(run_dir), token=TOKEN, env=env)
        verifier = group.start(
            ["--fail-always", fail_always, "--fail-once", fail_once],
            script=FAULTY,
            env={"RLAX_TPU_AUTH_TOKEN": TOKEN},
        )
        addresses = ComponentAddresses(
            param_server=(ps.address,),
            trainer=trainer.address,
            inference=(worker.address,),
            verifier=(verifier.address,),
        )
        return run_connected(config, addresses, ready_timeout_s=120), run_dir
    finally:
        group.stop_all()


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def test_unjudged_samples_are_retried_then_dropped_never_trained_and_runs_agree(
    workspace, monkeypatch
):
    first, run_dir = connected_run(
        workspace, monkeypatch, "faulty_a", fail_always=ALWAYS, fail_once=ONCE
    )
    assert (first["start_step"], first["end_step"]) == (0, STEPS)
    metrics = metrics_by_step(run_dir)
    # Batch 2 (trained at step 3): 2 samples fail 3 times each (2 retries), stay unjudged.
    assert metrics[3]["verify/errors"] == 6 and metrics[3]["verify/retries"] == 4
    assert metrics[3]["verify/dropped"] == 2 and metrics[3]["verify/dropped_groups"] == 2
    # Batch 4 (step 5): 2 samples fail once, judged on the first retry.
    assert metrics[5]["verify/errors"] == 2 and metrics[5]["verify/retries"] == 2
    assert metrics[5]["verify/dropped"] == 0
    for step in (1, 2, 4, 6):
        assert metrics[step]["verify/errors"] == metrics[step]["verify/dropped"] == 0
    assert first["verify_unjudged"] == 2 and first["groups_dropped"] == 2
    # Both of batch 2's groups were dropped and replaced from the refill stream; their
    # verdicts are logged as unjudged (a resume drops them again).
    log = RolloutLog(str(run_dir))
    consumed = log.consumed()
    assert sorted(consumed) == list(range(STEPS))
    assert {p.split(":")[0] for p, _, _ in consumed[2]} == {"b2r1"}
    assert all(p.startswith("b4:") for p, _, _ in consumed[4])
    unjudged = [key for key, v in log.read_verdicts(2).items() if v["reward"] is None]
    assert sorted(s for _, s, _ in unjudged) == [1, 1]
    assert all(key[0].startswith("b2:") for key in unjudged)
    assert any(m["reward_mean"] > 0 for m in metrics.values())  # warm-started: gradients

    second, again = connected_run(
        workspace, monkeypatch, "faulty_b", fail_always=ALWAYS, fail_once=ONCE
    )
    assert second["final_digest"] == first["final_digest"] != ""
    assert RolloutLog(str(again)).consumed() == consumed


def test_a_verifier_failing_everything_stops_the_run_with_the_reason(workspace, monkeypatch):
    with pytest.raises(UnjudgedError) as info:
        connected_run(workspace, monkeypatch, "broken", fail_always=".", warm_steps=0)
    message = str(info.value)
    assert "batch 0: 8 of 8 samples are unjudged after 2 retries" in message
    assert "max_unjudged_fraction = 0.3" in message and "injected fault" in message
    assert not (Path(workspace[0]) / "broken" / "consumed").exists()  # nothing trained
    assert os.path.exists(Path(workspace[0]) / "broken" / "snapshots")
