#!/usr/bin/env python3
"""Pre-filter a prompt dataset by the pass rate of a checkpoint (before an RL run).

    python tools/prefilter.py CONFIG --dataset PATH --checkpoint HF_DIR --out DIR
        [--samples K] [--min-pass 0.1] [--max-pass 0.9] [--verifier KIND] [--set key=value ...]

Prompts a model always solves or never solves give a group of equal rewards, so no
gradient (group-baselined advantages are exactly 0); filtering them out before the run saves
their generation. This tool starts the run's own components with the local launcher (the
parameter server, the verifier service, `inference.num_workers` inference workers, and the
trainer, which publishes the checkpoint as version 0 for the workers to pull), samples K
responses per prompt with the config's sampling settings, scores them with the verifiers
and writes to DIR (local or gs://):

    pass_rates.jsonl  {"id", "pass_rate", "k"} per row in dataset order (a row that cannot be
                      generated, e.g. a prompt over inference.max_prompt_len, gets
                      pass_rate null, k 0 and an "error")
    filtered.jsonl    the dataset's original rows whose pass rate is in [min, max]
    summary.json      what was run (config digest, checkpoint, K, band) and the counts

A sample passes when its reward is >= 1 (the controller's accuracy). Request ids and PRNG
keys derive from (prompt id, sample index, version 0, config seed), so for a fixed seed the
outputs do not depend on the number of workers or the order replies arrive in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlax_tpu import storage  # noqa: E402
from rlax_tpu.config import DatasetConfig, RunConfig, load_config  # noqa: E402

_log = logging.getLogger("prefilter")

VERSION = 0  # the checkpoint, as the trainer publishes it
FINAL_REASONS = ("stop", "length")
VERIFY_CHUNK = 256  # well under the verifier service's queue (a batch over it is refused whole)


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
    ids: Sequence[str], rewards: dict[tuple[str, int], float], samples: int
) -> list[dict[str, Any]]:
    """{"id", "pass_rate", "k"} per id, in order; rewards[(id, i)] for i < samples."""
    out = []
    for prompt_id in ids:
        passes = sum(rewards[(prompt_id, i)] >= 1.0 for i in range(samples))
        out.append({"id": prompt_id, "pass_rate": passes / samples, "k": samples})
    return out


def jsonl(rows: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def read_rows(path: str) -> list[Any]:
    """The dataset's rows as they are in the file (JSON objects), in file order: what
    `load_dataset` parses, row for row."""
    from rlax_tpu.controller import datasets

    reader = datasets._read_parquet_rows if path.endswith(".parquet") else datasets._read_json_rows
    return [row for _, row in reader(path)]


# -- generation and scoring through the run's components ------------------------------------------
def _encode(tokenizer: Any, record: Any) -> list[int]:
    if record.messages:
        return tokenizer.encode_chat(list(record.messages), add_generation_prompt=True)
    return tokenizer.encode(record.prompt)


def _generate(workers: list[Any], jobs: list[list[Any]]) -> dict[str, Any]:
    """Rollouts by request id; one thread per worker takes jobs (lists of requests) in turn."""
    todo: queue.Queue[list[Any]] = queue.Queue()
    for job in jobs:
        todo.put(job)
    got: dict[str, Any] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        client = workers[i]
        try:
            client.load(VERSION)
            while not errors:
                try:
                    requests = todo.get_nowait()
                except queue.Empty:
                    return
                while requests:  # aborted requests (a reload overtook them) go again
                    retry = []
                    for rollout in client.generate(requests, version=VERSION):
                        if rollout.finish_reason in FINAL_REASONS:
                            with lock:
                                got[rollout.request_id] = rollout
                        elif rollout.finish_reason == "aborted":
                            retry.append(rollout.request_id)
                        else:
                            raise PrefilterError(
                                f"request {rollout.request_id} failed on worker {i}: "
                                f"{rollout.error}"
                            )
                    again = set(retry)
                    requests = [r for r in requests if r.request_id in again]
        except Exception as e:  # noqa: BLE001 - reported once all threads stop
            errors.append(f"inference worker {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise PrefilterError(errors[0])
    return got


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
    chunk_prompts: int = 64,
) -> dict[str, Any]:
    """Evaluate `dataset` with `checkpoint` (K = `samples` per prompt) and write the pass
    rates and the filtered dataset under `out`; returns the summary (also written)."""
    from rlax_tpu.controller import job
    from rlax_tpu.controller.datasets import dataset_name, load_dataset
    from rlax_tpu.controller.launcher import LocalCluster
    from rlax_tpu.inference.engine import GenerationRequest
    from rlax_tpu.inference.sampling import SamplingParams
    from rlax_tpu.inference.service import InferenceWorkerClient
    from rlax_tpu.models.tokenizer import Tokenizer
    from rlax_tpu.verifiers.service import VerifierClient
    from rlax_tpu.verifiers.types import VerificationRequest

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    default_verifier = verifier or (
        config.controller.datasets[0].verifier if config.controller.datasets else "math"
    )
    records = load_dataset(DatasetConfig(path=dataset, verifier=default_verifier))
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
        controller=dataclasses.replace(config.controller, sft_steps=0),
        storage=dataclasses.replace(config.storage, run_dir=str(work)),
    )
    effective = job.materialise(config)  # a built-in tokenizer is written into the work dir
    tokenizer = Tokenizer.load(job.tokenizer_path(effective))
    config_url = str(work / job.EFFECTIVE_CONFIG)
    storage.write_text(config_url, json.dumps(effective.to_dict(), indent=2))

    eos = tokenizer.eos_token_id
    stops = tuple(effective.inference.stop_token_ids or ((eos,) if eos is not None else ()))
    sampling = dataclasses.replace(
        SamplingParams.from_config(effective.inference), stop_token_ids=stops
    )
    limit = effective.inference.max_prompt_len
    errors: dict[str, str] = {}  # record id -> why it has no pass rate
    prompts: list[tuple[str, Any, tuple[int, ...]]] = []  # (prompt id, record, tokens)
    for record in records:
        tokens = tuple(int(t) for t in _encode(tokenizer, record))
        if record.verifier == "none":
            errors[record.id] = "not scored (verifier 'none')"
        elif len(tokens) > limit:
            errors[record.id] = (
                f"{len(tokens)} prompt tokens, more than inference.max_prompt_len={limit}"
            )
        else:
            prompts.append((f"prefilter:{name}:{record.id}", record, tokens))
    jobs = [
        [
            GenerationRequest(
                request_id=f"{prompt_id}/s{i}",
                prompt_id=prompt_id,
                sample_index=i,
                prompt_tokens=tokens,
                sampling=sampling,
            )
            for prompt_id, _, tokens in prompts[start : start + chunk_prompts]
            for i in range(samples)
        ]
        for start in range(0, len(prompts), chunk_prompts)
    ]

    t0 = time.perf_counter()
    failed = True
    try:
        with LocalCluster(
            config_url,
            num_workers=effective.inference.num_workers,
            log_dir=work / "logs",
            param_storage=str(work / "params"),
            token_env=effective.param_server.auth_token_env,
        ) as cluster:
            cluster.start()
            token = cluster.token
            workers = [
                InferenceWorkerClient(a, auth_token=token)
                for a in cluster.addresses["inference_worker"]
            ]
            rollouts = _generate(workers, jobs)
            if cluster.failure:
                raise PrefilterError(cluster.failure)
            keys, requests = [], []
            for prompt_id, record, _ in prompts:
                for i in range(samples):
                    rollout = rollouts[f"{prompt_id}/s{i}"]
                    text = tokenizer.decode(
                        [t for t in rollout.tokens if t not in stops], skip_special_tokens=True
                    )
                    keys.append((record.id, i))
                    requests.append(
                        VerificationRequest(
                            kind=record.verifier,
                            response=text,
                            reference=record.reference,
                            problem=record.problem,
                            request_id=rollout.request_id,
                        )
                    )
            verifier_client = VerifierClient(cluster.addresses["verifier"][0], auth_token=token)
            results = []
            for start in range(0, len(requests), VERIFY_CHUNK):
                results += verifier_client.verify(requests[start : start + VERIFY_CHUNK])
        failed = False
    finally:
        if failed:
            print(f"prefilter: failed; component logs are in {work / 'logs'}", file=sys.stderr)
        elif own_work_dir:
            shutil.rmtree(work, ignore_errors=True)

    rewards = {key: float(r.reward) for key, r in zip(keys, results, strict=True)}
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
        "errors": len(errors),
        "always_solved": sum(r == 1.0 for r in measured),
        "never_solved": sum(r == 0.0 for r in measured),
        "mean_pass_rate": sum(measured) / len(measured) if measured else None,
    }
    storage.write_text(storage.join(out, "summary.json"), json.dumps(summary, indent=2) + "\n")
    print(
        f"prefilter: {len(records)} prompts x {samples} samples in "
        f"{time.perf_counter() - t0:.0f}s; kept {len(kept)} with pass rate in "
        f"[{band.low}, {band.high}] ({summary['never_solved']} never solved, "
        f"{summary['always_solved']} always solved, {len(errors)} not generated) -> {out}",
        flush=True,
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a configs/*.py file or a run's config.json")
    parser.add_argument("--dataset", required=True, help="JSONL or Parquet prompts (local, gs://)")
    parser.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--samples", type=int, default=8, help="K samples per prompt")
    parser.add_argument("--min-pass", type=float, default=0.1)
    parser.add_argument("--max-pass", type=float, default=0.9)
    parser.add_argument("--out", required=True, help="output directory (local or gs://)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="verifier of rows without a 'verifier' field (default: the config's first dataset's)",
    )
    parser.add_argument(
        "--work-dir", default=None, help="scratch run directory (default: a temporary one)"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override key=value"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        band = Band(args.min_pass, args.max_pass)
        config = load_config(args.config, args.overrides)
        prefilter(
            config,
            dataset=args.dataset,
            checkpoint=args.checkpoint,
            samples=args.samples,
            band=band,
            out=args.out,
            verifier=args.verifier,
            work_dir=args.work_dir,
        )
    except (ValueError, RuntimeError) as e:  # config, dataset, component or request errors
        print(f"prefilter: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
