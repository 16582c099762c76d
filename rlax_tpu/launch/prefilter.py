"""Pre-filter a prompt dataset by the pass rate of a checkpoint, before an RL run
(`rlax-tpu prefilter CONFIG --dataset PATH --checkpoint HF_DIR --out DIR`).

Prompts a model always solves or never solves give a group of equal rewards, so no gradient
(group-baselined advantages are exactly 0); filtering them out before the run saves their
generation. The run's own components do the work, started by the local launcher (the
parameter server, the verifier service, `inference.num_workers` inference workers, and the
trainer, which publishes the checkpoint as version 0 for the workers to pull); the
controller's generation pool samples K responses per prompt with the config's sampling
settings and its scorer judges them, verdict-aware as in a run. Written to DIR (local or
gs://):

    pass_rates.jsonl  {"id", "pass_rate", "k"} per row in dataset order; a row without a
                      pass rate (a prompt over inference.max_prompt_len, verifier "none", a
                      sample the verifier could not judge after its retries) gets
                      pass_rate null, k 0 and an "error"
    filtered.jsonl    the dataset's original rows whose pass rate is in [min, max]
    summary.json      what was run (config digest, checkpoint, K, band) and the counts

A sample passes when its reward is >= 1 (the controller's accuracy). Request ids and PRNG
keys derive from (prompt id, sample index, version 0, config seed), so for a fixed seed the
outputs do not depend on the number of workers or the order replies arrive in.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu import storage
from rlax_tpu.api.inference import GenerationRequest, InferenceWorkerClient, SamplingParams
from rlax_tpu.api.verifier import VerifierClient
from rlax_tpu.config import DatasetConfig, RunConfig
from rlax_tpu.controller.generation import GenerationPool, rollout_record
from rlax_tpu.controller.scoring import Scorer, ServiceVerifier
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.controller.workers import WorkerThreads
from rlax_tpu.data import datasets
from rlax_tpu.data.datasets import (
    DatasetError,
    dataset_name,
    encode_prompt,
    held_out_overlap,
    load_dataset,
    load_eval_prompts,
    stop_tokens,
)
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.launch import job
from rlax_tpu.launch.launcher import LocalCluster
from rlax_tpu.run_dir import EFFECTIVE_CONFIG

VERSION = 0  # the checkpoint, as the trainer publishes it


class PrefilterError(RuntimeError):
    """The pre-filter cannot finish (a component failed, a request errored, ...)."""


@dataclasses.dataclass(frozen=True)
class Band:
    """Pass rates kept: [low, high], both inclusive."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(
                f"the pass-rate band must satisfy 0 <= min <= max <= 1, got "
                f"[{self.low}, {self.high}]"
            )

    def keeps(self, pass_rate: float | None) -> bool:
        return pass_rate is not None and self.low <= pass_rate <= self.high


# -- the pure part --------------------------------------------------------------------------------
def pass_rates(
    ids: Sequence[str], rewards: Mapping[tuple[str, int], float | None], samples: int
) -> list[dict[str, Any]]:
    """{"id", "pass_rate", "k"} per id, in order, from rewards[(id, i)] for i < samples. A
    reward of None is a sample the verifier could not judge: its prompt gets no pass rate
    (counting it as a failure would bias the rate down)."""
    out = []
    for prompt_id in ids:
        group = [rewards[(prompt_id, i)] for i in range(samples)]
        unjudged = sum(r is None for r in group)
        if unjudged:
            out.append(
                {
                    "id": prompt_id,
                    "pass_rate": None,
                    "k": 0,
                    "error": f"{unjudged} of {samples} samples unjudged by the verifier",
                }
            )
            continue
        passes = sum(r >= 1.0 for r in group)
        out.append({"id": prompt_id, "pass_rate": passes / samples, "k": samples})
    return out


def jsonl(rows: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def read_rows(path: str) -> list[Any]:
    """The dataset's rows as they are in the file (JSON objects), in file order: what
    `load_dataset` parses, row for row."""

    reader = datasets._read_parquet_rows if path.endswith(".parquet") else datasets._read_json_rows
    return [row for _, row in reader(path)]


# -- generation and scoring through the run's components ------------------------------------------
def prefilter(
    config: RunConfig,
    *,
    dataset: str,
    checkpoint: str,
    samples: int,
    band: Band,
    out: str,
    verifier: str | None = None,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Evaluate `dataset` with `checkpoint` (K = `samples` per prompt) and write the pass
    rates and the filtered dataset under `out`; returns the summary (also written)."""

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    # Read like the run's first dataset (field mapping, template), unless told the verifier;
    # no SFT target: its rows are only generated for and judged.
    trained = config.training_datasets
    base = trained[0] if trained else DatasetConfig(path=dataset)
    base = dataclasses.replace(base, path=dataset, weight=1.0, sft_field="")
    if verifier and verifier != base.verifier:
        base = dataclasses.replace(base, verifier=verifier, reward_function="")
    records = load_dataset(base)
    rows = read_rows(dataset)
    name = dataset_name(DatasetConfig(path=dataset))

    own_work_dir = work_dir is None
    work = Path(work_dir or tempfile.mkdtemp(prefix="rlax-prefilter-")).resolve()
    if work.exists() and any(work.iterdir()):
        # A trainer would restore the checkpoint left there, not start from `checkpoint`.
        raise PrefilterError(
            f"the work dir {work} is not empty (a previous run's weights and logs); "
            "remove it or name a new one"
        )
    work.mkdir(parents=True, exist_ok=True)
    digest = config.digest()
    # The components run as for a fresh run of `config` from the checkpoint, in a scratch
    # run directory (its params/, checkpoints/ and logs/ are not outputs).
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, hf_checkpoint=checkpoint),
        trainer=dataclasses.replace(
            config.trainer, warm_start=dataclasses.replace(config.trainer.warm_start, steps=0)
        ),
        storage=dataclasses.replace(config.storage, run_dir=str(work)),
    )
    effective = job.materialise(config)  # a built-in tokenizer is written into the work dir
    tokenizer = Tokenizer.load(job.tokenizer_path(effective))
    # The rows filtered here are for training: held out means held out, for them too.
    try:
        overlap = held_out_overlap(
            effective, {name: records}, load_eval_prompts(effective, tokenizer), tokenizer
        )
    except DatasetError:
        if own_work_dir:
            shutil.rmtree(work, ignore_errors=True)
        raise
    if overlap is not None:
        print(f"prefilter: {overlap.describe()}", file=sys.stderr, flush=True)
    config_url = str(work / EFFECTIVE_CONFIG)
    storage.write_text(config_url, json.dumps(effective.to_dict(), indent=2))

    stops = stop_tokens(effective.inference.stop_token_ids, tokenizer)
    sampling = dataclasses.replace(
        SamplingParams.from_config(effective.inference), stop_token_ids=stops
    )
    errors: dict[str, str] = {}  # record id -> why it has no pass rate
    prompts: list[tuple[str, Any, tuple[int, ...]]] = []  # (prompt id, record, tokens)
    for record in records:
        if record.verifier == "none":
            errors[record.id] = "not scored (verifier 'none')"
            continue
        try:
            tokens = encode_prompt(tokenizer, record, effective.inference.max_prompt_len)
        except DatasetError as e:
            errors[record.id] = str(e)
            continue
        prompts.append((f"prefilter:{name}:{record.id}", record, tokens))

    t0 = time.perf_counter()
    counters: dict[str, Any] = {}
    failed = True
    try:
        rewards = _judge_samples(
            effective, config_url, work, prompts, samples, sampling, tokenizer, counters
        )
        failed = False
    finally:
        if failed:
            print(f"prefilter: failed; component logs are in {work / 'logs'}", file=sys.stderr)
        elif own_work_dir:
            shutil.rmtree(work, ignore_errors=True)

    rates = {r["id"]: r for r in pass_rates([p[1].id for p in prompts], rewards, samples)}
    table = [
        rates.get(record.id)
        or {"id": record.id, "pass_rate": None, "k": 0, "error": errors[record.id]}
        for record in records
    ]
    kept = [row for row, rate in zip(rows, table, strict=True) if band.keeps(rate["pass_rate"])]
    storage.write_text(storage.join(out, "pass_rates.jsonl"), jsonl(table))
    # The kept rows exactly as the dataset holds them (key order too).
    filtered = "".join(json.dumps(row, default=str) + "\n" for row in kept)
    storage.write_text(storage.join(out, "filtered.jsonl"), filtered)
    measured = [r["pass_rate"] for r in table if r["pass_rate"] is not None]
    summary = {
        "dataset": dataset,
        "checkpoint": checkpoint,
        "config_digest": digest,
        "seed": config.seed,
        "samples": samples,
        "temperature": sampling.temperature,
        "band": [band.low, band.high],
        "prompts": len(records),
        "kept": len(kept),
        "errors": len(records) - len(measured),
        "unjudged_samples": counters.get("verify_unjudged", 0),
        "verify_retries": counters.get("verify_retries", 0),
        "always_solved": sum(r == 1.0 for r in measured),
        "never_solved": sum(r == 0.0 for r in measured),
        "mean_pass_rate": sum(measured) / len(measured) if measured else None,
        "eval_overlap": None if overlap is None else overlap.to_json(),
    }
    storage.write_text(storage.join(out, "summary.json"), json.dumps(summary, indent=2) + "\n")
    print(
        f"prefilter: {len(records)} prompts x {samples} samples in "
        f"{time.perf_counter() - t0:.0f}s; kept {len(kept)} with pass rate in "
        f"[{band.low}, {band.high}] ({summary['never_solved']} never solved, "
        f"{summary['always_solved']} always solved, {summary['errors']} without a pass "
        f"rate) -> {out}",
        flush=True,
    )
    return summary


def _judge_samples(
    config: RunConfig,
    config_url: str,
    work: Path,
    prompts: Sequence[tuple[str, Any, tuple[int, ...]]],
    samples: int,
    sampling: Any,
    tokenizer: Any,
    counters: dict[str, Any],
) -> dict[tuple[str, int], float | None]:
    """{(record id, sample index): reward, None if unjudged} of `samples` responses per
    prompt, generated by the launched workers with version 0 and judged by the verifier
    service with the run's retries (`controller.verify.retries`)."""

    ctl = config.controller
    requests = [
        GenerationRequest(
            request_id=f"{prompt_id}/s{i}",
            prompt_id=prompt_id,
            sample_index=i,
            prompt_tokens=tokens,
            sampling=sampling,
        )
        for prompt_id, _, tokens in prompts
        for i in range(samples)
    ]
    with LocalCluster(
        config_url,
        num_workers=config.inference.num_workers,
        log_dir=work / "logs",
        param_storage=str(work / "params"),
        token_env=config.param_server.auth_token_env,
        config=config,
    ) as cluster:
        cluster.start()
        token = cluster.token
        workers = [
            InferenceWorkerClient(a, auth_token=token)
            for a in cluster.addresses["inference_worker"]
        ]
        threads = WorkerThreads(workers, sampling=sampling, counters=counters)
        log = RolloutLog(str(work))
        pool = GenerationPool(threads, log, samples=samples)
        pool.start()
        try:
            rollouts = pool.generate(requests, VERSION)
        finally:
            pool.stop()
            log.close()
        if cluster.failure:
            raise PrefilterError(cluster.failure)
        verifier = ServiceVerifier(
            [VerifierClient(a, auth_token=token) for a in cluster.addresses["verifier"]]
        )
        scorer = Scorer(
            verifier,
            tokenizer,
            sampling.stop_token_ids,
            retries=ctl.verify.retries,
            backoff_s=ctl.verify.retry_backoff_s,
            max_unjudged_fraction=ctl.verify.max_unjudged_fraction,
            counters=counters,
        )
        records = {prompt_id: record for prompt_id, record, _ in prompts}
        items = [
            (records[q.prompt_id], rollout_record(-1, rollouts[q.request_id])) for q in requests
        ]
        judgements = scorer.judge(items, what="the pre-filter's samples")
    return {
        (records[q.prompt_id].id, q.sample_index): j.reward
        for q, j in zip(requests, judgements, strict=True)
    }
