"""Tiny configs and batches shared by the trainer tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    StorageConfig,
    TrainerConfig,
)

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
SEQ = 12
PROMPT = 4


def run_config(
    run_dir: str, *, mini: int = 8, micro: int | None = None, mesh=None, **trainer
) -> RunConfig:
    return RunConfig(
        seed=0,
        model=MODEL,
        controller=ControllerConfig(prompts_per_batch=4, samples_per_prompt=2, num_steps=10),
        trainer=TrainerConfig(
            mesh=mesh or MeshConfig(data=2, fsdp=2, tensor=2),
            algorithm=trainer.pop("algorithm", AlgorithmConfig(name="grpo", kl_beta=0.04)),
            mini_batch_size=mini,
            micro_batch_size=micro or mini,
            max_seq_len=32,
            learning_rate=trainer.pop("learning_rate", 1e-2),
            **trainer,
        ),
        storage=StorageConfig(run_dir=run_dir),
    )


def with_trainer(config: RunConfig, **fields) -> RunConfig:
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **fields))


def rollout_batch(seed: int = 0, rows: int = 8, seq: int = SEQ) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, MODEL.vocab_size, (rows, seq)).astype(np.int32)
    lengths = rng.integers(2, seq - PROMPT, rows)
    t = np.arange(seq)[None, :]
    # targets[t] = tokens[t + 1]: response targets are positions PROMPT-1 .. PROMPT-2+len.
    mask = (t >= PROMPT - 1) & (t < PROMPT - 1 + lengths[:, None])
    return RolloutBatch(
        tokens=jnp.asarray(tokens),
        response_mask=jnp.asarray(mask),
        group_ids=jnp.asarray(np.arange(rows) // 2, jnp.int32),
        rewards=jnp.asarray(rng.normal(size=rows), jnp.float32),
        behaviour_logprobs=jnp.asarray(-rng.uniform(3.5, 4.5, (rows, seq)), jnp.float32),
        versions=jnp.zeros((rows,), jnp.int32),
    )


def assert_trees_close(a, b, *, rtol=1e-5, atol=1e-6):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
