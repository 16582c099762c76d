"""Co-location (inference.colocated): a trainer and an inference worker in one process. The
worker serves each version the trainer hands it, bitwise what it would pull, without a pull;
the parameter server still receives every version (in the background after a step); a send
that fails is made again before the next step; a version no longer held is pulled. The
launcher and a whole run are in test_controller_e2e.py (the kill-and-resume run)."""

import dataclasses
import secrets
import time

import jax
import numpy as np
import pytest
from trainer_helpers import ENGINE, MODEL, rollout_batch, run_config

from rlax_tpu.api.param_server import ParamServerCallError
from rlax_tpu.colocation import SharedVersions
from rlax_tpu.config import ConfigError, InferenceConfig
from rlax_tpu.deploy import DeployError
from rlax_tpu.deploy.plan import check_deployable
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.param_server import ServeOptions, start_server
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.trainer import Trainer

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


@pytest.fixture
def colocated(request, tmp_path):
    """A trainer and a worker sharing SharedVersions, with a real parameter server; the
    params published uncast (the trainer hands the params themselves, the default) or, with
    the test parametrized indirectly, cast to bf16."""
    server = start_server(
        ServeOptions(storage_url=str(tmp_path / "params"), hot_versions=8), auth_token=TOKEN
    )
    model = dataclasses.replace(MODEL, publish_dtype=getattr(request, "param", ""))
    inference = dataclasses.replace(ENGINE, colocated=True)
    config = run_config(str(tmp_path / "run"), model=model, inference=inference)
    shared = SharedVersions()
    trainer_client = CountingClient([server.address], auth_token=TOKEN)
    worker_client = CountingClient([server.address], auth_token=TOKEN)
    trainer = Trainer(config, param_server=trainer_client, shared=shared)
    worker = InferenceWorker(
        config, param_server=worker_client, consumer_id="inference_worker-0", shared=shared
    )
    yield dict(
        trainer=trainer,
        worker=worker,
        shared=shared,
        trainer_client=trainer_client,
        worker_client=worker_client,
    )
    worker.close()
    trainer.close()
    worker_client.close()
    trainer_client.close()
    server.stop()


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
