"""`rlax-tpu run --smoke`: the numerics check of a config (the foundation job).

It exercises everything built so far end to end on the configured meshes: build or
import the model, shard it on the trainer mesh, take a jitted forward + gradient on
a batch, generate greedily through the KV-cache path on the inference mesh, and check
that the trainer's log-probs of the generated tokens equal the inference log-probs.
"""

from __future__ import annotations

import json
import time

from rlax_tpu.config import RunConfig
from rlax_tpu.runtime import configure_jax


def run(config: RunConfig) -> int:
    configure_jax(config)
    import jax

    from rlax_tpu import storage
    from rlax_tpu.run_dir import prepare_run_dir

    run_dir = prepare_run_dir(config)
    print(f"run {config.name!r}: digest {config.digest()[:12]}, run dir {run_dir}")
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
    metrics = foundation_job(config)
    storage.write_text(storage.join(run_dir, "foundation_job.json"), json.dumps(metrics, indent=2))
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        print(f"  {key:<{width}}  {value}")
    ok = metrics["train_vs_inference_logprob_max_abs_diff"] <= 1e-3
    print("foundation job: OK" if ok else "foundation job: MISMATCH between trainer and inference")
    return 0 if ok else 1


def build_model(config: RunConfig):
    """The initial policy: the HF checkpoint if configured, else random from the run seed."""
    from flax import nnx

    from rlax_tpu.models import Transformer

    if config.model.hf_checkpoint:
        from rlax_tpu.models.hf import load_model_for_config

        return load_model_for_config(config.model, seed=config.seed)
    return Transformer(config.model, rngs=nnx.Rngs(config.seed))


def foundation_job(config: RunConfig) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rlax_tpu.sharding import build_mesh, shard_model, use_mesh

    model_cfg = config.model
    batch = config.controller.global_batch_size
    seq = min(config.trainer.max_seq_len, 64)
    key = jax.random.key(config.seed)
    tokens = jax.random.randint(key, (batch, seq), 0, model_cfg.vocab_size, dtype=jnp.int32)
    metrics: dict = {}

    # Trainer side: sharded forward + gradient on the trainer mesh.
    model = build_model(config)
    t0 = time.perf_counter()
    mesh = build_mesh(config.trainer.mesh)
    rules = config.trainer.mesh.logical_axis_rules
    shard_model(model, mesh, rules)
    graphdef, state = nnx.split(model)

    def loss_fn(state, tokens):
        out = nnx.merge(graphdef, state).forward_train(tokens[:, :-1], tokens[:, 1:])
        return -jnp.mean(out.logprobs)

    with use_mesh(mesh, rules):
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state, tokens)
        grad_norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
    metrics["trainer_mesh"] = dict(mesh.shape)
    metrics["train_batch"] = [batch, seq]
    metrics["train_nll"] = round(float(loss), 6)
    metrics["grad_norm"] = round(grad_norm, 6)
    metrics["train_step_s"] = round(time.perf_counter() - t0, 3)

    # Inference side: greedy generation through the KV cache on the inference mesh.
    t0 = time.perf_counter()
    inf_mesh = build_mesh(config.inference.mesh)
    inf_rules = config.inference.mesh.logical_axis_rules
    shard_model(model, inf_mesh, inf_rules)
    prompts = config.controller.prompts_per_batch
    rng = np.random.default_rng(config.seed)
    prompt_lens = rng.integers(4, min(config.inference.max_prompt_len, 16) + 1, size=prompts)
    prompt_tokens = np.asarray(tokens[:prompts, : int(prompt_lens.max())])
    new = min(config.inference.max_new_tokens, 16)
    with use_mesh(inf_mesh, inf_rules):
        generated, gen_logprobs = greedy_generate(model, prompt_tokens, prompt_lens, new)
    metrics["inference_mesh"] = dict(inf_mesh.shape)
    metrics["generated_tokens"] = int(generated.size)
    metrics["generate_s"] = round(time.perf_counter() - t0, 3)

    # The trainer's log-probs of the same tokens must equal what inference sampled with.
    full = np.zeros((prompts, int(prompt_lens.max()) + new), np.int32)
    for b in range(prompts):
        n = int(prompt_lens[b])
        full[b, :n] = prompt_tokens[b, :n]
        full[b, n : n + new] = generated[b]
    shard_model(model, mesh, rules)
    with use_mesh(mesh, rules):
        out = jax.jit(lambda m, t: m.forward_train(t[:, :-1], t[:, 1:]).logprobs)(model, full)
    out = np.asarray(out)
    trainer_lp = np.stack(
        [out[b, int(prompt_lens[b]) - 1 : int(prompt_lens[b]) - 1 + new] for b in range(prompts)]
    )
    diff = float(np.abs(trainer_lp - np.asarray(gen_logprobs)).max())
    metrics["train_vs_inference_logprob_max_abs_diff"] = diff
    return metrics


def greedy_generate(model, prompt_tokens, prompt_lens, max_new_tokens: int):
    """Greedy decoding through a DenseKVCache.

    prompt_tokens: int32[batch, max_prompt] right-padded; prompt_lens: int[batch].
    Returns (tokens int32[batch, max_new_tokens], logprobs float32[batch, max_new_tokens]).
    """
    import jax
    import jax.numpy as jnp

    from rlax_tpu.models import DenseKVCache

    cfg = model.config
    batch, max_prompt = prompt_tokens.shape
    lens = jnp.asarray(prompt_lens, jnp.int32)
    cache = DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=batch,
        max_len=max_prompt + max_new_tokens,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cfg.dtype],
    )

    @jax.jit
    def generate(model, prompt_tokens, lens, cache):
        positions = jnp.broadcast_to(jnp.arange(max_prompt, dtype=jnp.int32), (batch, max_prompt))
        valid = positions < lens[:, None]
        logits, cache = model.decode(prompt_tokens, positions, valid, cache, logits_index=lens - 1)

        def step(carry, _):
            logits, cache, position = carry
            logprobs = jax.nn.log_softmax(logits, axis=-1)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
            logits, cache = model.decode(
                token[:, None], position[:, None], jnp.ones((batch, 1), bool), cache
            )
            return (logits[:, 0], cache, position + 1), (token, chosen)

        _, (tokens, logprobs) = jax.lax.scan(step, (logits, cache, lens), None, max_new_tokens)
        return tokens.T, logprobs.T

    tokens, logprobs = generate(model, jnp.asarray(prompt_tokens), lens, cache)
    return jax.device_get(tokens), jax.device_get(logprobs)
