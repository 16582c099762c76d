"""Benchmark of the trainer's GRPO step: tokens/s, step time, the recompute pass as a
fraction of the step, and MFU against a matmul rate measured in the same run.

    python tools/bench_trainer.py [--quick] [--json OUT] [--configs tiny,cpu_large,gpu_0p5b]

Each config runs `Trainer.train_step` on synthetic rollouts (after a compile step);
figures are medians over the timed steps. `gpu_0p5b` (a ~0.5B Qwen2-shaped model) is
run by default only when an accelerator is present.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

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


def _batch(config: RunConfig, seed: int) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    rows = config.controller.global_batch_size
    seq = config.trainer.max_seq_len
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
        trainer.train_step(0, _batch(config, 0))  # compile
        results = [trainer.train_step(s, _batch(config, s)) for s in range(1, steps + 1)]
        trainer.close()
    step_s = statistics.median(r.metrics["time/step_s"] for r in results)
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
    }


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
    if args.json:
        with open(args.json, "w") as f:
            # Top-level keys: the last (largest) config; every config under "configs".
            json.dump({**out[names[-1]], "config": names[-1], "configs": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
