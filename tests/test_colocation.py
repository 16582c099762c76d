"""Co-location (inference.colocated): a trainer and an inference worker in one process. The
worker serves each version the trainer hands it, bitwise what it would pull, without a pull;
with colocated_publish "every" the parameter server receives every version (in the
background after a step), with "needed" only those a checkpoint relies on (and a held one
on request); a send that fails is made again before the next step; a version no longer held
is pulled. The launcher and a whole run are in test_controller_e2e.py (the kill-and-resume
run, with the default "needed")."""

import contextlib
import dataclasses
import secrets
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx
from trainer_helpers import ENGINE, MODEL, rollout_batch, run_config

from rlax_tpu.api.inference import GenerationRequest, VersionMismatchError
from rlax_tpu.api.param_server import ParamServerCallError
from rlax_tpu.api.trainer import (
    SFT_STEP,
    BatchFormatError,
    BatchLimits,
    BatchReceiver,
    TrainerClient,
    batch_stream,
)
from rlax_tpu.colocation import DEFAULT_KEEP, SharedVersions
from rlax_tpu.config import ConfigError, InferenceConfig, MeshConfig, StalenessConfig
from rlax_tpu.deploy import DeployError
from rlax_tpu.deploy.plan import check_deployable
from rlax_tpu.inference.weights import ServedWeights
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.models import Transformer
from rlax_tpu.param_server import ServeOptions, start_server
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.rpc.channels import make_server
from rlax_tpu.sharding import build_mesh
from rlax_tpu.staleness import StalenessPolicy
from rlax_tpu.trainer import OutOfOrderStepError, Trainer
from rlax_tpu.trainer.service import TrainerServicer

TOKEN = secrets.token_hex(8)


class CountingClient(TreeClient):
    """The real client, counting the versions it pulls and failing the sends it is told to
    (a parameter server that is down when they are made)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pulled: list[int] = []
        self.fail_sends: set[int] = set()

    def pull(self, version, like, wait_s=0.0):
        self.pulled.append(version)
        return super().pull(version, like, wait_s)

    def publish(self, version, tree, *args, **kwargs):
        if version in self.fail_sends:
            self.fail_sends.discard(version)
            raise ParamServerCallError(f"version {version}: the server is down (test)")
        return super().publish(version, tree, *args, **kwargs)


@contextlib.contextmanager
def _colocated(tmp_path, *, publish_dtype="", publish="every", staleness=None, **trainer):
    """A trainer and a worker sharing SharedVersions (holding what trainer.server gives it),
    with a real parameter server; `publish`: inference.colocated_publish."""
    server = start_server(
        ServeOptions(storage_url=str(tmp_path / "params"), hot_versions=8), auth_token=TOKEN
    )
    model = dataclasses.replace(MODEL, publish_dtype=publish_dtype)
    inference = dataclasses.replace(ENGINE, colocated=True, colocated_publish=publish)
    config = run_config(str(tmp_path / "run"), model=model, inference=inference, **trainer)
    if staleness is not None:
        config = dataclasses.replace(config, staleness=staleness)
    shared = SharedVersions(DEFAULT_KEEP)
    trainer_client = CountingClient([server.address], auth_token=TOKEN)
    worker_client = CountingClient([server.address], auth_token=TOKEN)
    trainer = Trainer(config, param_server=trainer_client, shared=shared)
    worker = InferenceWorker(
        config, param_server=worker_client, consumer_id="inference_worker-0", shared=shared
    )
    try:
        yield dict(
            trainer=trainer,
            worker=worker,
            shared=shared,
            trainer_client=trainer_client,
            worker_client=worker_client,
        )
    finally:
        worker.close()
        trainer.close()
        worker_client.close()
        trainer_client.close()
        server.stop()


@pytest.fixture
def colocated(request, tmp_path):
    """`_colocated` sending every version; the params published uncast (the trainer hands
    the params themselves, the default) or, with the test parametrized indirectly, cast to
    bf16."""
    with _colocated(tmp_path, publish_dtype=getattr(request, "param", "")) as parts:
        yield parts


def _served(worker) -> list[np.ndarray]:
    return [np.asarray(x) for x in worker.engine.served_params()]


def _placed(worker, params) -> list[np.ndarray]:
    """`params` as the worker's engine places them (cast to the served dtype)."""
    return [np.asarray(x) for x in worker.engine._weights.place(params)]


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "colocated", ["", "bfloat16"], ids=["params_as_published", "cast_to_bf16"], indirect=True
)
def test_the_worker_serves_each_version_the_trainer_hands_it_without_a_pull(colocated):
    trainer, worker, shared = colocated["trainer"], colocated["worker"], colocated["shared"]
    trainer.initialize()
    worker.load(0)
    held = {0: _placed(worker, trainer.params())}
    for step in range(3):
        trainer.train_step(step, rollout_batch(step))
        worker.load(step + 1)
        held[step + 1] = _placed(worker, trainer.params())
        _assert_equal(_served(worker), held[step + 1])
    assert colocated["worker_client"].pulled == []
    assert shared.handed == 4 and shared.versions() == [2, 3]
    # The arrays the worker serves are its own: the trainer's next step (which updates its
    # params in place) leaves them as they were.
    trainer.train_step(3, rollout_batch(3))
    _assert_equal(_served(worker), held[3])
    # Every version reached the parameter server, bitwise what the worker was handed.
    trainer.save()  # ends the background send
    client = colocated["trainer_client"]
    assert client.versions() == [0, 1, 2, 3, 4]
    for version in (1, 3):
        pulled = client.pull(version, worker.param_like())
        _assert_equal(_placed(worker, pulled), held[version])


def test_a_version_no_longer_handed_is_pulled_from_the_parameter_server(colocated):
    trainer, worker = colocated["trainer"], colocated["worker"]
    trainer.initialize()
    placed = {0: _placed(worker, trainer.params())}
    for step in range(3):
        trainer.train_step(step, rollout_batch(step))
        placed[step + 1] = _placed(worker, trainer.params())
    worker.load(1, evaluation=True)  # held are 2 and 3 only
    assert colocated["worker_client"].pulled == [1]
    _assert_equal(_served(worker), placed[1])


def test_a_send_that_failed_in_the_background_is_made_before_the_next_step(colocated):
    trainer, worker, client = (
        colocated["trainer"],
        colocated["worker"],
        colocated["trainer_client"],
    )
    trainer.initialize()
    client.fail_sends.add(1)
    trainer.train_step(0, rollout_batch(0))
    worker.load(1)  # handed: the worker does not need the server
    assert colocated["worker_client"].pulled == []
    trainer.train_step(1, rollout_batch(1))  # publishes version 1 again first
    trainer.save()
    assert client.versions() == [0, 1, 2]


def test_a_step_call_has_the_worker_load_the_version_it_makes(colocated):
    """TrainStep's load_colocated, over real gRPC: when the reply comes, the worker in the
    trainer's process runs every request with the step's version (its swap queued first),
    serving what a Load of it would have; without the flag, or for a version no longer held,
    it loads nothing; SftStep refuses the flag."""
    trainer, worker = colocated["trainer"], colocated["worker"]
    trainer.initialize()
    worker.load(0)
    servicer = TrainerServicer(trainer, limits=BatchLimits.from_config(trainer.config))
    servicer.load_colocated = worker.load_handed
    server, port = make_server("127.0.0.1", 0, auth_token=TOKEN, max_workers=2)
    servicer.add_to_server(server)
    server.start()
    client = TrainerClient(f"127.0.0.1:{port}", auth_token=TOKEN)
    try:
        gate = threading.Event()
        worker._on_engine(gate.wait)  # the engine thread waits: the swap below stays queued
        result = client.train_step(0, rollout_batch(0), load_colocated=True)
        assert result.colocated_loaded and "time/colocated_handover_s" in result.metrics
        assert worker.version == 0  # not swapped yet...
        # ... but a request made now is for version 1: it runs after the queued swap.
        stream = worker.generate([GenerationRequest("r-0", "p-0", 0, (1, 2, 3))], version=1)
        gate.set()
        (rollout,) = list(stream)
        assert rollout.version == 1 and rollout.finish_reason in ("stop", "length")
        assert worker.load(1).already_loaded
        _assert_equal(_served(worker), _placed(worker, trainer.params()))
        loads = worker.stats()["loads"]
        result = client.train_step(1, rollout_batch(1))  # not asked: the worker keeps 1
        assert not result.colocated_loaded and worker.stats()["version"] == 1
        # The repeat of a step no longer held here (3 and 4 are): nothing to hand, so the
        # caller loads it as usual.
        client.train_step(2, rollout_batch(2))
        client.train_step(3, rollout_batch(3))
        result = client.train_step(1, rollout_batch(1), load_colocated=True)
        assert result.already_done and not result.colocated_loaded
        assert worker.stats()["version"] == 1 and worker.stats()["loads"] == loads
        # Asked again for a version it holds: done, and it loads nothing new.
        result = client.train_step(3, rollout_batch(3), load_colocated=True)
        assert result.colocated_loaded and worker.load(4).already_loaded
    finally:
        client.close()
        server.stop(0)
    assert colocated["worker_client"].pulled == []
    sft = {name: np.ones((2, 8), np.int32) for name in ("tokens", "targets", "loss_mask")}
    header = next(batch_stream(0, sft, load_colocated=True)).header
    with pytest.raises(BatchFormatError, match="load_colocated, which only TrainStep"):
        BatchReceiver(SFT_STEP).header(header)


def test_a_handed_swap_that_fails_leaves_the_worker_serving_what_it_served(colocated, monkeypatch):
    """A handed version whose swap fails: the worker keeps serving the version before it,
    a Generate of the handed version is refused (so the controller's pool Loads it and sees
    the error), and a later Load of it works."""
    trainer, worker = colocated["trainer"], colocated["worker"]
    trainer.initialize()
    worker.load(0)
    trainer.train_step(0, rollout_batch(0))
    real_load = worker.engine.load

    def broken(version, params):
        raise RuntimeError("the swap failed (test)")

    monkeypatch.setattr(worker.engine, "load", broken)
    assert worker.load_handed(1)  # queued: its failure comes on the engine thread
    worker._on_engine(lambda: None).result()  # the engine thread has run the swap
    assert worker.version == 0
    with pytest.raises(VersionMismatchError, match="holds version 0; Load 1 first"):
        worker.generate([GenerationRequest("r-0", "p-0", 0, (1, 2, 3))], version=1)
    monkeypatch.setattr(worker.engine, "load", real_load)
    assert not worker.load(1).already_loaded and worker.version == 1


def test_needed_sends_only_what_a_checkpoint_relies_on_and_a_held_version_on_request(tmp_path):
    """colocated_publish "needed", one step off-policy (N = 1), checkpoints every 3 steps:
    the worker is handed every version; the server gets version 0, each checkpoint's
    [oldest a resume generates with, checkpoint], the run's last, and a held version the
    controller asks for (as after a parameter server restart lost it)."""
    staleness = StalenessConfig(reload_every=1, max_staleness=1)
    with _colocated(tmp_path, publish="needed", staleness=staleness, checkpoint_every=3) as parts:
        trainer, worker, client = parts["trainer"], parts["worker"], parts["trainer_client"]
        trainer.initialize()
        placed = {0: _placed(worker, trainer.params())}
        for step in range(5):
            batch = rollout_batch(step)
            batch = dataclasses.replace(batch, versions=batch.versions + max(0, step - 1))
            trainer.train_step(step, batch)
            worker.load(step + 1)
            placed[step + 1] = _placed(worker, trainer.params())
        assert parts["worker_client"].pulled == []
        # Checkpoint 3 sent [g(3), 3] = [2, 3]; versions 1, 4 and 5 were only handed.
        assert client.versions() == [0, 2, 3]
        _assert_equal(_placed(worker, client.pull(2, worker.param_like())), placed[2])
        trainer.republish(4)  # held (the 2 copies: 4, 5)
        assert client.versions() == [0, 2, 3, 4]
        with pytest.raises(OutOfOrderStepError, match="an older version comes back only"):
            trainer.republish(1)  # neither held nor the trainer's
        trainer.save()  # a checkpoint at 5: [g(5), 5] = [4, 5]
        assert client.versions() == [0, 2, 3, 4, 5]
        _assert_equal(_placed(worker, client.pull(5, worker.param_like())), placed[5])


@pytest.mark.parametrize(
    ("reload_every", "max_staleness", "on_server"),
    [
        (2, 2, [0, 4, 6]),  # never needed once dropped: the save sends [g(6), 6]
        (1, 4, [0, 1, 2, 3, 4, 5, 6]),  # each still needed once dropped: sent at publish
    ],
)
def test_needed_holds_two_copies_and_sends_what_a_resume_needs_once_dropped(
    tmp_path, reload_every, max_staleness, on_server
):
    """colocated_publish "needed" holds 2 copies of the served weights whatever N is: a
    version a resume may generate with after the second newer one is published (N >= 2η)
    is sent at its publish; the others only by a checkpoint that needs them. A save at an
    unscheduled step then finds all of [g(step), step] on the server."""
    staleness = StalenessConfig(reload_every=reload_every, max_staleness=max_staleness)
    policy = StalenessPolicy.from_config(staleness)
    with _colocated(tmp_path, publish="needed", staleness=staleness, checkpoint_every=50) as parts:
        trainer, worker, shared = parts["trainer"], parts["worker"], parts["shared"]
        client = parts["trainer_client"]
        trainer.initialize()
        placed = {0: _placed(worker, trainer.params())}
        for step in range(6):
            batch = rollout_batch(step)
            batch = dataclasses.replace(
                batch, versions=batch.versions + policy.scheduled_version(step)
            )
            trainer.train_step(step, batch)
            placed[step + 1] = _placed(worker, trainer.params())
            assert len(shared.versions()) <= DEFAULT_KEEP
        trainer.save()  # step 6, no scheduled checkpoint before it
        assert client.versions() == on_server
        assert set(policy.published(policy.oldest_needed(6), 6, 6)) <= set(on_server)
        for version in on_server:
            pulled = client.pull(version, worker.param_like())
            _assert_equal(_placed(worker, pulled), placed[version])


def test_device_arrays_of_another_mesh_are_resharded_bitwise_and_ours_are_not_copied():
    """What a co-located worker does with the trainer's arrays (ServedWeights.place): a
    tree replicated on the trainer's data-parallel mesh lands on the worker's tensor-parallel
    one with the same values, each leaf sharded as the worker's programs take it; arrays
    already in the worker's shardings are served as they are."""
    devices = np.array(jax.devices()[:2])
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=list(devices))
    weights = ServedWeights(MODEL, ENGINE, mesh)
    host = nnx.to_pure_dict(nnx.state(Transformer(MODEL, rngs=nnx.Rngs(0))))
    trainer_mesh = jax.sharding.Mesh(devices.reshape(2, 1, 1), ("data", "fsdp", "tensor"))
    replicated = jax.sharding.NamedSharding(trainer_mesh, jax.sharding.PartitionSpec())
    handed = jax.tree.map(lambda x: jax.device_put(np.asarray(x), replicated), host)
    placed = weights.place(handed)
    expected = weights.place(host)  # host arrays: sliced per device on the host
    assert [x.sharding for x in placed] == [leaf.sharding for leaf in weights._layout]
    assert any(len(x.sharding.device_set) == 2 and not x.is_fully_replicated for x in placed)
    _assert_equal([np.asarray(x) for x in placed], [np.asarray(x) for x in expected])
    # The moved leaves go through one compiled reshard, reused by the next load.
    programs = dict(weights._reshards)
    assert programs
    weights.place(handed)
    assert weights._reshards == programs
    ours = weights.place(nnx.to_pure_dict(jax.tree.unflatten(weights.treedef, placed)))
    assert all(a is b for a, b in zip(ours, placed, strict=True))
    # An FSDP trainer's tree (each leaf split along its first axis) lands bitwise too; its
    # leaves move between devices by device_put, not by another compiled program.
    fsdp = jax.tree.map(
        lambda x: jax.device_put(
            np.asarray(x),
            jax.sharding.NamedSharding(
                trainer_mesh,
                jax.sharding.PartitionSpec("data")
                if np.ndim(x) and np.shape(x)[0] % 2 == 0
                else jax.sharding.PartitionSpec(),
            ),
        ),
        host,
    )
    assert any(not x.is_fully_replicated for x in jax.tree.leaves(fsdp))
    placed = weights.place(fsdp)
    assert [x.sharding for x in placed] == [leaf.sharding for leaf in weights._layout]
    _assert_equal([np.asarray(x) for x in placed], [np.asarray(x) for x in expected])

    # Only replicated leaves go through a compiled reshard (sliced where they lie).
    def handed_leaf(i):
        node = fsdp
        for key in weights._layout[i].keys:
            node = node[key] if key in node else node[str(key)]
        return node

    new = set(weights._reshards) - set(programs)
    assert all(handed_leaf(i).is_fully_replicated for key in new for i in key)


def test_colocated_takes_one_worker_and_no_deploy():
    with pytest.raises(ConfigError, match="inference.num_workers=1"):
        InferenceConfig(colocated=True, num_workers=2).validate()
    config = run_config("/tmp/unused", inference=dataclasses.replace(ENGINE, colocated=True))
    with pytest.raises(DeployError, match="inference.colocated"):
        check_deployable(config)


def test_shared_versions_hold_the_newest_and_wait_for_their_sends():
    import concurrent.futures

    shared = SharedVersions(keep=2)
    sends = [concurrent.futures.Future() for _ in range(3)]
    for version, sent in enumerate(sends):
        shared.put(version, {"w": jax.numpy.full((2,), version)}, sent)
    assert shared.versions() == [1, 2] and shared.take(0) is None
    assert float(shared.take(2)["w"][0]) == 2.0
    waited = concurrent.futures.ThreadPoolExecutor(1).submit(shared.wait_sent, 1)
    sends[0].set_result(None)
    time.sleep(0.1)
    assert not waited.done()  # version 1's send has not ended
    sends[1].set_exception(RuntimeError("down"))  # ended: a failure ends the wait too
    waited.result(timeout=10)  # version 2's send, still under way, is not waited for
    assert not sends[2].done()
