#!/usr/bin/env python3
"""LoRA against full fine-tuning: what a version costs to publish and load, and what a train
step costs in time and memory, at the demo's model size and at ~20M parameters.

    python tools/bench_lora.py [--sizes demo,20m] [--rank 8] [--versions 5] [--json OUT]

In one process per size: a real parameter server (gRPC on loopback, TensorStore storage in
a temporary directory), a trainer on this machine's CPU devices and an inference worker
pulling from it. For each mode (full, then LoRA on the attention projections at --rank) the
trainer trains --versions steps on synthetic rollouts (the same batches for both modes);
each step publishes a version and the worker loads it (prefetch off, so a load pulls
every byte). Figures, medians over the versions:

* `publish_ms`: the trainer's publish of a version (the step's `time/publish_s`): the whole
  model, or the adapters and the base's 32-byte digest;
* `publish_ready_ms`: the same publish (as another version) timed after the step's own,
  once every array of the step is ready: on a 2-core CPU the publish right after a step
  waits on the devices for work the step leaves queued (not the step's outputs: blocking on
  them first does not remove it), which this figure leaves out;
* `load_ms`: the worker's load of it (pull + placement; with LoRA the adapters joined to the
  base the worker holds); `first_load_ms`: version 0's, which with LoRA also reads the base
  from the run's base store once;
* `publish_load_bytes`: the bytes of a version on the parameter server;
* `step_s`: the jitted train step after its compile (without the publish);
* `generate_tokens_per_s`: the worker generating a batch of 32-token responses from the
  last version (LoRA: the adapters unmerged in every adapted matmul; full: none);
* `trainer_state_bytes`: params + optimizer state + reference copy held by the trainer;
  `rl_step_temp_bytes`: the compiled rl_step's temporaries (XLA's memory analysis);
* `model_flops`, `model_flops_per_s`, `peak_flops`, `mfu`: the train step's model FLOPs as
  the trainer counts them (6·N a token; LoRA 4·N + 2·adapters), over `step_s`, against the
  measured matmul peak of this process's devices (the model dtype); `generate_*` the same
  for generation (2·N + attention a response token, the base model's: LoRA's unmerged
  adapters are not model work) at `generate_tokens_per_s`.

The table prints LoRA / full for each figure (and full / LoRA for publish + load, the
issue's "≥ 20× less time" at rank 8 on the 20M model), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_e2e import SIZE_20M  # noqa: E402

from rlax_tpu.algorithms import RolloutBatch  # noqa: E402
from rlax_tpu.config import RunConfig  # noqa: E402
from rlax_tpu.config.loader import load_config  # noqa: E402
from rlax_tpu.hardware import host_cpu  # noqa: E402
from rlax_tpu.runtime import configure_jax  # noqa: E402

# The demo's model, and tools/bench_e2e.py's 20m size (19M parameters; its warm start and
# step count are overridden by COMMON).
SIZES = {"demo": [], "20m": SIZE_20M}
EXTRA_VERSIONS = 10_000  # the version numbers of the publishes timed apart from the step
COMMON = [
    "trainer.warm_start.steps=0",
    "inference.prefetch_weights=false",
    "trainer.checkpoint_every=1000",
    "controller.num_steps=1000",
    # Responses long enough that generation is mostly decode (the demo's are 4 tokens).
    "inference.max_prompt_len=32",
    "inference.max_new_tokens=32",
]


def bench_config(size: str, run_dir: str, lora: str | None, rank: int) -> RunConfig:
    base = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    extra = [f"model.lora={lora}", f"model.lora.rank={rank}"] if lora else []
    return base.apply_overrides([*SIZES[size], *COMMON, f"storage.run_dir={run_dir}", *extra])


def synthetic_batch(config: RunConfig, step: int, seed: int) -> RolloutBatch:
    """A global batch of random prompts and responses sampled by version `step`."""
    rows = config.controller.prompts_per_batch * config.controller.samples_per_prompt
    seq = config.trainer.max_seq_len
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, config.model.vocab_size, (rows, seq)).astype(np.int32)
    prompt = seq // 2
    lengths = rng.integers(1, seq - prompt, rows)
    mask = np.zeros((rows, seq), bool)
    for r, n in enumerate(lengths):
        mask[r, prompt - 1 : prompt - 1 + n] = True
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        group_ids=np.arange(rows, dtype=np.int32) // config.controller.samples_per_prompt,
        rewards=rng.standard_normal(rows).astype(np.float32),
        behaviour_logprobs=np.where(mask, -2.0, 0.0).astype(np.float32),
        versions=np.full((rows,), step, np.int32),
    )


PROMPT_TOKENS = 24  # the prompts of the generation timed


def time_generation(worker, config: RunConfig, rounds: int = 3) -> tuple[float, int, int]:
    """(generated tokens per second over one batch of samples of the served version, prefill
    and every decode step, the median of `rounds` after a warm-up round; the last batch's
    response tokens; its requests)."""
    from rlax_tpu.api.inference import GenerationRequest

    rng = np.random.default_rng(0)
    rows = config.controller.prompts_per_batch * config.controller.samples_per_prompt
    prompts = rng.integers(1, config.model.vocab_size, (rows, PROMPT_TOKENS)).tolist()
    rates = []
    for k in range(rounds + 1):
        requests = [
            GenerationRequest(f"r{k}-{i}", f"p{k}-{i}", 0, tuple(p)) for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        rollouts = worker.generate(requests)
        tokens = sum(len(r.tokens) for r in rollouts)
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates[1:]), tokens, rows


def mfu_lines(trainer, results: list, generate: tuple[float, int, int]) -> dict:
    """The MFU figures of a train step (the medians of `results`, StepResults) and of a
    batch's generation (`generate`: `time_generation`'s), against the measured matmul peak
    of this process's devices in the model's dtype."""
    from rlax_tpu.simulator.model import decode_flops_per_token
    from rlax_tpu.trainer import perf
    from rlax_tpu.trainer.step import train_flops

    model = trainer.config.model
    peak = perf.devices_peak_flops(model.dtype)
    metrics = [r.metrics for r in results]
    trained = statistics.median(  # the tokens of a step, as the trainer counts them
        m["tokens_per_s"] * (m["time/step_s"] - m["time/compile_s"]) for m in metrics
    )
    flops = train_flops(trainer.num_params, trained, trainer.programs.num_trainable)
    step_s = statistics.median(m["time/step_s"] for m in metrics)
    rate, tokens, rows = generate
    per_token = decode_flops_per_token(model, PROMPT_TOKENS + tokens / rows / 2)
    generation = perf.mfu_figures(per_token * tokens, tokens / rate, peak)
    return {
        **perf.mfu_figures(flops, step_s, peak),
        **{f"generate_{key}": value for key, value in generation.items()},
    }


def nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def run_mode(size: str, lora: str | None, rank: int, versions: int) -> dict:
    from rlax_tpu.inference.worker import InferenceWorker
    from rlax_tpu.param_server import ServeOptions, start_server
    from rlax_tpu.param_server.trees import TreeClient
    from rlax_tpu.sharding import use_mesh
    from rlax_tpu.trainer import Trainer

    token = secrets.token_hex(8)
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(size, str(Path(tmp) / "run"), lora, rank)
        server = start_server(
            ServeOptions(storage_url=str(Path(tmp) / "params"), hot_versions=4),
            auth_token=token,
        )
        client = TreeClient([server.address], auth_token=token)
        trainer = Trainer(config, param_server=client)
        worker = InferenceWorker(config, param_server=client, consumer_id="bench")
        try:
            trainer.initialize()
            t0 = time.perf_counter()
            worker.load(0)
            first_load_s = time.perf_counter() - t0
            publish, load, step, ready, timed = [], [], [], [], []
            for k in range(versions + 1):  # the first step compiles: not counted
                result = trainer.train_step(k, synthetic_batch(config, k, seed=k))
                # The same publish once every array of the step is ready, as another
                # version (the step's own waits for work the step leaves queued).
                jax.block_until_ready((trainer._params, trainer._opt_state))
                t0 = time.perf_counter()
                client.publish(EXTRA_VERSIONS + k, trainer._published_params())
                ready_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                worker.load(k + 1)
                load_s = time.perf_counter() - t0
                if k == 0:
                    continue
                publish.append(result.metrics["time/publish_s"])
                ready.append(ready_s)
                load.append(load_s)
                step.append(result.metrics["time/step_s"])
                timed.append(result)
            generate = time_generation(worker, config)
            held = nbytes(trainer._params) + nbytes(trainer._opt_state)
            held += nbytes(trainer._reference) if trainer._reference is not None else 0
            fn, args, _ = trainer.programs.lowerings()["rl_step"]
            with use_mesh(trainer.mesh, trainer.rules):
                memory = fn.lower(*args).compile().memory_analysis()
            record = next(v for v in server.store.versions() if v.version == versions + 1)
            return {
                "params": trainer.num_params,
                "trained_params": trainer.programs.num_trainable,
                "publish_ms": 1e3 * statistics.median(publish),
                "load_ms": 1e3 * statistics.median(load),
                "publish_load_ms": 1e3
                * statistics.median(p + q for p, q in zip(publish, load, strict=True)),
                "publish_ready_ms": 1e3 * statistics.median(ready),
                "publish_ready_load_ms": 1e3
                * statistics.median(p + q for p, q in zip(ready, load, strict=True)),
                "first_load_ms": 1e3 * first_load_s,
                "publish_load_bytes": record.num_bytes,
                "step_s": statistics.median(step),
                "trainer_state_bytes": held,
                "rl_step_temp_bytes": int(memory.temp_size_in_bytes) if memory else None,
                "base_loads": worker.weights.base_loads,
                # Generation with the adapters unmerged in every matmul, against the base alone.
                "generate_tokens_per_s": generate[0],
                **mfu_lines(trainer, timed, generate),
            }
        finally:
            worker.close()
            trainer.close()
            client.close()
            server.stop()


RATIOS = (
    ("publish_ms", "publish time"),
    ("load_ms", "load time"),
    ("publish_load_ms", "publish + load"),
    ("publish_ready_ms", "publish, step finished"),
    ("publish_ready_load_ms", "that publish + load"),
    ("publish_load_bytes", "bytes of a version"),
    ("step_s", "train step time"),
    ("generate_tokens_per_s", "generated tokens/s"),
    ("mfu", "train step MFU"),
    ("generate_mfu", "generation MFU"),
    ("trainer_state_bytes", "params + opt + ref bytes"),
    ("rl_step_temp_bytes", "rl_step temporaries"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,20m")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="attention", help="a model.lora preset")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    # The CPU devices and compiler flags the demo's config asks for, before JAX starts.
    configure_jax(load_config(str(ROOT / "configs" / "tiny_cpu.py")))
    report = {
        "host": host_cpu(),
        "devices": len(jax.devices()),
        "rank": args.rank,
        "targets": args.targets,
        "sizes": {},
    }
    for size in args.sizes.split(","):
        full = run_mode(size, None, args.rank, args.versions)
        lora = run_mode(size, args.targets, args.rank, args.versions)
        ratios = {key: lora[key] / full[key] for key, _ in RATIOS if full[key]}
        report["sizes"][size] = {"full": full, "lora": lora, "lora_over_full": ratios}
        print(
            f"\n{size}: {full['params']:,} parameters; LoRA rank {args.rank} on "
            f"{args.targets} trains {lora['trained_params']:,}"
        )
        print(f"{'':<28}{'full':>14}{'LoRA':>14}{'LoRA/full':>11}")
        for key, label in RATIOS:
            if full[key] is None or lora[key] is None:
                continue
            print(f"{label:<28}{full[key]:>14.4g}{lora[key]:>14.4g}{ratios[key]:>11.4f}")
        print(
            f"publish + load: {full['publish_load_ms'] / lora['publish_load_ms']:.1f}× less "
            "time with LoRA in the step, "
            f"{full['publish_ready_load_ms'] / lora['publish_ready_load_ms']:.1f}× once the "
            f"step's arrays are ready; first load with LoRA {lora['first_load_ms']:.1f} ms "
            f"(reads the base once) vs {full['first_load_ms']:.1f} ms"
        )
    print(f"\nhost: {report['host']}, {report['devices']} CPU devices")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
