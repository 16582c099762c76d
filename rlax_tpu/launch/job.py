"""`rlax-tpu run` and `rlax-tpu resume`: a whole RL run on this machine.

1. The run directory gets the config dump (a different config there is refused).
2. Built-in inputs are materialised into it: `model.tokenizer = "builtin:char"` writes a
   character tokenizer, a dataset path `builtin:arithmetic` (or `builtin:multiplication`,
   the tool-use demo's) writes that task.
3. The local launcher starts every component; the controller runs in the foreground: the
   SFT warm start first (`trainer.warm_start.steps`, through the trainer's SftStep), then RL.
Running it again on the same run directory (or `rlax-tpu resume RUN_DIR`) resumes.

`rlax-tpu run CONFIG --connect` (`run_connected`) is the controller alone, driving
components that already run elsewhere (GKE pods, XManager jobs) at given addresses, warm
start included. This process never imports JAX; `warm_start` (for `rlax-tpu sft` and the
benchmarks) runs the same warm start on a trainer in this process instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlax_tpu import storage
from rlax_tpu.api.inference import InferenceWorkerClient
from rlax_tpu.api.param_server import ParamServerClient
from rlax_tpu.api.trainer import TrainerClient
from rlax_tpu.api.verifier import VerifierClient
from rlax_tpu.config import ConfigError, DatasetConfig, RunConfig, load_config
from rlax_tpu.config.checkpoint import resolve_checkpoint_model
from rlax_tpu.controller.controller import Components, Controller
from rlax_tpu.controller.episodes import Episodes
from rlax_tpu.controller.scoring import ServiceVerifier
from rlax_tpu.controller.warm_start import run_warm_start
from rlax_tpu.data.char_tokenizer import write_char_tokenizer, write_char_tools_tokenizer
from rlax_tpu.data.datasets import (
    PromptMixture,
    held_out_overlap,
    load_eval_prompts,
    load_prompts,
)
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.launch.launcher import (
    ComponentFailed,
    LocalCluster,
    check_colocated_gpu_memory,
)
from rlax_tpu.launch.metrics import MetricsWriter
from rlax_tpu.launch.remote import ConnectError, HealthProbe, Watchdog, wait_until_serving
from rlax_tpu.launch.wandb_logging import WandbSink
from rlax_tpu.rpc import AuthTokenError, auth_token_from_env
from rlax_tpu.rpc.client import RpcCallError
from rlax_tpu.rpc.process import stop_on_signals
from rlax_tpu.run_dir import (
    EFFECTIVE_CONFIG,
    SUMMARY_FILE,
    TOKENIZER,
    finished_summary,
    prepare_run_dir,
)
from rlax_tpu.verifiers.functions import (
    RewardFunctionError,
    check_reward_functions,
    configured_reward_functions,
)
from rlax_tpu.verifiers.tasks import (
    arithmetic_problems,
    arithmetic_space,
    arithmetic_split_of,
    multiplication_problems,
)

_log = logging.getLogger(__name__)

BUILTIN_ARITHMETIC = "builtin:arithmetic"
BUILTIN_CHAR_TOKENIZER = "builtin:char"
# The same with an end-of-turn token and a Hermes-style template for tool calls (the
# tool-use demo, controller.environment).
BUILTIN_CHAR_TOOLS_TOKENIZER = "builtin:char_tools"
# The demo's task: sums and differences of operands 0-99, 15,050 distinct problems; the
# training file draws 5,000 rows from the training side, the held-out file holds the whole
# test side (1,850 problems, tasks.arithmetic_split_of), shuffled by the seed.
ARITHMETIC_MAX_OPERAND = 99
ARITHMETIC_OPS = ("+", "-")
ARITHMETIC_TRAIN_SIZE = 5000
# The tool-use demo's task (tasks.multiplication_problems): 3-digit by 2-digit products,
# 81,000 problems; the SFT warm start shows a calculator call in this fraction of its rows
# and the bare answer in the rest, so RL has the tool's use to learn.
BUILTIN_MULTIPLICATION = "builtin:multiplication"
MULTIPLICATION_TRAIN_SIZE = 5000
MULTIPLICATION_HELDOUT_SIZE = 2000
MULTIPLICATION_TOOL_DEMONSTRATIONS = 0.125
# How long a failed call waits for the launcher to see the component's process gone (it looks
# every 0.2 s) before the call's own error is the stop's reason.
DEATH_NOTICE_S = 3.0
DATASET_SCAN = "dataset_scan.json"  # what the datasets scan found (datasets.DatasetScan)
HELD_OUT = "held_out"  # its key for the held-out set's overlap with them (datasets.EvalOverlap)
SFT_MODEL_DIR = "sft_model"


# -- built-in inputs ---------------------------------------------------------------------------
def arithmetic_split(seed: int, split: str) -> list[dict[str, str]]:
    """The arithmetic task's rows: "train" from the task's training side, "heldout" every
    problem of its test side; the two share no problem, whatever the seed."""

    if split == "train":
        return arithmetic_problems(
            seed,
            ARITHMETIC_TRAIN_SIZE,
            max_operand=ARITHMETIC_MAX_OPERAND,
            ops=ARITHMETIC_OPS,
            split="train",
        )
    if split != "heldout":
        raise ValueError(f"split {split!r}: train or heldout")
    space = arithmetic_space(ARITHMETIC_MAX_OPERAND, ARITHMETIC_OPS)
    size = sum(arithmetic_split_of(*p[:3]) == "test" for p in space)
    return arithmetic_problems(
        seed, size, max_operand=ARITHMETIC_MAX_OPERAND, ops=ARITHMETIC_OPS, split="test"
    )


def multiplication_split(seed: int, split: str) -> list[dict[str, Any]]:
    """The tool-use demo's task: "train" rows (with demonstrations, a calculator call in
    MULTIPLICATION_TOOL_DEMONSTRATIONS of them) from the training side, "heldout"
    MULTIPLICATION_HELDOUT_SIZE problems of the test side."""
    if split == "train":
        return multiplication_problems(
            seed,
            MULTIPLICATION_TRAIN_SIZE,
            split="train",
            tool_demonstrations=MULTIPLICATION_TOOL_DEMONSTRATIONS,
        )
    if split != "heldout":
        raise ValueError(f"split {split!r}: train or heldout")
    rows = multiplication_problems(seed, MULTIPLICATION_HELDOUT_SIZE, split="test")
    return [{k: v for k, v in r.items() if k != "demonstration"} for r in rows]


# The built-in datasets (a dataset path or controller.eval_dataset), by name: their rows of a
# split ("train" or "heldout") for a seed.
BUILTIN_DATASETS = {
    BUILTIN_ARITHMETIC: ("arithmetic", arithmetic_split),
    BUILTIN_MULTIPLICATION: ("multiplication", multiplication_split),
}


def _materialise_dataset(path: str, seed: int, run_dir: str, split: str) -> str:
    if path not in BUILTIN_DATASETS:
        return path
    name, rows_of = BUILTIN_DATASETS[path]
    url = storage.join(run_dir, "data", f"{name}_{split}.jsonl")
    if not storage.exists(url):
        rows = rows_of(seed, split)
        if split == "heldout":  # judged exactly whatever the training rows' verifier is
            rows = [{**r, "verifier": "arithmetic"} for r in rows]
        storage.write_text(url, "".join(json.dumps(r) + "\n" for r in rows))
    return url


def materialise(config: RunConfig) -> RunConfig:
    """`config` with its built-in inputs written into the run directory and named by path."""
    run_dir = config.storage.run_dir
    model, controller = config.model, config.controller
    if model.tokenizer in (BUILTIN_CHAR_TOKENIZER, BUILTIN_CHAR_TOOLS_TOKENIZER):
        directory = storage.join(run_dir, TOKENIZER)
        if not storage.exists(storage.join(directory, "tokenizer.json")):
            if model.tokenizer == BUILTIN_CHAR_TOOLS_TOKENIZER:
                write_char_tools_tokenizer(directory)
            else:
                write_char_tokenizer(directory)
        model = dataclasses.replace(model, tokenizer=directory)

    def train(d: DatasetConfig) -> DatasetConfig:
        return dataclasses.replace(
            d, path=_materialise_dataset(d.path, config.seed, run_dir, "train")
        )

    datasets = tuple(train(d) for d in controller.datasets)
    data = train(config.data) if config.data is not None else None
    eval_dataset = controller.eval_dataset
    if eval_dataset:
        eval_dataset = _materialise_dataset(eval_dataset, config.seed, run_dir, "heldout")
    controller = dataclasses.replace(controller, datasets=datasets, eval_dataset=eval_dataset)
    return dataclasses.replace(config, model=model, controller=controller, data=data)


def tokenizer_path(config: RunConfig) -> str:
    path = config.model.tokenizer or config.model.hf_checkpoint
    if not path:
        raise ValueError(
            "the controller needs a tokenizer: set model.tokenizer (a directory with "
            "tokenizer.json, or builtin:char) or model.hf_checkpoint"
        )
    return path


# -- SFT warm start in this process --------------------------------------------------------------
def warm_start(config: RunConfig, tokenizer: Any) -> str:
    """The run's SFT warm start on a trainer in this process (`rlax-tpu sft`): the same
    steps the run drives through the trainer service, into the same run directory (its
    warm-start checkpoint, from which a later `rlax-tpu run` starts RL), the model also
    exported in Hugging Face format (once: a finished export is reused). Returns the
    export's directory."""
    # The job's process loads JAX only here (`rlax-tpu sft`, `eval`), never for a run.
    from rlax_tpu.models.export import export_hf
    from rlax_tpu.trainer import Trainer

    out = storage.join(config.storage.run_dir, SFT_MODEL_DIR)
    if storage.exists(storage.join(out, "config.json")):  # written last by save_hf
        return out

    trainer = Trainer(config)
    trainer.initialize()
    mixture, _, _ = _prompt_sources(config, tokenizer)
    environment = config.controller.environment
    episodes = None
    if environment.enabled:  # demonstrations built as the run's episodes are
        episodes = Episodes(environment, tokenizer, max_new_tokens=config.inference.max_new_tokens)
    run_warm_start(
        config,
        trainer,
        tokenizer,
        mixture,
        next_step=trainer.warm_start_step,
        report=lambda line: print(line, flush=True),
        episodes=episodes,
    )
    export_hf(trainer.params(), config.model, out, tokenizer_dir=tokenizer_path(config))
    trainer.close()
    return out


# -- the run -----------------------------------------------------------------------------------
def _held_out(row: dict[str, Any]) -> str:
    """ "0.812 [0.776–0.844]": the held-out accuracy and its 95 % interval."""
    text = f"{row['eval_accuracy']:.3f}"
    if "eval_accuracy_low" in row:
        text += f" [{row['eval_accuracy_low']:.3f}–{row['eval_accuracy_high']:.3f}]"
    return text


def _progress(row: dict[str, Any], num_steps: int) -> None:
    if "reward_mean" not in row:  # the evaluation before the first step
        print(f"step {row['step']:>4}/{num_steps}  held-out {_held_out(row)}", flush=True)
        return
    # Over the trainer's step without its compile (a first step compiles for a while).
    run_s = row.get("train/time/step_s", 0) - row.get("train/time/compile_s", 0)
    tokens_per_s = row["response_tokens"] / max(run_s, 1e-9)
    line = (
        f"step {row['step']:>4}/{num_steps}  reward {row['reward_mean']:.3f}  "
        f"acc {row['accuracy']:.3f}  staleness {row['staleness_mean']:.2f}  "
        f"train tok/s {tokens_per_s:,.0f}  {row['elapsed_s']:.0f}s"
    )
    if "eval_accuracy" in row:
        line += f"  held-out {_held_out(row)}"
        if row.get("eval_version", row["step"]) != row["step"]:
            line += f" (version {row['eval_version']})"
    print(line, flush=True)


def _prompt_sources(config: RunConfig, tokenizer: Any) -> tuple[Any, list[Any], dict[str, Any]]:
    """The prompt mixture (the controller derives its other streams from it), the
    held-out prompts and the scans: every prompt measured under the tokenizer and chat
    template first (datasets.scan_datasets: rows over the limits stop the run here, or are
    dropped)."""

    records, weights, scans = load_prompts(config, tokenizer)
    limit = config.inference.max_prompt_len
    for scan in scans.values():
        dropped = f", {scan.dropped} over the limits left out" if scan.dropped else ""
        print(
            f"dataset {scan.name}: {scan.rows} prompts, median {scan.median_prompt:.0f} "
            f"tokens, longest {scan.longest_prompt} (inference.max_prompt_len {limit}){dropped}",
            flush=True,
        )
    eval_prompts = load_eval_prompts(config, tokenizer)
    # Held out means held out: stops here (DatasetError) over controller.max_eval_overlap.
    overlap = held_out_overlap(config, records, eval_prompts, tokenizer)
    if overlap is not None:
        print(overlap.describe(), flush=True)
        scans = {**scans, HELD_OUT: overlap}
    dropped = {name: scan.dropped for name, scan in scans.items() if name != HELD_OUT}
    mixture = PromptMixture.from_records(records, weights, seed=config.seed, dropped=dropped)
    return mixture, eval_prompts, scans


def _write_scans(run_dir: str, scans: dict[str, Any]) -> None:
    storage.write_text(
        storage.join(run_dir, DATASET_SCAN),
        json.dumps({name: scan.to_json() for name, scan in scans.items()}, indent=2),
    )


def _inputs(
    config: RunConfig,
) -> tuple[RunConfig, RunConfig, Any, tuple[Any, list[Any], Any], dict]:
    """What a run reads before it touches its run directory's identity, so that a bad input
    stops it with nothing written that a corrected config would trip over: (the config with
    its checkpoint's architecture, the effective config, the tokenizer, the prompt sources,
    the dataset scans)."""

    config = resolve_checkpoint_model(config, strict=True)
    if not config.verifiers.address:  # the verifiers this run starts import them too
        try:
            check_reward_functions(configured_reward_functions(config))
        except RewardFunctionError as e:
            raise ConfigError(str(e), field="data.reward_function") from None
    effective = materialise(config)
    tokenizer = Tokenizer.load(tokenizer_path(effective))
    mixture, eval_prompts, scans = _prompt_sources(effective, tokenizer)
    return config, effective, tokenizer, (mixture, eval_prompts, scans.get(HELD_OUT)), scans


def _drive(
    config: RunConfig,
    components: Any,
    sources: tuple[Any, list[Any], Any],
    *,
    tokenizer: Any,
    digest: str,
    stop: threading.Event,
) -> dict[str, Any]:
    """The controller over `components` until done or stopped; its summary. Metrics go to
    the run directory and, with `logging.wandb_project`, to W&B."""

    mixture, eval_prompts, overlap = sources
    num_steps = config.controller.num_steps
    sinks = [s for s in (WandbSink.open(config),) if s is not None]
    with MetricsWriter(config.storage.run_dir, sinks=sinks) as metrics:
        controller = Controller(
            config,
            components,
            tokenizer=tokenizer,
            mixture=mixture,
            eval_prompts=eval_prompts,
            eval_overlap=None if overlap is None else overlap.fraction,
            metrics=metrics,
            progress=lambda row: _progress(row, num_steps),
            report=lambda line: print(line, flush=True),
            stop=stop,
            digest=digest,
        )
        return controller.run()


def _connect(
    config: RunConfig,
    token: str,
    *,
    param_server: Sequence[str],
    trainer: str,
    inference: Sequence[str],
    verifier: Sequence[str],
    stop: threading.Event,
) -> Any:  # rlax_tpu.controller.controller.Components
    """The controller's clients of the components at these addresses (one per inference
    worker; verification spread over every verifier replica). They wait for a component
    that does not answer (controller.component_wait_s) until `stop` is set."""

    return Components(
        trainer=TrainerClient(
            trainer, auth_token=token, max_message_bytes=config.trainer.max_message_bytes
        ),
        param_server=ParamServerClient(
            list(param_server),
            auth_token=token,
            chunk_bytes=config.param_server.chunk_bytes,
            reconnect_s=config.controller.component_wait_s,
            on_retry=_log.warning,
            stop=stop,
        ),
        workers=[InferenceWorkerClient(a, auth_token=token) for a in inference],
        verifier=ServiceVerifier(
            [VerifierClient(a, auth_token=token) for a in verifier],
            wait_s=config.controller.component_wait_s,
            stop=stop,
            liveness_s=config.controller.liveness_timeout_s,
            deadline_s=config.controller.verify.deadline_s,
        ),
    )


def run(config: RunConfig, *, stop: threading.Event | None = None) -> dict[str, Any]:
    """The whole job; returns the controller's summary (see Controller.run)."""

    stop = stop or threading.Event()
    check_colocated_gpu_memory(config)  # before the run directory exists
    config, effective, tokenizer, sources, scans = _inputs(config)
    finished = finished_summary(config)
    if finished is not None:  # nothing to do: no component is started
        print(
            f"run {config.name!r}: already done, {finished['end_step']} steps in "
            f"{config.storage.run_dir}; raise controller.num_steps to train further",
            flush=True,
        )
        return finished
    run_dir = prepare_run_dir(config)
    _write_scans(run_dir, scans)
    digest = config.digest()
    print(f"run {config.name!r}: digest {digest[:12]}, run dir {run_dir}", flush=True)
    config_url = storage.join(run_dir, EFFECTIVE_CONFIG)
    storage.write_text(config_url, json.dumps(effective.to_dict(), indent=2))
    local_dir = Path(run_dir) if not storage.is_remote(run_dir) else Path("logs") / config.name
    with LocalCluster(
        config_url,
        num_workers=effective.inference.num_workers,
        log_dir=local_dir / "logs",
        param_storage=storage.join(run_dir, "params"),
        token_env=effective.param_server.auth_token_env,
        config=effective,
    ) as cluster:
        t0 = time.perf_counter()
        try:
            cluster.start()
        except ComponentFailed as e:  # a component that never came up: the same resume
            e.run_dir = e.run_dir or run_dir
            raise
        print(f"components ready in {time.perf_counter() - t0:.0f}s: {cluster.addresses}")
        threading.Thread(
            target=lambda: (cluster.failed.wait(), stop.set()), daemon=True, name="on-failure"
        ).start()
        components = _connect(
            config,
            cluster.token,
            param_server=cluster.addresses["param_server"],
            trainer=cluster.addresses["trainer"][0],
            inference=cluster.addresses["inference_worker"],
            verifier=cluster.addresses["verifier"],
            stop=stop,
        )
        try:
            summary = _drive(
                effective, components, sources, tokenizer=tokenizer, digest=digest, stop=stop
            )
        except Exception as e:
            # A component that died fails the controller's next call to it, usually before
            # the launcher's watch sees the process gone: the stop names the process (after
            # the controller's own account, when it gave one rather than a call's error).
            if not cluster.failed.wait(DEATH_NOTICE_S):
                raise

            reason = cluster.failure if isinstance(e, RpcCallError) else f"{e}\n{cluster.failure}"
            failed = ComponentFailed(reason)
            failed.run_dir = run_dir
            raise failed from e
        finally:
            failure = cluster.failure
        components.param_server.close()
    storage.write_text(storage.join(run_dir, SUMMARY_FILE), json.dumps(summary, indent=2))
    if failure and summary["end_step"] < effective.controller.num_steps:
        failed = ComponentFailed(failure)
        failed.run_dir = run_dir
        raise failed
    if failure:  # after the last step: the run is complete, its results are all written
        print(f"after the last step: {failure.splitlines()[0]}", file=sys.stderr)
    return summary


def run_connected(
    config: RunConfig,
    addresses: Any,
    *,
    stop: threading.Event | None = None,
    ready_timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """`rlax-tpu run --connect`: the controller alone, over components already running at
    `addresses` (remote.ComponentAddresses) with the token of `param_server.auth_token_env`.

    It waits until every component answers, then runs like `run` (resuming from the run
    directory's newest snapshot, if any). A trainer that stops answering stops the run
    with ConnectError, so the cluster restarts it and the new controller resumes; the
    other components are waited for (Watchdog)."""

    try:
        token = auth_token_from_env(config.param_server.auth_token_env)
    except AuthTokenError as e:
        raise ConnectError(str(e)) from None

    stop = stop or threading.Event()
    config, effective, tokenizer, sources, scans = _inputs(config)
    run_dir = prepare_run_dir(config)
    _write_scans(run_dir, scans)
    digest = config.digest()
    print(f"run {config.name!r}: digest {digest[:12]}, run dir {run_dir}", flush=True)
    probe = HealthProbe(addresses.named(), auth_token=token)
    try:
        t0 = time.perf_counter()
        if not wait_until_serving(probe, timeout_s=ready_timeout_s, stop=stop):
            raise ConnectError("stopped while waiting for the components")
        print(f"components answer after {time.perf_counter() - t0:.0f}s: {addresses.named()}")
        watchdog = Watchdog(probe).start()
        threading.Thread(
            target=lambda: (watchdog.failed.wait(), stop.set()), daemon=True, name="on-failure"
        ).start()
        components = _connect(
            config,
            token,
            param_server=list(addresses.param_server),
            trainer=addresses.trainer,
            inference=addresses.inference,
            verifier=addresses.verifier,
            stop=stop,
        )
        try:
            summary = _drive(
                effective, components, sources, tokenizer=tokenizer, digest=digest, stop=stop
            )
        finally:
            failure = watchdog.failure
            watchdog.close()
            components.param_server.close()
    finally:
        probe.close()
    storage.write_text(storage.join(run_dir, SUMMARY_FILE), json.dumps(summary, indent=2))
    if failure:
        raise ConnectError(failure)
    return summary


def main(config: RunConfig, *, addresses: Any = None, ready_timeout_s: float = 1800.0) -> int:
    """`rlax-tpu run`: SIGTERM / Ctrl-C write a final snapshot and stop every component.
    With `addresses` (`--connect`) the components run elsewhere and are left running."""

    def announce(signum: int) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(
            f"\n{name}: stopping — the run finishes the call in flight, writes a snapshot and "
            f"stops its components; `rlax-tpu resume {config.storage.run_dir}` continues it. "
            f"{name} again stops at once (the resume then starts from the last snapshot)",
            file=sys.stderr,
            flush=True,
        )

    stop = stop_on_signals(announce, again_exits=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if addresses is None:
        summary = run(config, stop=stop)
    else:
        summary = run_connected(config, addresses, stop=stop, ready_timeout_s=ready_timeout_s)
    evals = summary.get("evals", {})
    if evals:
        first, last = min(evals), max(evals)
        versions = summary.get("eval_versions", {})

        def at(step: int) -> str:
            version = versions.get(step, step)
            return f"step {step}" + (f" (version {version})" if version != step else "")

        print(
            f"held-out greedy accuracy: {evals[first]:.3f} at {at(first)} -> "
            f"{evals[last]:.3f} at {at(last)}",
            flush=True,
        )
    if summary["end_step"] < config.controller.num_steps:
        print(
            f"stopped at step {summary['end_step']}; continue with: rlax-tpu resume "
            f"{config.storage.run_dir}",
            file=sys.stderr,
        )
        return 130
    print(f"done: {summary['end_step']} steps in {summary['wall_s']:.0f}s", flush=True)
    return 0


def resume(run_dir: str) -> int:
    """`rlax-tpu resume RUN_DIR`: the run's own config, continued."""
    url = storage.join(run_dir, "config.json")
    if not storage.exists(url):
        print(f"rlax-tpu resume: {run_dir} holds no run (config.json is missing)", file=sys.stderr)
        return 2
    return main(load_config(url, []))
