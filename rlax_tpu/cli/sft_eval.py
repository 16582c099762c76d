"""`rlax-tpu sft` and `rlax-tpu eval`: the SFT warm start alone, and a model's held-out
greedy accuracy, both in this process.

`sft` is the warm start `rlax-tpu run` does before RL (the same steps on the same stream:
controller/warm_start.py), on a trainer in this process (launch/job.py: `warm_start`):
its checkpoint lands in RUN_DIR/checkpoints_warm_start, where a later `rlax-tpu run` of the
same config finds it and starts RL from it, and a Hugging Face export in RUN_DIR/sft_model.

`eval` measures what the controller's held-out evaluation measures — the first
`controller.eval_size` prompts of `controller.eval_dataset`, encoded, greedily generated
(the config's stop tokens, else EOS), decoded and judged as in `Controller.evaluate`, a
prompt counting when its reward is >= 1 — but with the inference `Engine` and a
`LocalVerifier` in this process instead of the run's services. The model is the newest one
the run directory holds (the trainer's newest checkpoint, else the SFT export, else the
config's `model.hf_checkpoint`) or a Hugging Face directory given with --model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from rlax_tpu.config import ModelConfig, RunConfig, load_config

CHECKPOINTS_DIR = "checkpoints"  # the RL trainer's, under the run directory


class EvalError(Exception):
    """The evaluation cannot run as asked; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The weights to evaluate: a Hugging Face directory, or the trainer checkpoints of a run
    (restored through `Trainer.restore`, so a damaged newest one falls back to the previous)."""

    kind: Literal["hf", "checkpoint"]
    path: str


@dataclasses.dataclass(frozen=True)
class EvalResult:
    model: str  # what was evaluated, for people
    dataset: str
    accuracy: float  # over distinct problems: the fraction with reward >= 1
    num_correct: int  # prompts
    problems: list[dict[str, Any]]  # per prompt: id, response, reward, verdict
    distinct: int  # distinct problems among the prompts (a repeated one counts once)
    overlap: dict[str, Any] | None = None  # the held-out set's overlap with the training data

    @property
    def num_problems(self) -> int:
        return len(self.problems)

    @property
    def interval95(self) -> tuple[float, float]:
        from rlax_tpu.controller.evaluation import wilson_interval

        return wilson_interval(self.accuracy, self.distinct)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "eval_dataset": self.dataset,
            "accuracy": self.accuracy,
            "accuracy_interval95": list(self.interval95),
            "num_correct": self.num_correct,
            "num_problems": self.num_problems,
            "distinct_problems": self.distinct,
            "overlap_with_training": self.overlap,
            "problems": self.problems,
        }


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face model directory (local or gs://) to evaluate; default: the newest "
        "model in the run directory (trainer checkpoint, else sft_model/)",
    )
    parser.add_argument(
        "--json",
        metavar="OUT",
        help="also write the result, with each problem's response and reward, to OUT",
    )


# -- sft ---------------------------------------------------------------------------------------
def sft_main(args: argparse.Namespace) -> int:
    """`rlax-tpu sft CONFIG`: the warm start of `rlax-tpu run`, and nothing after it."""
    config = load_config(args.config, args.overrides)
    if not config.trainer.warm_start.steps:
        print(
            "rlax-tpu sft: trainer.warm_start.steps is 0 in this config, so there is nothing to "
            "train; give the number of SFT steps, e.g. --set trainer.warm_start.steps=800 (and "
            "trainer.warm_start.learning_rate)",
            file=sys.stderr,
        )
        return 2
    from rlax_tpu import storage
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.launch.job import SFT_MODEL_DIR, materialise, tokenizer_path, warm_start
    from rlax_tpu.models import CheckpointError
    from rlax_tpu.run_dir import prepare_run_dir
    from rlax_tpu.runtime import configure_jax

    configure_jax(config)  # before anything starts JAX
    run_dir = prepare_run_dir(config)  # the run directory belongs to this config from now on
    effective = materialise(config)
    tokenizer = Tokenizer.load(tokenizer_path(effective))
    reused = storage.exists(storage.join(run_dir, SFT_MODEL_DIR, "config.json"))
    print(
        f"sft {config.name!r}: {config.trainer.warm_start.steps} steps, run dir {run_dir}",
        flush=True,
    )
    try:
        model_dir = warm_start(effective, tokenizer)
    except (CheckpointError, FileNotFoundError) as e:  # model.hf_checkpoint is unusable
        print(f"rlax-tpu sft: {e}", file=sys.stderr)
        return 2
    print(f"SFT model{' (already there, reused)' if reused else ''}: {model_dir}", flush=True)
    if effective.controller.eval_dataset:
        try:
            result = evaluate(effective, ModelSource("hf", model_dir), tokenizer)
        except EvalError as e:
            print(f"rlax-tpu sft: held-out evaluation: {e}", file=sys.stderr)
            return 2
        _print_result(result)
    print(f"RL from it: rlax-tpu run {args.config} (with the same --set options)", flush=True)
    return 0


# -- eval --------------------------------------------------------------------------------------
def eval_main(args: argparse.Namespace) -> int:
    """`rlax-tpu eval CONFIG [--model DIR] [--json OUT]`."""
    from rlax_tpu.checkpoints import NoValidCheckpointError
    from rlax_tpu.data.datasets import DatasetError
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.launch.job import materialise, tokenizer_path
    from rlax_tpu.models import CheckpointError
    from rlax_tpu.runtime import configure_jax

    config = load_config(args.config, args.overrides)
    configure_jax(config)
    try:
        source = ModelSource("hf", args.model) if args.model else newest_model(config)
        effective = materialise(config)
        tokenizer = Tokenizer.load(tokenizer_path(effective))
        result = evaluate(effective, source, tokenizer)
    except (
        EvalError,
        DatasetError,
        CheckpointError,
        FileNotFoundError,
        NoValidCheckpointError,
    ) as e:
        print(f"rlax-tpu eval: {e}", file=sys.stderr)
        return 2
    _print_result(result)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _print_result(result: EvalResult) -> None:
    print(f"model: {result.model}")
    print(
        f"held-out greedy accuracy: {result.accuracy:.3f} ({result.num_correct}/"
        f"{result.num_problems} prompts, {result.distinct} distinct problems, of "
        f"{result.dataset}; 95 % interval "
        f"{result.interval95[0]:.3f}–{result.interval95[1]:.3f})",
        flush=True,
    )


def newest_model(config: RunConfig) -> ModelSource:
    """The newest model of the run in `config.storage.run_dir`: a finalized trainer
    checkpoint, else the SFT export, else the model the run starts from."""
    from rlax_tpu import storage
    from rlax_tpu.launch.job import SFT_MODEL_DIR

    run_dir = config.storage.run_dir
    checkpoints = storage.join(run_dir, CHECKPOINTS_DIR)
    if finalized_steps(checkpoints):
        return ModelSource("checkpoint", checkpoints)
    sft_model = storage.join(run_dir, SFT_MODEL_DIR)
    if storage.exists(storage.join(sft_model, "config.json")):  # save_hf writes it last
        return ModelSource("hf", sft_model)
    if config.model.hf_checkpoint:
        return ModelSource("hf", config.model.hf_checkpoint)
    raise EvalError(
        f"the run directory {run_dir} holds no model yet (no trainer checkpoint under "
        f"{CHECKPOINTS_DIR}/, no {SFT_MODEL_DIR}/) and the config names no "
        "model.hf_checkpoint: run `rlax-tpu sft` or `rlax-tpu run` with this config first, "
        "or name a Hugging Face model directory with --model DIR"
    )


def finalized_steps(directory: str) -> list[int]:
    """Steps of the trainer checkpoints under `directory` whose save finished."""
    from rlax_tpu import storage
    from rlax_tpu.checkpoints import COMMIT_MARKER

    try:
        names = storage.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        int(name)
        for name in names
        if name.isdigit() and storage.exists(storage.join(directory, name, COMMIT_MARKER))
    )


def load_model(config: RunConfig, source: ModelSource) -> tuple[ModelConfig, Any, str]:
    """(the model's config, its params as a pure dict, a description) of `source`."""
    if source.kind == "hf":
        from rlax_tpu.models.hf import load_hf_config, load_hf_params

        # The architecture is the checkpoint's; precision is this run's choice.
        model = load_hf_config(
            source.path, param_dtype=config.model.param_dtype, dtype=config.model.dtype
        )
        return model, load_hf_params(source.path, model), f"Hugging Face model {source.path}"
    from rlax_tpu.trainer import Trainer

    trainer = Trainer(checkpoint_config(config))
    try:
        step = trainer.restore()
        params = trainer.params()
    finally:
        trainer.close()
    return trainer.config.model, params, f"trainer checkpoint of step {step} ({source.path})"


def checkpoint_config(config: RunConfig) -> RunConfig:
    """The config the run's trainer had (its checkpoints' shapes and optimizer state follow
    it): the run's effective_config.json when there is one, else `config`; on this config's
    trainer mesh, since a checkpoint restores onto any mesh."""
    from rlax_tpu import storage
    from rlax_tpu.run_dir import EFFECTIVE_CONFIG

    url = storage.join(config.storage.run_dir, EFFECTIVE_CONFIG)
    if not storage.exists(url):
        return config
    run = RunConfig.from_dict(json.loads(storage.read_text(url)))
    return dataclasses.replace(
        run,
        cpu_devices=config.cpu_devices,
        trainer=dataclasses.replace(run.trainer, mesh=config.trainer.mesh),
        storage=dataclasses.replace(run.storage, run_dir=config.storage.run_dir),
    )


def held_out_records(config: RunConfig, tokenizer: Any) -> list[Any]:
    """The first `controller.eval_size` prompts of `controller.eval_dataset`, read and
    scanned as the run reads them (datasets.load_eval_prompts)."""
    from rlax_tpu.data.datasets import load_eval_prompts

    if not config.controller.eval_dataset:
        raise EvalError(
            "the config has no held-out set: set controller.eval_dataset (a .jsonl or .parquet "
            "dataset, or builtin:arithmetic) and controller.eval_size"
        )
    return load_eval_prompts(config, tokenizer)


def evaluate(config: RunConfig, source: ModelSource, tokenizer: Any) -> EvalResult:
    """Held-out greedy accuracy of `source` on `config` (materialised: dataset paths real),
    after checking the held-out set against the training data (DatasetError over
    controller.max_eval_overlap)."""
    from rlax_tpu.controller.evaluation import accuracy_over_problems
    from rlax_tpu.data.datasets import held_out_overlap, load_prompts

    records = held_out_records(config, tokenizer)
    overlap = None
    if config.training_datasets:
        overlap = held_out_overlap(config, load_prompts(config, tokenizer)[0], records, tokenizer)
        print(overlap.describe(), file=sys.stderr, flush=True)
    model_config, params, description = load_model(config, source)
    responses = greedy_responses(config, model_config, params, tokenizer, records)
    del params
    results = score(config, records, responses)
    problems = [
        {
            "dataset": r.dataset,
            "id": r.id,
            "response": response,
            "reward": result.reward if result else 0.0,
            "verdict": str(result.verdict) if result else "unscored",
        }
        for r, response, result in zip(records, responses, results, strict=True)
    ]
    correct = sum(p["reward"] >= 1.0 for p in problems)
    accuracy, distinct = accuracy_over_problems(records, [p["reward"] for p in problems])
    return EvalResult(
        model=description,
        dataset=config.controller.eval_dataset,
        accuracy=accuracy,
        num_correct=correct,
        problems=problems,
        distinct=distinct,
        overlap=None if overlap is None else overlap.to_json(),
    )


def greedy_responses(
    config: RunConfig,
    model_config: ModelConfig,
    params: Any,
    tokenizer: Any,
    records: Sequence[Any],
) -> list[str]:
    """Each record's greedy response text, generated by the inference engine on the config's
    inference mesh (stop tokens removed, special tokens skipped)."""
    from rlax_tpu.api.inference import GenerationRequest, SamplingParams
    from rlax_tpu.data.datasets import decode_response, encode_prompt, stop_tokens
    from rlax_tpu.inference.engine import Engine
    from rlax_tpu.sharding import build_mesh

    stops = stop_tokens(config.inference.stop_token_ids, tokenizer)
    greedy = dataclasses.replace(
        SamplingParams.from_config(config.inference), stop_token_ids=stops, temperature=0.0
    )
    requests = [
        GenerationRequest(
            request_id=f"eval:{r.dataset}:{r.id}",
            prompt_id=f"eval:{r.dataset}:{r.id}",
            sample_index=0,
            prompt_tokens=encode_prompt(tokenizer, r, config.inference.max_prompt_len),
            sampling=greedy,
        )
        for r in records
    ]
    engine = Engine(
        model_config, config.inference, seed=config.seed, mesh=build_mesh(config.inference.mesh)
    )
    engine.load(0, params)
    rollouts = engine.run(requests)
    failed = [r for r in rollouts if r.finish_reason == "error"]
    if failed:
        raise EvalError(
            f"{len(failed)} of {len(rollouts)} prompts could not be generated; the first, "
            f"{failed[0].prompt_id}: {failed[0].error}"
        )
    return [decode_response(tokenizer, r.tokens, stops) for r in rollouts]


def score(config: RunConfig, records: Sequence[Any], responses: Sequence[str]) -> list[Any]:
    """Each response's VerificationResult from the local verifiers (None for a record whose
    verifier is "none"), built as `rlax-tpu serve verifier` builds them."""
    from rlax_tpu.controller.scoring import verification_request
    from rlax_tpu.verifiers import LocalVerifier
    from rlax_tpu.verifiers.code import CodeVerifier
    from rlax_tpu.verifiers.local import pool_for
    from rlax_tpu.verifiers.repository import ProblemResolver
    from rlax_tpu.verifiers.server import default_cache_dir

    requests = {
        i: verification_request(r, response, f"eval:{r.dataset}:{r.id}")
        for i, (r, response) in enumerate(zip(records, responses, strict=True))
        if r.verifier != "none"
    }
    if not requests:
        return [None] * len(records)
    pool = pool_for(config.verifiers)
    try:
        verifier = LocalVerifier(
            config.verifiers,
            pool,
            code_verifier=CodeVerifier(config.verifiers),
            problem_resolver=ProblemResolver(default_cache_dir()),
        )
        judged = dict(zip(requests, verifier.verify_many(list(requests.values())), strict=True))
    finally:
        pool.close()
    return [judged.get(i) for i in range(len(records))]
