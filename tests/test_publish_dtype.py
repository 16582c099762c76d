"""Master, compute and published dtypes: a float32-master trainer with bf16 compute publishes
bf16 to a real parameter server, a worker pulls and serves them, a version or a pull in
another dtype is refused, and bf16 weights give the same log-probs as the float32 master
under bf16 compute."""

import dataclasses
import secrets

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from trainer_helpers import ENGINE, MODEL, run_config

from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.api.inference import PullFailedError
from rlax_tpu.api.param_server import ParamServerCallError, PullMismatchError
from rlax_tpu.config import ModelConfig
from rlax_tpu.inference.engine import Engine, GenerationRequest
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.models import Transformer
from rlax_tpu.param_server import ServeOptions, start_server
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.step import recompute_logprobs
from rlax_tpu.tree import flatten

TOKEN = secrets.token_hex(8)
BF16 = np.dtype(ml_dtypes.bfloat16)
# float32 master weights, bf16 matmuls, bf16 published and served.
MIXED = dataclasses.replace(MODEL, dtype="bfloat16", publish_dtype="bfloat16")
SEQ = 24


def _requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    out = []
    for prompt in range(4):
        tokens = tuple(int(t) for t in rng.integers(1, MODEL.vocab_size, 3 + 2 * prompt))
        out += [GenerationRequest(f"p{prompt}s{k}", f"p{prompt}", k, tokens) for k in range(2)]
    return out


def _batch(rollouts) -> RolloutBatch:
    """The rollouts as a global batch (rows prompt + response, right-padded to SEQ), with
    their behaviour log-probs as the cached ones."""
    rows = len(rollouts)
    tokens = np.zeros((rows, SEQ), np.int32)
    mask = np.zeros((rows, SEQ), bool)
    behaviour = np.zeros((rows, SEQ), np.float32)
    for row, r in enumerate(sorted(rollouts, key=lambda r: r.request_id)):
        full = list(r.prompt_tokens) + list(r.tokens)
        tokens[row, : len(full)] = full
        start = len(r.prompt_tokens) - 1
        mask[row, start : start + len(r.tokens)] = True
        behaviour[row, start : start + len(r.tokens)] = r.logprobs
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        group_ids=np.arange(rows, dtype=np.int32) // 2,
        rewards=np.linspace(-1, 1, rows, dtype=np.float32),
        behaviour_logprobs=behaviour,
        versions=np.zeros((rows,), np.int32),
    )


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A float32-master, bf16-compute trainer (8 devices) that published version 0 in bf16 to
    an in-process parameter server on disk."""
    root = tmp_path_factory.mktemp("publish_dtype")
    storage = str(root / "params")
    server = start_server(ServeOptions(storage_url=storage, hot_versions=2), auth_token=TOKEN)
    client = TreeClient([server.address], auth_token=TOKEN)
    config = run_config(str(root / "run"), model=MIXED, inference=ENGINE)
    trainer = Trainer(config, param_server=client)
    trainer.initialize()
    client.wait_persisted([0])  # storage is written after the publish returned
    yield dict(
        storage=storage,
        server=server,
        client=client,
        config=config,
        trainer=trainer,
        master=_host(trainer.params()),
    )
    trainer.close()
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def served(run):
    """A worker that loaded version 0 from the parameter server and generated a batch (its
    engine's compilation makes the tests that use it slow)."""
    worker = InferenceWorker(run["config"], param_server=run["client"], consumer_id="worker-0")
    worker.load(0)
    rollouts = sorted(worker.generate(_requests()), key=lambda r: r.request_id)
    yield dict(run, worker=worker, rollouts=rollouts)
    worker.close()


def _assert_master_cast(pulled: dict, master) -> None:
    expected = {name: np.asarray(x).astype(BF16) for name, x in flatten(master).items()}
    assert set(pulled) == set(expected)
    for name, array in pulled.items():
        assert array.dtype == BF16, name
        np.testing.assert_array_equal(array.view(np.uint16), expected[name].view(np.uint16))


def test_served_config_takes_the_publish_dtype():
    served = MIXED.served()
    assert (served.param_dtype, served.dtype, served.served()) == ("bfloat16", "bfloat16", served)
    assert MIXED.published_dtype == "bfloat16" and MIXED.param_dtype == "float32"
    plain = dataclasses.replace(MODEL, dtype="bfloat16")
    assert plain.published_dtype == "float32" and plain.served() is plain


def test_trainer_publishes_its_float32_master_cast_to_bfloat16(run):
    """The master stays float32; the server holds bitwise its bf16 cast (round to nearest
    even), 2 bytes a parameter, also read back from storage by a restarted server."""
    trainer, client = run["trainer"], run["client"]
    assert {x.dtype for x in jax.tree.leaves(trainer.params())} == {np.dtype("float32")}
    _assert_master_cast(client.pull_arrays(0), run["master"])
    # The cast did round: the master's values are not all bf16 values.
    assert any(
        not np.array_equal(x, x.astype(BF16).astype(np.float32))
        for x in jax.tree.leaves(run["master"])
    )
    store = run["server"].store
    assert [v.num_bytes for v in store.versions()] == [2 * trainer.num_params]
    assert {p.dtype for p in store.layout()} == {"bfloat16"}
    restarted = start_server(
        ServeOptions(storage_url=run["storage"], hot_versions=1), auth_token=TOKEN
    )
    try:
        with TreeClient([restarted.address], auth_token=TOKEN) as cold:
            _assert_master_cast(cold.pull_arrays(0), run["master"])
    finally:
        restarted.stop()


def test_published_params_keep_the_master_shardings(run):
    trainer = run["trainer"]
    for master, out in zip(
        jax.tree.leaves(trainer.params()),
        jax.tree.leaves(trainer._published_params()),
        strict=True,
    ):
        assert out.dtype == BF16 and out.sharding.is_equivalent_to(master.sharding, master.ndim)


@pytest.mark.slow
def test_worker_serves_bfloat16_weights_and_generates(served):
    worker = served["worker"]
    assert {x.dtype for x in jax.tree.leaves(worker.param_like())} == {BF16}
    assert {x.dtype for x in worker.engine.served_params()} == {BF16}
    rollouts = served["rollouts"]
    assert len(rollouts) == 8 and all(r.version == 0 and r.tokens for r in rollouts)
    assert all(np.isfinite(r.logprobs).all() for r in rollouts)


@pytest.mark.slow
def test_bfloat16_weights_serve_what_the_float32_master_serves(served):
    """Under bf16 compute every matmul casts its weight to bf16, so an engine serving the
    float32 master (publish_dtype "") samples the same tokens with bitwise the same
    log-probs as the worker serving the published bf16 weights."""
    config = served["config"]
    float32_served = dataclasses.replace(config.model, publish_dtype="")
    engine = Engine(float32_served, config.inference, seed=config.seed)
    engine.load(0, served["master"])
    assert {x.dtype for x in engine.served_params()} == {np.dtype("float32")}
    reference = {r.request_id: r for r in engine.run(_requests())}
    for r in served["rollouts"]:
        assert r.tokens == reference[r.request_id].tokens
        np.testing.assert_array_equal(r.logprobs, reference[r.request_id].logprobs)


def _recomputed(model: ModelConfig, params, tokens) -> np.ndarray:
    """The trainer's recompute of π_old (float32[rows, seq]) for `model` and `params`."""
    abstract = nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0)))
    graphdef = nnx.split(abstract, nnx.Param)[0]
    fn = jax.jit(lambda p, t: recompute_logprobs(graphdef, p, t, micro_size=4))
    return np.asarray(fn(params, tokens))


def test_recompute_from_bfloat16_weights_is_bitwise_the_float32_masters(run):
    """The same forward on the published bf16 weights and on the float32 master gives
    bitwise equal log-probs when compute is bf16; in float32 compute it would not."""
    master = run["master"]
    published = jax.tree.map(lambda x: x.astype(BF16), master)
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, (4, 16), dtype=np.int32)
    np.testing.assert_array_equal(
        _recomputed(MIXED.served(), published, tokens), _recomputed(MIXED, master, tokens)
    )
    f32 = dataclasses.replace(MIXED, dtype="float32")
    assert not np.array_equal(
        _recomputed(f32.served(), published, tokens), _recomputed(f32, master, tokens)
    )


@pytest.mark.slow
def test_served_logprobs_match_the_recompute_from_the_float32_master(served):
    """The worker's behaviour log-probs (bf16 weights, the engine's shapes) against the
    trainer's recompute from the float32 master (bf16 compute, [rows, seq], one device):
    equal up to the rounding of differently shaped computations (on the 2-core CPU host:
    92% of tokens bitwise, the rest within 5e-7)."""
    batch = _batch(served["rollouts"])
    recomputed = _recomputed(MIXED, served["master"], batch.tokens)[batch.response_mask]
    behaviour = batch.behaviour_logprobs[batch.response_mask]
    diff = np.abs(recomputed - behaviour)
    assert diff.max() < 1e-5, (diff.mean(), diff.max())


def test_a_version_in_another_dtype_is_refused(run):
    """The server's layout is the first version's (bf16): a float32 version is refused
    naming the dtypes and model.publish_dtype, and nothing is stored."""
    client, trainer = run["client"], run["trainer"]
    before = client.versions()
    with pytest.raises(ParamServerCallError, match="float32 instead of bfloat16") as info:
        client.publish(7, trainer.params())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.publish_dtype" in str(info.value)
    assert client.versions() == before


def test_a_pull_into_another_dtype_is_refused(run):
    """Pulls never convert: a float32 tree to pull into is refused before any byte moves,
    and a worker built without publish_dtype fails its load saying why."""
    client, config = run["client"], run["config"]
    pulled_before = client.bytes_pulled
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        run["trainer"].params(),
    )
    with pytest.raises(PullMismatchError, match=r"is bfloat16\[.*\] there, float32\[.*\] here"):
        client.pull(0, like)
    assert client.bytes_pulled == pulled_before
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, publish_dtype=""))
    worker = InferenceWorker(other, param_server=client, consumer_id="worker-f32")
    try:
        with pytest.raises(PullFailedError, match="ModelConfig.served"):
            worker.load(0)
        assert worker.version == -1
    finally:
        worker.close()


@pytest.mark.slow
def test_train_step_on_served_rollouts_publishes_the_next_version_in_bfloat16(served):
    """A step on the worker's batch: version 1 is the new float32 master cast to bf16, and
    the step's recomputed-vs-served mismatch is at bf16 rounding (measured 2.6e-4 mean: the
    trainer's 2x2x2 mesh sums sharded bf16 matmuls in another order than one device)."""
    trainer, client = served["trainer"], served["client"]
    result = trainer.train_step(0, _batch(served["rollouts"]))
    assert result.version == 1
    _assert_master_cast(client.pull_arrays(1), _host(trainer.params()))
    assert result.metrics["mismatch/recomputed_vs_cached_mean"] < 2e-3
