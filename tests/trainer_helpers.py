"""Tiny configs and batches shared by the trainer tests, and rollouts of the real
inference engine for the recompute-parity tests (run in-process, or in a subprocess with
other XLA flags: `python trainer_helpers.py parity`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    InferenceConfig,
    KLConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    StalenessConfig,
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
    run_dir: str,
    *,
    mini: int = 8,
    micro: int | None = None,
    mesh=None,
    model: ModelConfig = MODEL,
    inference: InferenceConfig | None = None,
    **trainer,
) -> RunConfig:
    return RunConfig(
        seed=0,
        model=model,
        # The batches here are all of version 0 (rollout_batch): any step up to 16 takes them.
        staleness=StalenessConfig(reload_every=1, max_staleness=16),
        controller=ControllerConfig(prompts_per_batch=4, samples_per_prompt=2, num_steps=10),
        trainer=TrainerConfig(
            mesh=mesh or MeshConfig(data=2, fsdp=2, tensor=2),
            algorithm=trainer.pop(
                "algorithm", AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.04))
            ),
            mini_batch_size=mini,
            micro_batch_size=micro or mini,
            max_seq_len=32,
            optimizer=OptimizerConfig(
                learning_rate=trainer.pop("learning_rate", 1e-2),
                adam_eps=trainer.pop("adam_eps", 1e-8),
            ),
            **trainer,
        ),
        storage=StorageConfig(run_dir=run_dir),
        # Prompts and responses that fit the trainer's 32 tokens (RunConfig.validate).
        inference=inference or InferenceConfig(max_prompt_len=16, max_new_tokens=16),
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


# The inference engine's config for the parity tests: temperature 1 (tests replace it),
# "full" log-probs (what the trainer recomputes), 4 decode slots, 8-token pages. Each
# slot's keys are viewed as pages_per_seq · page_size = ENGINE_KEY_SPAN positions.
ENGINE = InferenceConfig(
    max_decode_slots=4,
    page_size=8,
    kv_cache_bytes=2**20,
    prefill_buckets=(16,),
    max_prompt_len=16,
    max_new_tokens=12,
    temperature=1.0,
    attention_backend="jax",
)
ENGINE_KEY_SPAN = -(-(ENGINE.max_prompt_len + ENGINE.max_new_tokens) // ENGINE.page_size) * (
    ENGINE.page_size
)


def rollout_rows(rollouts, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32[rows, seq], response mask, behaviour log-probs float32[rows, seq]) of
    engine rollouts as the trainer's batch lays them out: prompt + response right-padded,
    the log-prob of response token j at position P - 1 + j (targets[t] = tokens[t + 1])."""
    rows = len(rollouts)
    tokens = np.zeros((rows, seq), np.int32)
    mask = np.zeros((rows, seq), bool)
    behaviour = np.zeros((rows, seq), np.float32)
    for row, r in enumerate(rollouts):
        full = list(r.prompt_tokens) + list(r.tokens)
        assert len(full) <= seq, (len(full), seq)
        tokens[row, : len(full)] = full
        start = len(r.prompt_tokens) - 1
        mask[row, start : start + len(r.tokens)] = True
        behaviour[row, start : start + len(r.tokens)] = r.logprobs
    return tokens, mask, behaviour


def engine_batch(
    params, *, seed: int = 0, seq: int = 24, inference: InferenceConfig = ENGINE
) -> RolloutBatch:
    """A global batch (4 prompts × 2 samples) generated by the inference Engine from
    `params` (version 0) with the `inference` config (sampling temperature, log-probs),
    with the engine's behaviour log-probs as the cached ones.

    Rows are prompt + response, right-padded to `seq`; targets[t] = tokens[t + 1], so
    response token j of a row with prompt length P is scored at position P - 1 + j.
    """
    from rlax_tpu.inference.engine import Engine, GenerationRequest

    rng = np.random.default_rng(seed)
    engine = Engine(MODEL, inference, seed=seed)
    engine.load(0, jax.tree.map(np.asarray, params))
    requests = []
    for prompt in range(4):
        tokens = tuple(int(t) for t in rng.integers(1, MODEL.vocab_size, 3 + 2 * prompt))
        requests += [GenerationRequest(f"p{prompt}s{k}", f"p{prompt}", k, tokens) for k in range(2)]
    rollouts = engine.run(requests)
    rows = len(rollouts)
    tokens, mask, behaviour = rollout_rows(rollouts, seq)
    return RolloutBatch(
        tokens=jnp.asarray(tokens),
        response_mask=jnp.asarray(mask),
        group_ids=jnp.asarray(np.arange(rows) // 2, jnp.int32),
        rewards=jnp.asarray(rng.normal(size=rows), jnp.float32),
        behaviour_logprobs=jnp.asarray(behaviour),
        versions=jnp.zeros((rows,), jnp.int32),
    )


def model_and_params(seed: int = 3):
    """(graphdef, pure-dict params) of a randomly initialised MODEL."""
    from flax import nnx

    from rlax_tpu.models import Transformer

    graphdef, state = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(seed)), nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def recompute_vs_engine(
    *, seq: int = 24, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(recomputed, engine, recomputed_at_1): log-probs of the response tokens of an engine
    batch sampled at `temperature`, float32[n] each — the trainer's recompute at its
    policy temperature (`policy_temperature` of the engine's config), the engine's
    behaviour log-probs, and the recompute at temperature 1 (no scaling). The recompute
    runs over rows padded to `seq` columns."""
    from rlax_tpu.trainer.step import policy_temperature, recompute_logprobs

    inference = dataclasses.replace(ENGINE, temperature=temperature)
    graphdef, params = model_and_params()
    batch = engine_batch(params, seq=seq, inference=inference)
    mask = np.asarray(batch.response_mask)

    def recomputed(at: float) -> np.ndarray:
        fn = jax.jit(lambda p, t: recompute_logprobs(graphdef, p, t, micro_size=4, temperature=at))
        return np.asarray(fn(params, batch.tokens))[mask]

    engine = np.asarray(batch.behaviour_logprobs)[mask]
    return recomputed(policy_temperature(inference)), engine, recomputed(1.0)


if __name__ == "__main__":
    # `python trainer_helpers.py parity SEQ TEMPERATURE...`: the parity figures of each
    # sampling temperature, {temperature: {n, exact, max, ulps}}, as JSON on stdout. Run it
    # with other XLA_FLAGS to see how the kernels XLA:CPU picks move the last bit
    # (docs/trainer.md, "How closely it matches the inference worker").
    import json
    import sys

    figures = {}
    for arg in sys.argv[3:] or ["1.0"]:
        recomputed, engine, _ = recompute_vs_engine(seq=int(sys.argv[2]), temperature=float(arg))
        diff = np.abs(recomputed - engine)
        figures[arg] = {
            "n": int(diff.size),
            "exact": int(np.sum(diff == 0)),
            "max": float(diff.max()),
            "ulps": float((diff / np.spacing(np.abs(engine))).max()),  # in f32 ULPs
        }
    print(json.dumps(figures))
