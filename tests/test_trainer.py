"""The train step: sharded equals unsharded, accumulation equals one big batch, the
recompute matches the inference forward, SFT lowers the NLL."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_helpers import MODEL, SEQ, assert_trees_close, rollout_batch, run_config

from rlax_tpu.config import MeshConfig
from rlax_tpu.models import DenseKVCache, Transformer
from rlax_tpu.models.transformer import token_logprobs
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import BatchSizeError, Trainer
from rlax_tpu.trainer.step import recompute_logprobs

ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)


def _one_device_mesh():
    return build_mesh(ONE_DEVICE, devices=jax.devices()[:1])


def _trained(tmp_path, name, *, mesh=None, **kw):
    # adam_eps well above the gradient noise of another reduction order, so parameters
    # after a step compare tightly (with eps=1e-8 a 1e-9 gradient is a ±lr update).
    config = run_config(str(tmp_path / name), adam_eps=1e-4, **kw)
    trainer = Trainer(config, mesh=mesh)
    trainer.initialize()
    result = trainer.train_step(0, rollout_batch(0))
    trainer.close()
    return trainer, result


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """One step on one device, one micro-batch per update: the reference."""
    return _trained(tmp_path_factory.mktemp("ref"), "run", mesh=_one_device_mesh(), mini=4)


def test_sharded_step_equals_unsharded(unsharded, tmp_path):
    assert len(jax.devices()) == 8
    trainer, result = _trained(tmp_path, "run", mini=4)  # data=2, fsdp=2, tensor=2
    ref_trainer, ref_result = unsharded
    np.testing.assert_allclose(result.metrics["loss"], ref_result.metrics["loss"], atol=1e-6)
    np.testing.assert_allclose(
        result.metrics["grad_norm"], ref_result.metrics["grad_norm"], rtol=1e-5
    )
    assert_trees_close(trainer.params(), ref_trainer.params(), rtol=1e-4, atol=1e-5)


def test_accumulation_over_micro_batches_equals_one_big_batch(unsharded, tmp_path):
    trainer, result = _trained(tmp_path, "run", mesh=_one_device_mesh(), mini=4, micro=2)
    ref_trainer, ref_result = unsharded
    for key in ("loss", "grad_norm", "kl", "advantage/std"):
        np.testing.assert_allclose(
            result.metrics[key], ref_result.metrics[key], rtol=1e-5, atol=1e-7
        )
    assert_trees_close(trainer.params(), ref_trainer.params(), rtol=1e-4, atol=1e-5)


def test_step_reports_the_metrics(unsharded):
    _, result = unsharded
    metrics = result.metrics
    for key in (
        "loss",
        "grad_norm",
        "learning_rate",
        "tokens_per_s",
        "mfu",
        "kl",
        "mismatch/recomputed_vs_cached_mean",
        "mismatch/recomputed_vs_cached_p95",
        "logprob_diff/mean",
    ):
        assert np.isfinite(metrics[key]), key
    assert metrics["mismatch/recomputed_vs_cached_mean"] > 0.1  # the batch's fake μ
    assert result.version == 1 and not result.already_done


def test_batch_of_the_wrong_size_is_rejected(unsharded):
    trainer, _ = unsharded
    with pytest.raises(BatchSizeError, match="global batch of 8"):
        trainer.train_step(1, rollout_batch(1, rows=4))


def test_recompute_equals_the_inference_decode_logprobs():
    model = Transformer(MODEL, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    tokens = rollout_batch(5).tokens[:4]
    recomputed = jax.jit(lambda p, t: recompute_logprobs(graphdef, p, t, micro_size=2))(
        params, tokens
    )

    # Inference: prefill the first 5 tokens, then decode one token at a time.
    rows, prefill = tokens.shape[0], 5
    cache = DenseKVCache.create(
        num_layers=MODEL.num_layers,
        batch=rows,
        max_len=SEQ,
        kv_heads=MODEL.num_kv_heads,
        head_dim=MODEL.head_dim,
        dtype=jnp.float32,
    )
    decode = jax.jit(lambda t, pos, c: model.decode(t, pos, jnp.ones_like(t, bool), c))
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    logits, cache = decode(tokens[:, :prefill], positions[:, :prefill], cache)
    all_logits = [logits]
    for t in range(prefill, SEQ):
        logits, cache = decode(tokens[:, t : t + 1], positions[:, t : t + 1], cache)
        all_logits.append(logits)
    logits = jnp.concatenate(all_logits, axis=1)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    inference = token_logprobs(logits, targets)
    np.testing.assert_allclose(recomputed[:, :-1], inference[:, :-1], rtol=0, atol=2e-6)


def test_sft_step_lowers_the_nll_on_a_repeated_batch(tmp_path):
    config = run_config(str(tmp_path / "sft"), mesh=ONE_DEVICE, micro=4)
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    batch = rollout_batch(2)
    targets = batch.targets
    nll = []
    for step in range(4):
        result = trainer.sft_step(step, batch.tokens, targets, batch.response_mask)
        nll.append(result.metrics["nll"])
        assert result.version == step + 1
    trainer.close()
    assert nll[-1] < nll[0] - 0.5, nll


@pytest.mark.parametrize("source", ["recomputed", "cached"])
def test_importance_weight_uses_the_configured_behaviour_logprobs(tmp_path, source):
    """recomputed: ρ is against the trainer's own π_old (ratio 1 before the update);
    cached: against the inference workers' log-probs (the batch's fake μ, ~0.2 nats off).
    Either way the mismatch between the two is reported."""
    _, result = _trained(
        tmp_path, source, mesh=_one_device_mesh(), mini=8, behaviour_logprobs=source
    )
    diff = result.metrics["logprob_diff/mean"]
    if source == "recomputed":
        assert diff < 1e-5
    else:
        assert diff > 0.1
    assert result.metrics["mismatch/recomputed_vs_cached_mean"] > 0.1


@pytest.mark.parametrize(
    "kind, expected",
    [
        # warmup over 2 steps, then decay over the remaining 8 of num_steps=10
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.0, 0.5, 1.0, 0.875, 0.75, 0.625]),
        ("cosine", [0.0, 0.5, 1.0, 0.9619397, 0.8535534, 0.6913417]),
    ],
)
def test_learning_rate_schedule_counts_train_steps(kind, expected):
    from rlax_tpu.trainer.step import learning_rate_schedule

    trainer = run_config("unused").trainer
    trainer = dataclasses.replace(trainer, lr_schedule=kind, learning_rate=1.0, warmup_steps=2)
    schedule = learning_rate_schedule(trainer, num_steps=10, updates_per_step=3)
    # Every one of a step's 3 optimizer updates uses that step's rate.
    got = [float(schedule(step * 3 + update)) for step in range(6) for update in range(3)]
    np.testing.assert_allclose(got, np.repeat(expected, 3), rtol=1e-6, atol=1e-7)
