"""The train step: sharded equals unsharded, accumulation equals one big batch, bf16
compute, the metrics (MFU by its formula), the recompute against the inference engine
(at the rollouts' sampling temperature), PPO's V_old from the recompute, SFT lowers the
NLL."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from trainer_helpers import (
    ENGINE,
    ENGINE_KEY_SPAN,
    MODEL,
    SEQ,
    assert_trees_close,
    engine_batch,
    model_and_params,
    recompute_vs_engine,
    rollout_batch,
    run_config,
)

from rlax_tpu.config import AlgorithmConfig, KLConfig, MeshConfig, WarmStartConfig
from rlax_tpu.models import Transformer
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import BatchSizeError, Trainer, perf
from rlax_tpu.trainer.step import policy_outputs, policy_temperature

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


def test_mfu_is_model_flops_per_second_over_the_measured_peak(unsharded):
    trainer, result = unsharded
    metrics = result.metrics
    num_params = sum(int(x.size) for x in jax.tree.leaves(trainer.params()))
    assert trainer.num_params == num_params
    tokens = 8 * SEQ  # the padded global batch
    peak = perf.matmul_peak_flops(trainer.mesh, trainer.config.model.dtype)  # cached per mesh
    # The first step compiled its programs: its speed is over the rest of its time.
    compile_s = metrics["time/compile_s"]
    assert 0 < compile_s < metrics["time/step_s"]
    run_s = metrics["time/step_s"] - compile_s
    assert metrics["tokens_per_s"] == pytest.approx(tokens / run_s, rel=1e-12)
    assert metrics["mfu"] == pytest.approx(6 * num_params * tokens / run_s / peak, rel=1e-12)
    assert 0 < metrics["mfu"] < 1


def test_a_step_of_a_shape_already_compiled_compiles_nothing(tmp_path):
    config = run_config(str(tmp_path / "run"), mini=4)
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    first = trainer.train_step(0, rollout_batch(0)).metrics
    second = trainer.train_step(1, rollout_batch(1)).metrics
    trainer.close()
    assert first["time/compile_s"] > 0.1 * first["time/step_s"]
    assert second["time/compile_s"] < 0.1 * first["time/compile_s"]


def test_bfloat16_compute_trains_close_to_float32(unsharded, tmp_path):
    """model.dtype = bfloat16: matmuls in bf16, parameters (param_dtype) stay float32."""
    bf16 = dataclasses.replace(MODEL, dtype="bfloat16")
    trainer, result = _trained(tmp_path, "bf16", mesh=_one_device_mesh(), mini=4, model=bf16)
    _, ref_result = unsharded
    assert {x.dtype for x in jax.tree.leaves(trainer.params())} == {np.dtype("float32")}
    for key in ("loss", "grad_norm", "kl"):
        assert np.isfinite(result.metrics[key]), key
    # Not the float32 run (bf16 did run), but close to it at bf16 precision (the loss is
    # near 0: an absolute tolerance; measured differences are about 1e-4 relative).
    assert result.metrics["loss"] != ref_result.metrics["loss"]
    np.testing.assert_allclose(result.metrics["loss"], ref_result.metrics["loss"], atol=1e-3)
    for key, rtol in (("grad_norm", 1e-2), ("kl", 5e-2), ("entropy", 1e-2)):
        np.testing.assert_allclose(result.metrics[key], ref_result.metrics[key], rtol=rtol)


def test_ppo_takes_v_old_from_the_recompute_and_trains_the_value_head(tmp_path):
    """GAE needs V_old (batch.values): the trainer computes it in its recompute pass, so a
    PPO step runs; its value loss is finite and the value head moves."""
    model = dataclasses.replace(MODEL, value_head=True)
    config = run_config(
        str(tmp_path / "ppo"),
        mesh=ONE_DEVICE,
        mini=4,
        model=model,
        algorithm=AlgorithmConfig(name="ppo"),
    )
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    abstract = nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0)))
    graphdef = nnx.split(abstract, nnx.Param)[0]
    batch = rollout_batch(0)

    def values(params):
        model = nnx.merge(graphdef, params)
        return np.asarray(model.forward_train(batch.tokens, batch.targets).values)

    before = values(trainer.params())
    for step in range(3):
        result = trainer.train_step(step, rollout_batch(step))
        assert np.isfinite(result.metrics["value_loss"]), result.metrics
        assert np.isfinite(result.metrics["loss"])
    trainer.close()
    assert np.abs(values(trainer.params()) - before).max() > 1e-3


def test_batch_of_the_wrong_size_is_rejected(unsharded):
    trainer, _ = unsharded
    with pytest.raises(BatchSizeError, match="global batch of 8"):
        trainer.train_step(1, rollout_batch(1, rows=4))


def test_recompute_matches_the_inference_engine_to_one_ulp():
    """The recompute against the real inference Engine's behaviour log-probs (paged
    prefill + decode, sampler at temperature 1) for the same params, CPU f32, default XLA
    flags: XLA:CPU's kernels reduce in an order that depends on the array's shape ([1,
    bucket] prefill, [slots, 1] decode vs [micro, T]) and on the machine, so some tokens
    differ by one f32 ULP (docs/trainer.md, "Log-prob recompute")."""
    recomputed, engine, _ = recompute_vs_engine()
    diff = np.abs(recomputed - engine)
    assert diff.size == 8 * ENGINE.max_new_tokens
    assert diff.max() <= 1e-6
    assert (diff / np.spacing(np.abs(engine))).max() <= 2  # f32 ULPs
    assert np.mean(diff == 0) >= 0.6, np.mean(diff == 0)  # 0.82 and 0.875 on two hosts


def test_recompute_at_the_sampling_temperature_matches_the_inference_engine():
    """Rollouts sampled at temperature 0.7 carry log-probs of softmax(logits / 0.7): the
    recompute divides the logits by the same temperature and matches them as closely as
    at temperature 1, while log-probs at temperature 1 are a different distribution."""
    recomputed, engine, at_1 = recompute_vs_engine(temperature=0.7)
    diff = np.abs(recomputed - engine)
    assert diff.size == 8 * ENGINE.max_new_tokens
    assert diff.max() <= 1e-6
    assert (diff / np.spacing(np.abs(engine))).max() <= 2  # f32 ULPs
    assert np.mean(diff == 0) >= 0.6, np.mean(diff == 0)  # 0.79 and 0.81 on two hosts
    assert np.mean(np.abs(at_1 - engine)) > 1e-2  # 0.035 when measured


def test_greedy_rollouts_are_recomputed_at_temperature_one():
    """The sampler computes a greedy rollout's (temperature 0) log-probs at temperature 1,
    and so does the recompute."""
    assert policy_temperature(dataclasses.replace(ENGINE, temperature=0.0)) == 1.0
    recomputed, engine, _ = recompute_vs_engine(temperature=0.0)
    diff = np.abs(recomputed - engine)
    assert diff.max() <= 1e-6
    assert (diff / np.spacing(np.abs(engine))).max() <= 2  # f32 ULPs


def test_policy_logprobs_and_entropy_are_of_the_temperature_scaled_distribution():
    """The training forward's log π_θ and entropies at temperature T are those of
    softmax(logits / T); at T = 1 the forward is the plain one, bit for bit."""
    graphdef, params = model_and_params()
    batch = rollout_batch(0)
    tokens, targets = batch.tokens, batch.targets
    plain = nnx.merge(graphdef, params).forward_train(tokens, targets, return_logits=True)
    logits = np.asarray(plain.logits, np.float64)

    def expected(temperature):  # (log-probs of the targets, entropies), in float64
        z = logits / temperature
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.sum(np.exp(z), -1, keepdims=True))
        picked = np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1)[..., 0]
        return picked, -np.sum(np.exp(logp) * logp, axis=-1)

    def outputs(temperature):
        return policy_outputs(
            graphdef, params, tokens, targets, values=False, entropy=True, temperature=temperature
        )

    lp, _, entropy = outputs(0.7)
    want_lp, want_entropy = expected(0.7)
    np.testing.assert_allclose(lp, want_lp, rtol=0, atol=2e-6)
    np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=2e-5)
    assert np.abs(np.asarray(lp) - expected(1.0)[0]).mean() > 1e-2

    lp_1, _, entropy_1 = outputs(1.0)
    np.testing.assert_array_equal(lp_1, plain.logprobs)
    np.testing.assert_allclose(entropy_1, expected(1.0)[1], rtol=0, atol=2e-5)


# XLA:CPU kernel choices that differ from the defaults the in-process tests get: YNNPACK
# fusions off, Eigen's single-threaded contraction, and code for an older ISA (SSE4.2: no
# AVX, no FMA), as another machine might pick them.
OTHER_KERNELS = (
    "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_multi_thread_eigen=false "
    "--xla_cpu_max_isa=SSE4_2"
)


@pytest.mark.slow  # ~18 s; the default kernels' one-ulp test stays in the default suite
def test_recompute_matches_the_inference_engine_to_one_ulp_with_other_xla_kernels():
    """The tolerance holds whatever kernels XLA:CPU picks; bitwise equality does not: which
    tokens match exactly depends on the machine's ISA, its Eigen threading and the YNNPACK
    fusions (docs/trainer.md). Runs in a subprocess because XLA flags are read once per
    process."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{OTHER_KERNELS} --xla_force_host_platform_device_count=1",
    }
    temperatures = ["1.0", "0.7", "0.0"]  # at the rollouts' temperature; greedy at 1
    proc = subprocess.run(
        [sys.executable, "trainer_helpers.py", "parity", str(ENGINE_KEY_SPAN), *temperatures],
        cwd=Path(__file__).resolve().parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(figures) == temperatures
    for temperature in temperatures:
        got = figures[temperature]
        assert got["n"] == 8 * ENGINE.max_new_tokens
        assert got["max"] <= 1e-6 and got["ulps"] <= 2, (temperature, got)
        assert got["exact"] >= 0.6 * got["n"], (temperature, got)


@pytest.fixture(scope="module", params=[1.0, 0.7], ids=["T=1", "T=0.7"])
def engine_step(request, tmp_path_factory):
    """One step, on one device, of a batch the inference Engine generated from version 0
    at sampling temperature `request.param` (the run's inference.temperature), its
    behaviour log-probs cached; returns the result."""
    inference = dataclasses.replace(ENGINE, temperature=request.param)
    config = run_config(
        str(tmp_path_factory.mktemp("engine")), mesh=ONE_DEVICE, micro=4, inference=inference
    )
    trainer = Trainer(config, mesh=_one_device_mesh())
    assert trainer.temperature == request.param
    trainer.initialize()
    batch = engine_batch(trainer.params(), seq=24, inference=inference)
    result = trainer.train_step(0, batch)
    trainer.close()
    return result


def test_the_cached_path_mismatch_with_the_engine_is_reported(engine_step):
    """With real worker log-probs, recomputed and cached π_old agree to f32 rounding, and
    the step reports it: recomputed vs cached, and π_θ (before the update) vs each. At
    temperature 0.7 this holds because π_θ, π_old and the reference are all computed at
    the sampling temperature; the reference (= version 0 here) then gives KL ≈ 0."""
    metrics = engine_step.metrics
    for key in (
        "mismatch/recomputed_vs_cached_mean",
        "mismatch/recomputed_vs_cached_p95",
        "logprob_diff/recomputed_mean",
        "logprob_diff/recomputed_p95",
        "logprob_diff/cached_mean",
        "logprob_diff/cached_p95",
    ):
        assert 0 <= metrics[key] <= 1e-6, (key, metrics[key])
    assert 0 <= metrics["kl"] <= 1e-9, metrics["kl"]  # k3 of |d| ≤ 1e-6 is ≤ 1e-12


def with_warm_start(config, steps: int, learning_rate: float = 1e-2):
    warm_start = WarmStartConfig(steps=steps, learning_rate=learning_rate)
    return dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, warm_start=warm_start)
    )


def test_sft_step_lowers_the_nll_on_a_repeated_batch(tmp_path):
    config = with_warm_start(run_config(str(tmp_path / "sft"), mesh=ONE_DEVICE, micro=4), 4)
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    batch = rollout_batch(2)
    targets = batch.targets
    nll = []
    for step in range(4):
        result = trainer.sft_step(step, batch.tokens, targets, batch.response_mask)
        nll.append(result.metrics["nll"])
    trainer.close()
    assert nll[-1] < nll[0] - 0.5, nll


def test_sft_trains_at_temperature_one_whatever_the_inference_temperature(tmp_path):
    """SFT's NLL is of the model's own distribution, not of the rollouts' temperature."""
    inference = dataclasses.replace(ENGINE, temperature=0.7)
    config = run_config(str(tmp_path / "sft"), mesh=ONE_DEVICE, micro=4, inference=inference)
    config = with_warm_start(config, 1)
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    abstract = nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0)))
    # Host copies: the step donates the trainer's params.
    version_0 = jax.tree.map(np.asarray, trainer.params())
    model = nnx.merge(nnx.split(abstract, nnx.Param)[0], version_0)
    batch = rollout_batch(2)
    mask = np.asarray(batch.response_mask, np.float32)

    def nll(temperature):
        lp = model.forward_train(batch.tokens, batch.targets, temperature=temperature).logprobs
        return float(-np.sum(np.asarray(lp) * mask) / mask.sum())

    result = trainer.sft_step(0, batch.tokens, batch.targets, batch.response_mask)
    trainer.close()
    assert result.metrics["nll"] == pytest.approx(nll(1.0), rel=1e-5)
    assert abs(nll(0.7) - nll(1.0)) > 1e-2


@pytest.mark.parametrize("source", ["recomputed", "cached"])
def test_importance_weight_uses_the_configured_behaviour_logprobs(tmp_path, source):
    """recomputed: ρ is against the trainer's own π_old (ratio 1 before the update);
    cached: against the inference workers' log-probs (the batch's fake μ, ~0.2 nats off).
    Either way the mismatch between the two is reported."""
    _, result = _trained(
        tmp_path, source, mesh=_one_device_mesh(), mini=8, behaviour_logprobs=source
    )
    metrics = result.metrics
    diff = metrics["logprob_diff/mean"]
    if source == "recomputed":
        assert diff < 1e-5
    else:
        assert diff > 0.1
    assert metrics["mismatch/recomputed_vs_cached_mean"] > 0.1
    # π_θ against each of the two, whichever is in use; the objective's is the one in use.
    assert metrics["logprob_diff/recomputed_mean"] < 1e-5
    assert metrics["logprob_diff/recomputed_p95"] < 1e-5
    assert metrics["logprob_diff/cached_mean"] > 0.1
    assert metrics["logprob_diff/cached_p95"] > metrics["logprob_diff/cached_mean"] * 0.5
    assert diff == pytest.approx(metrics[f"logprob_diff/{source}_mean"], rel=1e-5, abs=1e-9)
    assert metrics["logprob_diff/p95"] == pytest.approx(
        metrics[f"logprob_diff/{source}_p95"], rel=1e-5, abs=1e-9
    )


def test_cached_mode_recomputes_pi_old_only_every_k_steps_and_trains_the_same(tmp_path):
    """behaviour_logprobs=cached: π_old feeds only the mismatch metrics, so it is recomputed
    on multiples of trainer.recompute_every; the weights do not depend on it."""

    def steps(name: str, every: int, source: str = "cached"):
        config = run_config(
            str(tmp_path / name), mini=8, behaviour_logprobs=source, recompute_every=every
        )
        trainer = Trainer(config, mesh=_one_device_mesh())
        trainer.initialize()
        results = [trainer.train_step(s, rollout_batch(s)) for s in range(3)]
        params = jax.device_get(trainer.params())
        trainer.close()
        return results, params

    every_other, params = steps("every2", 2)
    never, params_never = steps("never", 0)
    for step, result in enumerate(every_other):
        recomputed = "mismatch/recomputed_vs_cached_mean" in result.metrics
        assert recomputed == (step % 2 == 0), (step, sorted(result.metrics))
        assert ("logprob_diff/recomputed_mean" in result.metrics) == recomputed
        assert (result.metrics["time/recompute_s"] > 0) == recomputed
        assert "logprob_diff/cached_mean" in result.metrics
    assert not any("recomputed" in k for r in never for k in r.metrics)
    jax.tree.map(np.testing.assert_array_equal, params, params_never)
    # Recomputed log-probs are what the objective reads: every step, whatever k says.
    recomputed_mode, _ = steps("recomputed", 0, "recomputed")
    assert all("mismatch/recomputed_vs_cached_mean" in r.metrics for r in recomputed_mode)


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

    optimizer = run_config("unused").trainer.optimizer
    optimizer = dataclasses.replace(optimizer, lr_schedule=kind, learning_rate=1.0, warmup_steps=2)
    schedule = learning_rate_schedule(optimizer, num_steps=10, updates_per_step=3)
    # Every one of a step's 3 optimizer updates uses that step's rate.
    got = [float(schedule(step * 3 + update)) for step in range(6) for update in range(3)]
    np.testing.assert_allclose(got, np.repeat(expected, 3), rtol=1e-6, atol=1e-7)


def test_log_reference_kl_reports_the_kl_to_the_reference_without_training_on_it(tmp_path):
    """β = 0 with `log_reference_kl`: the trainer keeps the SFT reference and reports `kl`
    (zero at the first step, where π_θ is the reference; positive after an update), and
    trains exactly as without the flag, which reports no `kl`."""
    results, params = {}, {}
    for log in (False, True):
        algorithm = AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.0, log_reference=log))
        # One update per step (mini-batch = the batch): the first step's π_θ is the reference.
        config = run_config(str(tmp_path / str(log)), mini=8, adam_eps=1e-4, algorithm=algorithm)
        trainer = Trainer(config, mesh=_one_device_mesh())
        trainer.initialize()
        results[log] = [trainer.train_step(s, rollout_batch(s)) for s in range(2)]
        params[log] = trainer.params()
        trainer.close()
    assert all("kl" not in r.metrics for r in results[False])
    first, second = (r.metrics["kl"] for r in results[True])
    assert 0 <= first <= 1e-9 and second > 1e-6, (first, second)
    for with_kl, without in zip(results[True], results[False], strict=True):
        # GRPO's loss at the first steps is ~1e-8 (advantages sum to zero per group): its
        # last digits are rounding, which differs by CPU and code generation.
        assert with_kl.metrics["loss"] == pytest.approx(without.metrics["loss"], rel=1e-5, abs=1e-6)
    assert_trees_close(params[True], params[False])
