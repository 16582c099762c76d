"""LoRA (model.lora): adapters on a frozen base. The base never changes and holds no
optimizer state; a run is bitwise reproducible and resumes bitwise; only the adapters (and
their base's digest) move through a real parameter server, the base once through the run's
base store; a worker serves base + adapters as the trainer holds them."""

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_helpers import ENGINE, MODEL, rollout_batch, run_config

from rlax_tpu import simulator
from rlax_tpu.api.inference import PullFailedError
from rlax_tpu.compile.programs import lora_savings
from rlax_tpu.compile.report import format_lora_savings
from rlax_tpu.config import LoraConfig
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.models import Transformer, lora, lora_base
from rlax_tpu.param_server import ServeOptions, start_server
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import Trainer
from rlax_tpu.tree import flatten

TOKEN = secrets.token_hex(8)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
LORA_MODEL = dataclasses.replace(MODEL, lora=LORA)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _equal(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


def _config(run_dir, **trainer):
    return run_config(run_dir, model=LORA_MODEL, inference=ENGINE, **trainer)


def test_adapters_start_as_the_identity_and_the_base_is_the_model_without_lora():
    """Same seed: the LoRA model's base is bitwise the plain model's, and with B = 0 its
    log-probs are too; adapters with B ≠ 0 equal the merged weight W + (alpha/r)·A·B."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 10)), jnp.int32)
    plain_graph, plain_params = _split(Transformer(MODEL, rngs=nnx.Rngs(3)))
    lora_graph, params = _split(Transformer(LORA_MODEL, rngs=nnx.Rngs(3)))
    adapters, base = lora.split(params)
    assert _equal(base, plain_params)
    assert {k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1] for k in flatten(adapters)} == {
        f"{m}/{w}{s}"
        for m, w in [("attn", "wq"), ("attn", "wv"), ("attn", "wo"), ("mlp", "w_down")]
        for s in lora.SUFFIXES
    }
    plain = _logprobs(plain_graph)
    adapted = _logprobs(lora_graph)
    untrained = plain(plain_params, tokens)
    np.testing.assert_array_equal(untrained, adapted(params, tokens))
    # Non-zero B: unmerged adapters give what the merged weights give.
    rng = np.random.default_rng(1)
    trained = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype), adapters)
    got = adapted(lora.combine(base, trained), tokens)
    merged = lora.merged(lora.combine(base, trained), LORA.scale)  # W + (alpha/r)·A·B
    np.testing.assert_allclose(got, plain(merged, tokens), atol=2e-5)
    assert np.abs(got - untrained).max() > 1e-3


def _split(model):
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def _logprobs(graphdef):
    """A jitted (params, tokens) -> log-probs of the tokens shifted by one, for `graphdef`."""
    return jax.jit(
        lambda params, tokens: nnx.merge(graphdef, params).forward_train(tokens, tokens).logprobs
    )


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A LoRA trainer (8 devices) publishing to an in-process parameter server on disk,
    after 3 RL steps; the params it held at each version."""
    root = tmp_path_factory.mktemp("lora")
    server = start_server(
        ServeOptions(storage_url=str(root / "params"), hot_versions=8), auth_token=TOKEN
    )
    client = TreeClient([server.address], auth_token=TOKEN)
    config = _config(str(root / "run"), checkpoint_every=2)
    trainer = Trainer(config, param_server=client)
    trainer.initialize()
    held = [_host(trainer.params())]
    opt = _host(trainer._opt_state)
    for step in range(3):
        trainer.train_step(step, rollout_batch(step))
        held.append(_host(trainer.params()))
    trainer.save()
    client.wait_persisted([0, 1, 2, 3])
    yield dict(
        root=root, server=server, client=client, config=config, trainer=trainer, held=held, opt=opt
    )
    trainer.close()
    client.close()
    server.stop()


def test_the_base_never_changes_and_only_the_adapters_hold_optimizer_state(published):
    held, trainer = published["held"], published["trainer"]
    bases = [lora.split(p)[1] for p in held]
    digests = {lora_base.base_digest(b) for b in bases}
    assert len(digests) == 1 and all(_equal(bases[0], b) for b in bases)
    adapters = [lora.split(p)[0] for p in held]
    assert all(not _equal(adapters[i], adapters[i + 1]) for i in range(3))
    n_adapter = sum(x.size for x in jax.tree.leaves(adapters[0]))
    assert trainer.programs.num_trainable == n_adapter < trainer.num_params // 4
    # Adam's two moments (and counts) of the adapters only.
    moments = [x for x in jax.tree.leaves(published["opt"]) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter


def test_only_the_adapters_and_the_base_digest_move_through_the_parameter_server(published):
    client, held, root = published["client"], published["held"], published["root"]
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.split(held[0])[0]))
    versions = published["server"].store.versions()
    assert [v.version for v in versions] == [0, 1, 2, 3]
    assert {v.num_bytes for v in versions} == {adapter_bytes + 32}
    for version in (0, 3):
        pulled = client.pull_arrays(version)
        digest = pulled.pop(lora_base.DIGEST_KEY)
        assert bytes(digest.tolist()) == lora_base.base_digest(lora.split(held[version])[1])
        assert set(pulled) == {lora.PACKED_KEY}  # one array: the adapters packed
        adapters = lora.split(held[version])[0]
        assert _equal(lora.unpack(pulled[lora.PACKED_KEY], adapters), adapters)
    # The base went to the run's base store once, complete and verifiable.
    store = lora_base.LoraBaseStore(str(root / "run"))
    try:
        assert store._store.steps(reload=True) == [0]
    finally:
        store.close()


def test_a_worker_reads_the_base_once_and_serves_base_plus_adapters(published):
    worker = InferenceWorker(
        published["config"], param_server=published["client"], consumer_id="worker-0"
    )
    try:
        for version in (0, 1, 3):
            worker.load(version)
            served = worker.engine.served_params()
            expected = jax.tree.leaves(_tree_like(worker, published["held"][version]))
            assert len(served) == len(expected)
            for x, y in zip(served, expected, strict=True):
                np.testing.assert_array_equal(np.asarray(x), y)
        assert worker.weights.base_loads == 1
    finally:
        worker.close()


def _tree_like(worker, params):
    """`params` in the engine's leaf order (ServedWeights.place)."""
    return [np.asarray(x) for x in worker.engine._weights.place(params)]


def test_a_lora_run_is_reproducible_and_resumes_bitwise(published, tmp_path):
    """Another trainer with the same config gives the same versions bitwise; one restored
    from the checkpoint of step 2 gives version 3 bitwise."""
    again = Trainer(_config(str(tmp_path / "again")))
    again.initialize()
    for step in range(2):
        again.train_step(step, rollout_batch(step))
    assert _equal(_host(again.params()), published["held"][2])
    again.save()
    again.close()
    resumed = Trainer(_config(str(tmp_path / "again")))
    assert resumed.initialize() == 2
    resumed.train_step(2, rollout_batch(2))
    assert _equal(_host(resumed.params()), published["held"][3])
    resumed.close()


def test_scanned_layers_train_and_publish_the_same_adapters(published, tmp_path):
    scanned = Trainer(_config(str(tmp_path / "scan"), scan_layers=True))
    scanned.initialize()
    scanned.train_step(0, rollout_batch(0))
    got, want = flatten(_host(scanned.params())), flatten(published["held"][1])
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    scanned.close()


def test_a_worker_refuses_a_version_whose_base_its_run_does_not_hold(published, tmp_path):
    """A worker whose storage.run_dir is not the trainer's finds no base: the load fails
    naming the base and the knob, and the worker serves nothing."""
    config = published["config"]
    other = dataclasses.replace(
        config, storage=dataclasses.replace(config.storage, run_dir=str(tmp_path / "elsewhere"))
    )
    worker = InferenceWorker(other, param_server=published["client"], consumer_id="worker-1")
    try:
        with pytest.raises(PullFailedError, match="storage.run_dir"):
            worker.load(1)
        assert worker.engine.served_params() == []
    finally:
        worker.close()


def test_the_simulator_and_the_compile_report_count_what_lora_trains_and_moves():
    abstract = nnx.eval_shape(lambda: Transformer(LORA_MODEL, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    adapters = lora.split(params)[0]
    assert simulator.count_params(LORA_MODEL) == sum(x.size for x in jax.tree.leaves(params))
    assert simulator.lora_params(LORA_MODEL) == sum(x.size for x in jax.tree.leaves(adapters))
    assert simulator.count_arrays(LORA_MODEL) == 2  # packed adapters, base digest
    assert simulator.model_bytes(LORA_MODEL) == 4 * simulator.lora_params(LORA_MODEL) + 32

    config = _config("/tmp/unused")
    mesh = build_mesh(config.trainer.mesh)
    savings = lora_savings(config, mesh)
    held, full = savings["bytes_per_chip"], savings["full_fine_tuning_bytes_per_chip"]
    assert savings["trained_params"] == simulator.lora_params(LORA_MODEL)
    assert held["params"] > full["params"]  # the base and the adapters
    # Adam's two moments, of the adapters only (plus replicated counters and schedule).
    assert held["optimizer_state"] < 3 * held["gradients"] < full["gradients"]
    assert savings["saved_bytes_per_chip"] == sum(full.values()) - sum(held.values()) > 0
    line = format_lora_savings(savings)
    assert f"trains {savings['trained_params']:,} of {savings['total_params']:,}" in line


def test_a_worker_serving_int8_quantizes_the_frozen_base_once_and_keeps_no_device_copy(
    published,
):
    """inference.weight_dtype=int8: the base's projections are quantized at the first load
    only (later versions change only the adapters), and the published-dtype projections the
    worker keeps stay on the host, so the devices hold the int8 copy alone."""
    config = published["config"]
    config = dataclasses.replace(
        config, inference=dataclasses.replace(config.inference, weight_dtype="int8")
    )
    worker = InferenceWorker(config, param_server=published["client"], consumer_id="worker-2")
    try:
        worker.load(1)
        first = worker.engine.served_params()
        worker.load(3)
        later = worker.engine.served_params()
        int8 = [i for i, x in enumerate(first) if x.dtype == np.int8]
        assert len(int8) == 2 * 7  # 7 projections in each of the 2 layers
        assert all(first[i] is later[i] for i in int8)  # quantized once
        adapters = [
            i for i, x in enumerate(first) if x.shape != later[i].shape or x is not later[i]
        ]
        assert adapters and not set(adapters) & set(int8)
        base = flatten(worker.weights._base)
        projections = {
            k
            for k in base
            if k.rsplit("/", 1)[-1] in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
        }
        assert len(projections) == 14
        assert all(isinstance(base[k], np.ndarray) for k in projections)
        assert all(isinstance(v, jax.Array) for k, v in base.items() if k not in projections)
    finally:
        worker.close()
