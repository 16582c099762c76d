"""Benchmark of the trainer's GRPO step: tokens/s, step time, the recompute pass as a
fraction of the step, and MFU against a matmul rate measured in the same run.

    python tools/bench_trainer.py [--quick] [--json OUT] [--configs tiny,cpu_large,gpu_0p5b]

Each config runs `Trainer.train_step` on synthetic rollouts (after a compile step);
figures are medians over the timed steps; `compile_s` is the first step's excess over them.
`gpu_0p5b` (a ~0.5B Qwen2-shaped model) is run by default only when an accelerator is
present.

`service` times `Trainer.train_step` end to end as a run's trainer runs it: the tiny model
on an RL batch (8 prompts x 8 samples of 48 tokens), publishing every version to a real
parameter-server process and starting an async checkpoint every `checkpoint_every` steps.
It reports the jitted step, the publish, the rest of the call (batch placement, bookkeeping:
`overhead_s`), the extra of a checkpoint step (`checkpoint_s`), and the compile of a new
padded sequence length mid-run (`recompile_s`, 48 -> 64 tokens), which the controller's
padding (rlax_tpu.shapes) causes whenever a batch's longest row crosses a length.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_param_server import start_param_server  # noqa: E402

from rlax_tpu.algorithms import RolloutBatch  # noqa: E402
from rlax_tpu.config import (  # noqa: E402
    AlgorithmConfig,
    ControllerConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    StorageConfig,
    TrainerConfig,
)
from rlax_tpu.trainer import (
    Trainer,  # noqa: E402
    perf,  # noqa: E402
)

CONFIGS = {
    # name: (model, prompts_per_batch, samples_per_prompt, mini, micro, seq)
    "tiny": (ModelConfig(), 4, 2, 8, 4, 64),
    "cpu_large": (
        ModelConfig(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=768,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
        ),
        4,
        4,
        16,
        8,
        128,
    ),
    "gpu_0p5b": (
        ModelConfig(
            architecture="Qwen2ForCausalLM",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            head_dim=64,
            qkv_bias=True,
            tie_word_embeddings=True,
            dtype="bfloat16",
            max_position_embeddings=4096,
        ),
        8,
        8,
        64,
        8,
        1024,
    ),
}


def _config(name: str, run_dir: str) -> RunConfig:
    model, prompts, samples, mini, micro, seq = CONFIGS[name]
    return RunConfig(
        model=model,
        controller=ControllerConfig(prompts_per_batch=prompts, samples_per_prompt=samples),
        trainer=TrainerConfig(
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
            algorithm=AlgorithmConfig(name="grpo"),
            mini_batch_size=mini,
            micro_batch_size=micro,
            max_seq_len=seq,
            learning_rate=1e-6,
            checkpoint_every=10**6,
        ),
        storage=StorageConfig(run_dir=run_dir),
    )


def _batch(config: RunConfig, seed: int, seq: int | None = None) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    rows = config.controller.global_batch_size
    seq = seq or config.trainer.max_seq_len
    prompt = seq // 4
    mask = np.zeros((rows, seq), bool)
    mask[:, prompt - 1 : seq - 1] = True
    return RolloutBatch(
        tokens=jnp.asarray(rng.integers(1, config.model.vocab_size, (rows, seq)), jnp.int32),
        response_mask=jnp.asarray(mask),
        group_ids=jnp.asarray(np.arange(rows) // config.controller.samples_per_prompt),
        rewards=jnp.asarray(rng.normal(size=rows), jnp.float32),
        behaviour_logprobs=jnp.full((rows, seq), -np.log(config.model.vocab_size), jnp.float32),
        versions=jnp.zeros((rows,), jnp.int32),
    )


def bench(name: str, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_dir:
        config = _config(name, run_dir)
        trainer = Trainer(config)
        trainer.initialize()
        first = trainer.train_step(0, _batch(config, 0))  # compile
        results = [trainer.train_step(s, _batch(config, s)) for s in range(1, steps + 1)]
        trainer.close()
    step_s = statistics.median(r.metrics["time/step_s"] for r in results)
    compile_s = max(0.0, first.metrics["time/step_s"] - step_s)
    recompute_s = statistics.median(r.metrics["time/recompute_s"] for r in results)
    return {
        "params": trainer.num_params,
        "tokens_per_step": config.controller.global_batch_size * config.trainer.max_seq_len,
        "tokens_per_s": statistics.median(r.metrics["tokens_per_s"] for r in results),
        "step_s": step_s,
        "recompute_fraction": recompute_s / step_s,
        "mfu": statistics.median(r.metrics["mfu"] for r in results),
        "peak_tflops": perf.matmul_peak_flops(trainer.mesh, config.model.dtype) / 1e12,
        "devices": len(trainer.mesh.devices.flat),
        "compile_s": compile_s,
    }


# -- the train step as a run's trainer runs it ------------------------------------------------
SERVICE_SEQ, SERVICE_RECOMPILE_SEQ = 48, 64  # two padded lengths (rlax_tpu.shapes)
SERVICE_CHECKPOINT_EVERY = 4


def bench_service(steps: int) -> dict[str, float]:
    """`Trainer.train_step` end to end on the tiny model and an RL batch, publishing to a
    parameter-server process, checkpointing every SERVICE_CHECKPOINT_EVERY steps."""
    from rlax_tpu.param_server.client import ParamServerClient

    token = secrets.token_hex(16)
    env = dict(os.environ, RLAX_TPU_AUTH_TOKEN=token, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as run_dir:
        server, address = start_param_server(os.path.join(run_dir, "ps"), env)
        try:
            base = _config("tiny", run_dir)
            config = base.apply_overrides(
                [
                    "controller.prompts_per_batch=8",
                    "controller.samples_per_prompt=8",
                    "trainer.mini_batch_size=64",
                    "trainer.micro_batch_size=64",
                    f"trainer.max_seq_len={SERVICE_RECOMPILE_SEQ}",
                    f"trainer.checkpoint_every={SERVICE_CHECKPOINT_EVERY}",
                ]
            )
            client = ParamServerClient([address], auth_token=token)
            trainer = Trainer(config, param_server=client)
            trainer.initialize()
            rows = []
            for step in range(steps + 1):
                batch = _batch(config, step, SERVICE_SEQ)
                t0 = time.perf_counter()
                result = trainer.train_step(step, batch)
                rows.append((time.perf_counter() - t0, result.metrics))
            t0 = time.perf_counter()  # a longer batch: a second padded length mid-run
            result = trainer.train_step(steps + 1, _batch(config, steps + 1, SERVICE_RECOMPILE_SEQ))
            recompile_total = time.perf_counter() - t0
            trainer.checkpoints.wait()
            trainer.close()
            client.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    warm = rows[1:]  # step 0 compiles
    # Steps whose version is a multiple of checkpoint_every start an async checkpoint.
    plain = [(t, m) for k, (t, m) in enumerate(warm, 1) if (k + 1) % SERVICE_CHECKPOINT_EVERY]
    saving = [(t, m) for k, (t, m) in enumerate(warm, 1) if not (k + 1) % SERVICE_CHECKPOINT_EVERY]

    def rest(t: float, m: dict) -> float:
        return t - m["time/step_s"] - m["time/publish_s"]

    overhead = statistics.median(rest(t, m) for t, m in plain)
    step_s = statistics.median(m["time/step_s"] for _, m in warm)
    return {
        "config": "tiny",
        "params": trainer.num_params,
        "arrays": _num_arrays(config),
        "bytes": {"float32": 4, "bfloat16": 2}[config.model.published_dtype] * trainer.num_params,
        "rows": config.controller.global_batch_size,
        "seq": SERVICE_SEQ,
        "steps": steps,
        "train_step_s": statistics.median(t for t, _ in warm),
        "step_s": step_s,
        "publish_s": statistics.median(m["time/publish_s"] for _, m in warm),
        "overhead_s": overhead,
        "checkpoint_every": SERVICE_CHECKPOINT_EVERY,
        "checkpoint_s": (
            max(0.0, statistics.median(rest(t, m) for t, m in saving) - overhead) if saving else 0.0
        ),
        "compile_s": max(0.0, rows[0][1]["time/step_s"] - step_s),
        "recompile_s": max(0.0, recompile_total - statistics.median(t for t, _ in warm)),
    }


def _num_arrays(config: RunConfig) -> int:
    from flax import nnx

    from rlax_tpu.models import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
    return len(jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps, tiny + cpu_large")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--configs", default="", help="comma-separated subset of " + ",".join(CONFIGS)
    )
    args = parser.parse_args(argv)
    accelerator = jax.devices()[0].platform != "cpu"
    names = (
        args.configs.split(",")
        if args.configs
        else ["tiny", "cpu_large"] + (["gpu_0p5b"] if accelerator and not args.quick else [])
    )
    steps = 2 if args.quick else 5
    out = {name: bench(name, steps) for name in names}
    service = bench_service(16 if args.quick else 32)
    header = f"{'config':<10} {'params':>11} {'tok/step':>9} {'tokens/s':>10} {'step s':>8} "
    header += f"{'recompute':>9} {'MFU':>8} {'peak TF/s':>9}"
    print(f"devices: {jax.devices()[0].platform} × {len(jax.devices())}")
    print(header)
    for name, r in out.items():
        print(
            f"{name:<10} {r['params']:>11,} {r['tokens_per_step']:>9} {r['tokens_per_s']:>10.0f} "
            f"{r['step_s']:>8.3f} {r['recompute_fraction']:>9.1%} {r['mfu']:>8.2%} "
            f"{r['peak_tflops']:>9.3f}"
        )
    print(
        "service (tiny model, {rows} x {seq} tokens, publish to a parameter server, checkpoint "
        "every {checkpoint_every}): train_step {train_step_s:.3f} s = step {step_s:.3f} + publish "
        "{publish_s:.3f} + rest {overhead_s:.3f}; checkpoint +{checkpoint_s:.3f}; compile "
        "{compile_s:.2f}, recompile at a new length {recompile_s:.2f}".format(**service)
    )
    if args.json:
        with open(args.json, "w") as f:
            # Top-level keys: the last (largest) config; every config under "configs".
            json.dump(
                {**out[names[-1]], "config": names[-1], "configs": out, "service": service},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
