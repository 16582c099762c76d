"""Watching a run: progress lines on the console (components' PROGRESS lines echoed by the
launcher, the controller's evaluation and SFT lines), the rollout log's prompt records and
response text, `rlax-tpu samples`, and the optional W&B logging of every metrics row.

One tiny `rlax-tpu run` (2 RL steps, an evaluation of 2 held-out prompts, W&B in offline
mode when the package is installed) serves the tests that need a real run."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
from jobenv import user_env
from tiny_job import tiny_job_config, write_config

from rlax_tpu import cli
from rlax_tpu.api.records import RolloutKey
from rlax_tpu.config import (
    ControllerConfig,
    DatasetConfig,
    LoggingConfig,
    OptimizerConfig,
    RunConfig,
    StorageConfig,
    WarmStartConfig,
)
from rlax_tpu.controller.scoring import Judgement
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.launch import launcher
from rlax_tpu.launch.metrics import MetricsWriter, read_metrics
from rlax_tpu.launch.wandb_logging import (
    WANDB_FILE,
    WandbSink,
    WandbUnavailableError,
    require_wandb,
)
from rlax_tpu.verifiers.tasks import arithmetic_problems

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
try:
    import wandb  # noqa: F401

    HAVE_WANDB = True
except ImportError:
    HAVE_WANDB = False


# -- the launcher echoes its children's PROGRESS lines ---------------------------------------
def test_the_launcher_echoes_a_components_progress_lines_under_its_name(
    tmp_path, monkeypatch, capsys
):
    child_program = (
        "from rlax_tpu.rpc.process import announce_progress\n"
        "announce_progress('compiling the train step for batches of 8x64 tokens ...')\n"
        "announce_progress('restored the checkpoint\\nof step 4 in 1.0s')\n"
        "print('an unrelated line', flush=True)\n"
        "print('READY 127.0.0.1:4242', flush=True)\n"
    )
    monkeypatch.setattr(launcher, "CHILD_LAUNCHER", child_program)
    log = tmp_path / "trainer-0.log"
    child = launcher.Child("trainer-0", [], env=dict(os.environ), log=log)
    try:
        assert child.wait_ready(60) == "127.0.0.1:4242"
        child.process.wait(60)
    finally:
        child.stop(5)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "[trainer-0] compiling the train step for batches of 8x64 tokens ...",
        "[trainer-0] restored the checkpoint of step 4 in 1.0s",  # one line, always
    ]
    assert "progress: restored the checkpoint of step 4 in 1.0s" in log.read_text()


def test_the_sft_warm_start_reports_its_first_step_then_every_tenth(tmp_path):
    from rlax_tpu.api.trainer import StepResult
    from rlax_tpu.controller.warm_start import run_warm_start
    from rlax_tpu.data.char_tokenizer import write_char_tokenizer
    from rlax_tpu.data.datasets import PromptMixture
    from rlax_tpu.data.tokenizer import Tokenizer

    data = tmp_path / "sums.jsonl"
    rows = arithmetic_problems(11, 8, max_operand=4, ops=("+",))
    data.write_text("".join(json.dumps({**r, "verifier": "arithmetic"}) + "\n" for r in rows))
    write_char_tokenizer(str(tmp_path / "tokenizer"))
    config = tiny_job_config(
        "sft",
        tmp_path / "run",
        seed=0,
        controller=ControllerConfig(
            prompts_per_batch=2,
            samples_per_prompt=4,
            datasets=(DatasetConfig(path=str(data), verifier="arithmetic"),),
        ),
        trainer={"warm_start": WarmStartConfig(steps=25)},
    )
    steps: list[int] = []

    class Trainer:
        def sft_step(self, step, tokens, targets, loss_mask):
            steps.append(step)
            return StepResult(step=step, version=-1, metrics={"loss": 1.0})

    def reported(next_step: int) -> list[int]:
        lines: list[str] = []
        run_warm_start(
            config,
            Trainer(),
            Tokenizer.load(str(tmp_path / "tokenizer")),
            PromptMixture(config.controller.datasets, seed=0),
            next_step=next_step,
            report=lines.append,
        )
        return [int(line.split()[2].split("/")[0]) for line in lines]

    assert reported(0) == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25]
    assert reported(7) == [8, 10, 12, 14, 16, 18, 20, 22, 24, 25]  # resumed: its first step
    assert steps == [*range(25), *range(7, 25)]


# -- one tiny run ---------------------------------------------------------------------------
def _pids(run_dir: Path) -> list[int]:
    path = run_dir / "logs" / "processes.json"
    if not path.exists():
        return []
    return [entry["pid"] for entry in json.loads(path.read_text()).values()]


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished tiny run: (run directory, its console output, the dataset rows)."""
    root = tmp_path_factory.mktemp("watching")
    data = root / "sums.jsonl"
    rows = [
        {**r, "verifier": "arithmetic"}
        for r in arithmetic_problems(11, 32, max_operand=4, ops=("+",))
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = root / "run"
    config = tiny_job_config(
        "watching",
        run_dir,
        seed=3,
        trainer={"optimizer": OptimizerConfig(learning_rate=1e-3), "checkpoint_every": 2},
        controller=ControllerConfig(
            num_steps=STEPS,
            prompts_per_batch=2,
            samples_per_prompt=4,
            datasets=(DatasetConfig(path=str(data), verifier="arithmetic"),),
            eval_dataset=str(data),
            eval_size=2,
            max_eval_overlap=1.0,  # the training file: held out it is not
        ),
    )
    if HAVE_WANDB:
        logging = LoggingConfig(wandb_project="watching", wandb_mode="offline")
        config = dataclasses.replace(config, logging=logging)
    path = write_config(config, root / "watching.json")
    # The job sets its own device count (cpu_devices).
    env = user_env(JAX_PLATFORMS="cpu", WANDB_SILENT="true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(root / "wandb_home")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rlax_tpu", "run", str(path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=400,
        )
    finally:
        _kill_leftovers(p for p in _pids(run_dir) if Path(f"/proc/{p}").exists())
    assert done.returncode == 0, done.stdout[-5000:]
    return run_dir, done.stdout, rows


def test_a_run_shows_compiles_weight_loads_and_evaluations_on_the_console(tiny_run):
    _, out, _ = tiny_run
    lines = out.splitlines()

    def has(start: str, *parts: str) -> bool:
        return any(line.startswith(start) and all(p in line for p in parts) for line in lines)

    assert has("[trainer-0] compiling the train step for batches of 8x64 tokens ...")
    assert has("[trainer-0] train step 8x64: compiled and ran in")
    assert has("[inference_worker-0] loaded the weights of version 0 from the parameter server in")
    assert has("[inference_worker-0] compiling the prefill for 1x64 prompt tokens ...")
    assert has("[inference_worker-0] prefill for 1x64 prompt tokens: compiled in")
    assert has("[inference_worker-0] compiling the decode for 8 slots, 1 steps a call ...")
    assert has("[inference_worker-0] decode for 8 slots, 1 steps a call: compiled and ran in")
    assert has("evaluating version 0 on 2 held-out prompts ...")
    assert has("held-out greedy accuracy of version 0:", "on 2 problems", "in ")
    assert "PROGRESS " not in out  # echoed, never passed through raw
    # Quiet otherwise: each component line says something once, not once per step.
    component_lines = [line for line in lines if line.startswith("[")]
    assert len(component_lines) == len(set(component_lines))


def test_a_trainer_reports_a_checkpoint_restore_with_its_path_and_seconds(tiny_run, tmp_path):
    import jax

    from rlax_tpu.sharding import build_mesh
    from rlax_tpu.trainer import Trainer

    run_dir, _, _ = tiny_run
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    config = RunConfig.from_dict(json.loads((run_dir / "effective_config.json").read_text()))
    config = dataclasses.replace(config, storage=StorageConfig(run_dir=str(tmp_path)))
    lines: list[str] = []
    mesh = build_mesh(config.trainer.mesh, jax.devices()[:2])
    trainer = Trainer(config, mesh=mesh, progress=lines.append)
    assert trainer.initialize() == STEPS
    trainer.close()
    directory = trainer.checkpoints.directory
    assert lines[0] == f"restoring the newest checkpoint from {directory} ..."
    assert lines[1].startswith(f"restored the checkpoint of step {STEPS} from {directory} in ")
    assert lines[1].endswith("s") and len(lines) == 2


def test_verdict_records_carry_the_judged_response_text(tiny_run):
    from rlax_tpu.data.datasets import decode_response, stop_tokens
    from rlax_tpu.data.tokenizer import Tokenizer

    run_dir, _, _ = tiny_run
    tokenizer = Tokenizer.load(str(run_dir / "tokenizer"))
    config = RunConfig.from_dict(json.loads((run_dir / "effective_config.json").read_text()))
    stops = stop_tokens(config.inference.stop_token_ids, tokenizer)
    log = RolloutLog(str(run_dir))
    for batch in range(STEPS):
        rollouts, verdicts = log.read_batch(batch), log.read_verdicts(batch)
        assert verdicts and set(verdicts) <= set(rollouts)
        for key, verdict in verdicts.items():
            assert verdict["response"] == decode_response(tokenizer, rollouts[key]["tokens"], stops)


def test_the_rollout_log_keeps_each_prompts_record_once(tiny_run):
    run_dir, _, rows = tiny_run
    by_id = {r["id"]: r for r in rows}
    log = RolloutLog(str(run_dir))
    for batch in range(STEPS):
        prompts = log.read_prompts(batch)
        assert set(prompts) == {key for key, _, _ in log.read_batch(batch)}
        for key, record in prompts.items():
            assert record["prompt"] == by_id[key.split(":", 2)[2]]["prompt"]
        lines = [
            line
            for f in (run_dir / "rollouts" / f"batch_{batch:09d}").glob("prompts-*.jsonl")
            for line in f.read_text().splitlines()
        ]
        assert len(lines) == len(prompts)  # once per prompt, not per sample


def _samples(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["samples", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _blocks(out: str, start: str) -> dict[str, list[str]]:
    """The lines under each line starting with `start`, by that line's third word."""
    blocks: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith(start):
            current = blocks.setdefault(line.split()[2], [line])
        elif blocks:
            current.append(line)
    return blocks


def test_samples_prints_prompt_response_reward_and_verdict_of_the_newest_batch(tiny_run, capsys):
    run_dir, _, rows = tiny_run
    by_id = {r["id"]: r for r in rows}
    newest = STEPS - 1
    code, out, _ = _samples(capsys, run_dir)
    assert code == 0
    assert out.splitlines()[0].startswith(f"batch {newest} of {run_dir} (version {newest}): ")
    verdicts = RolloutLog(str(run_dir)).read_verdicts(newest)
    prompts = _blocks(out, "== prompt ")
    assert set(prompts) == {prompt_id for prompt_id, _, _ in verdicts}
    for prompt_id, lines in prompts.items():
        row = by_id[prompt_id.split(":", 2)[2]]
        assert lines[:2] == [
            f"== prompt {prompt_id} (verifier arithmetic, reference {row['answer']!r})",
            f"   {row['prompt']}",
        ]
        samples = _blocks("\n".join(lines[2:]), "  -- sample ")
        for sample, sample_lines in samples.items():
            verdict = verdicts[(prompt_id, int(sample), newest)]
            header = sample_lines[0]
            assert f"reward {verdict['reward']:.3f}  verdict {verdict['verdict']}" in header
            text = "\n".join(line.removeprefix("     | ") for line in sample_lines[1:])
            assert text == "\n".join(verdict["response"].splitlines())


def test_samples_json_picks_a_step_and_a_prompt(tiny_run, capsys):
    run_dir, _, _ = tiny_run
    log = RolloutLog(str(run_dir))
    consumed = log.consumed()[0]
    prompt_id = consumed[0][0]
    code, out, _ = _samples(capsys, run_dir, "--step", 0, "--prompt-id", prompt_id, "--json")
    assert code == 0
    batch = json.loads(out)
    assert batch["batch"] == 0 and [p["prompt_id"] for p in batch["prompts"]] == [prompt_id]
    samples = batch["prompts"][0]["samples"]
    verdicts = log.read_verdicts(0)
    assert [s["sample_index"] for s in samples] == [0, 1, 2, 3]
    for s in samples:
        verdict = verdicts[(prompt_id, s["sample_index"], s["version"])]
        assert (s["reward"], s["verdict"], s["response"]) == (
            verdict["reward"],
            verdict["verdict"],
            verdict["response"],
        )
        assert s["trained"] == ((prompt_id, s["sample_index"], s["version"]) in consumed)
    code, out, _ = _samples(capsys, run_dir, "--step", 0, "--limit", 1, "--json")
    assert code == 0 and len(json.loads(out)["prompts"]) == 1
    code, _, err = _samples(capsys, run_dir, "--step", 99)
    assert code == 2 and "no rollouts of batch 99; it holds batches 0..1" in err


def test_samples_reads_a_run_directory_on_gcs(tiny_run, gcs_bucket, capsys):
    from rlax_tpu import storage

    run_dir, _, _ = tiny_run
    remote = f"{gcs_bucket}/runs/watching"
    for part in ("rollouts", "consumed"):
        storage.copy_tree(str(run_dir / part), f"{remote}/{part}")
    local = json.loads(_samples(capsys, run_dir, "--json")[1])
    code, out, _ = _samples(capsys, remote, "--json")
    assert code == 0
    assert {**json.loads(out), "run_dir": str(run_dir)} == local


def test_samples_reads_a_log_written_before_prompts_and_responses_were_kept(
    tiny_run, tmp_path, capsys
):
    run_dir, _, rows = tiny_run
    old = tmp_path / "old"
    for part in ("rollouts", "consumed", "tokenizer"):
        shutil.copytree(run_dir / part, old / part)
    config = json.loads((run_dir / "effective_config.json").read_text())
    config["model"]["tokenizer"] = str(old / "tokenizer")
    (old / "effective_config.json").write_text(json.dumps(config))
    for f in (old / "rollouts").rglob("prompts-*.jsonl"):
        f.unlink()
    for f in (old / "rollouts").rglob("verdicts-*.jsonl"):  # the old record format
        records = [json.loads(line) for line in f.read_text().splitlines()]
        f.write_text(
            "".join(
                json.dumps({k: v for k, v in r.items() if k != "response"}) + "\n" for r in records
            )
        )
    new = json.loads(_samples(capsys, run_dir, "--json")[1])
    code, out, _ = _samples(capsys, old, "--json")
    assert code == 0
    fallback = json.loads(out)
    for a, b in zip(new["prompts"], fallback["prompts"], strict=True):
        assert b["record"]["prompt"] == a["record"]["prompt"]  # from the dataset file
        assert [s["response"] for s in b["samples"]] == [s["response"] for s in a["samples"]]
        assert [s["reward"] for s in b["samples"]] == [s["reward"] for s in a["samples"]]


def test_old_verdict_records_without_text_still_load():
    old = {"prompt_id": "b0:a:1", "sample_index": 0, "version": 0, "reward": 1.0,
           "verdict": "correct", "reason": ""}  # fmt: skip
    judgement = Judgement.from_json(old)
    assert (judgement.reward, judgement.verdict, judgement.response) == (1.0, "correct", "")
    unjudged = Judgement.from_json({**old, "reward": None, "verdict": "verifier_error"})
    assert not unjudged.judged
    with_text = Judgement(0.0, "wrong", "no number", response="41")
    record = with_text.to_json(RolloutKey("b0:a:1", 0, 0))
    assert record["response"] == "41" and Judgement.from_json(record).response == "41"
    assert Judgement.from_json(record) == with_text


# -- Weights & Biases --------------------------------------------------------------------------
class _FakeRun:
    def __init__(self, **init) -> None:
        self.init, self.rows, self.finished = init, [], False

    def log(self, values, step):
        self.rows.append((step, dict(values)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in `wandb` module that records init calls and logged rows."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(_FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def _wandb_config(run_dir: Path, **logging) -> RunConfig:
    return RunConfig(
        name="wb",
        storage=StorageConfig(run_dir=str(run_dir)),
        logging=LoggingConfig(wandb_project="proj", **logging),
    )


def test_every_metrics_row_goes_to_wandb_and_a_resumed_run_continues_its_wandb_run(
    tmp_path, fake_wandb
):
    config = _wandb_config(tmp_path, wandb_entity="team", wandb_mode="offline")
    with MetricsWriter(str(tmp_path), sinks=[WandbSink.open(config)]) as metrics:
        for step in range(3):
            metrics.write(step, {"reward_mean": step / 2, "train/loss": 1.0 - step})
    first = fake_wandb.runs[0]
    assert first.rows == [
        (0, {"reward_mean": 0.0, "train/loss": 1.0}),
        (1, {"reward_mean": 0.5, "train/loss": 0.0}),
        (2, {"reward_mean": 1.0, "train/loss": -1.0}),
    ]
    assert first.finished
    run_id = json.loads((tmp_path / WANDB_FILE).read_text())["id"]
    assert first.init["id"] == run_id and first.init["resume"] == "allow"
    assert (first.init["project"], first.init["entity"], first.init["name"]) == (
        "proj",
        "team",
        "wb",
    )
    assert first.init["mode"] == "offline" and first.init["config"]["name"] == "wb"
    # Resumed from the checkpoint of step 1: steps 1 and 2 are trained (and written) again.
    with MetricsWriter(str(tmp_path), sinks=[WandbSink.open(config)]) as metrics:
        for step in range(1, 5):
            metrics.write(step, {"reward_mean": step / 2})
    second = fake_wandb.runs[1]
    assert second.init["id"] == run_id
    assert [step for step, _ in second.rows] == [3, 4]
    assert [row["step"] for row in read_metrics(str(tmp_path))] == [0, 1, 2, 1, 2, 3, 4]


def test_wandb_enabled_without_the_package_is_refused_before_the_run_starts(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert require_wandb(LoggingConfig()) is None  # not enabled: not needed
    with pytest.raises(WandbUnavailableError, match="pip install wandb"):
        WandbSink.open(_wandb_config(tmp_path / "sink"))
    run_dir = tmp_path / "run"
    path = write_config(_wandb_config(run_dir), tmp_path / "wb.json")
    assert cli.main(["run", str(path)]) == 1
    err = capsys.readouterr().err
    assert "WandbUnavailableError" in err and "pip install wandb" in err
    assert not run_dir.exists()  # nothing started


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the run's offline W&B log (run-<id>.wandb: LevelDB-log records
    of wandb's Record protos)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, block, pos, chunk, rows = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # "train/loss" is nested: ("train", "loss")
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed")
def test_a_run_logs_every_metrics_row_to_wandb_offline(tiny_run):
    run_dir, out, _ = tiny_run
    rows = {r["step"]: r for r in read_metrics(str(run_dir))}
    history = {r["_step"]: r for r in _wandb_history(run_dir)}
    assert sorted(history) == sorted(rows) == list(range(STEPS + 1))
    for step, row in rows.items():
        for key, value in row.items():
            if key not in ("step", "time"):
                assert history[step][key] == pytest.approx(value, nan_ok=True), key
    run_id = json.loads((run_dir / WANDB_FILE).read_text())["id"]
    assert f"W&B: logging to watching as run {run_id}" in out
