"""Versions and checkpoints of the trainer: idempotent steps, order, publish to a real
parameter server, restore on another mesh, corrupt/incomplete checkpoints, async saves,
keep-N, file:// and gs://."""

import dataclasses
import logging
import secrets
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec
from processes import ProcessGroup
from trainer_helpers import assert_trees_close, rollout_batch, run_config

from rlax_tpu.api.trainer import batch_digest
from rlax_tpu.checkpoints import COMMIT_MARKER, checksums
from rlax_tpu.config import AlgorithmConfig, MeshConfig
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import BatchMismatchError, OutOfOrderStepError, Trainer

TOKEN = secrets.token_hex(8)
FOUR_DEVICES = MeshConfig(data=1, fsdp=2, tensor=2)
ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)
# GRPO without a KL term keeps no reference copy: fewer arrays to write per checkpoint.
NO_REFERENCE = AlgorithmConfig(name="grpo")


def _one_device_mesh():
    return build_mesh(ONE_DEVICE, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trainer on 8 devices publishing to a real parameter server, checkpointing every
    step, after steps 0 and 1. Yields (trainer, client, params after step 0, results)."""
    group = ProcessGroup()
    address = group.start_param_server(None, token=TOKEN).address
    client = TreeClient([address], auth_token=TOKEN)
    run_dir = tmp_path_factory.mktemp("run")
    trainer = Trainer(run_config(str(run_dir), mini=4, checkpoint_every=1), param_server=client)
    assert trainer.initialize() == 0
    first = trainer.train_step(0, rollout_batch(0))
    after_first = jax.tree.map(np.asarray, trainer.params())
    second = trainer.train_step(1, rollout_batch(1))
    trainer.close()
    yield trainer, client, after_first, (first, second)
    client.close()
    group.stop_all()


def test_repeated_step_returns_the_recorded_result_and_trains_nothing(run):
    trainer, _, _, (first, _) = run
    before = jax.tree.map(np.asarray, trainer.params())
    again = trainer.train_step(0, rollout_batch(0))
    assert again.already_done and again.metrics == first.metrics and again.version == 1
    assert trainer.step == 2
    assert_trees_close(trainer.params(), before, rtol=0, atol=0)


def test_a_repeated_step_with_another_batch_is_refused(run, tmp_path):
    """A repeat answered from the record must be the same batch: one that is not means the
    controller's log or snapshot disagrees with what was trained, which a recorded answer
    would hide. Also after a restore, from the checkpoint's records."""
    trainer, _, _, (first, _) = run
    with pytest.raises(BatchMismatchError, match="step 0 is repeated with another batch"):
        trainer.train_step(0, rollout_batch(7))
    assert trainer.step == 2
    restored = Trainer(run_config(str(trainer.config.storage.run_dir), mini=4, checkpoint_every=1))
    try:
        assert restored.restore(2) == 2
        with pytest.raises(BatchMismatchError, match="step 1 is repeated"):
            restored.train_step(1, rollout_batch(7))
        again = restored.train_step(1, rollout_batch(1))
        assert again.already_done and again.batch_digest == batch_digest(rollout_batch(1))
    finally:
        restored.close()


def test_step_out_of_order_is_rejected_naming_the_expected_step(run):
    trainer = run[0]
    with pytest.raises(OutOfOrderStepError, match="expected step is 2"):
        trainer.train_step(5, rollout_batch(5))


def test_each_step_publishes_its_version_to_the_param_server(run):
    trainer, client, after_first, _ = run
    # The server keeps the newest K = N + η + 1 = 2 versions hot (version 0 was published).
    assert client.versions()[-2:] == [1, 2]
    like = trainer.params()
    assert_trees_close(client.pull(2, like), trainer.params(), rtol=0, atol=0)
    assert_trees_close(client.pull(1, like), after_first, rtol=0, atol=0)


def test_restore_keeps_the_state_of_a_trainer_past_the_checkpoint_with_every_result_since(run):
    """A restarted controller reattaching: Restore(c) of a trainer at step 2 that holds the
    results of steps c..1 keeps its state, and the steps from c are answered from records."""
    trainer = run[0]
    before = jax.tree.map(np.asarray, trainer.params())
    for checkpoint in (1, 2):  # behind it, and where it stands (it trained here)
        assert trainer.restore(checkpoint) == checkpoint and trainer.step == 2
        assert_trees_close(trainer.params(), before, rtol=0, atol=0)
    assert trainer.train_step(1, rollout_batch(1)).already_done


def test_a_version_whose_publish_failed_is_published_before_the_next_answer(tmp_path):
    """The parameter server is down past the client's wait: the step's publish fails, the
    step stays trained, and its repeat publishes the version (to the restarted server)."""
    from rlax_tpu.rpc import ComponentUnreachableError

    group = ProcessGroup()
    try:
        first = group.start_param_server(None, token=TOKEN)
        port = first.address.rsplit(":", 1)[1]
        # Waits 2 s for a server that does not answer (the config's component_wait_s).
        client = TreeClient([first.address], auth_token=TOKEN, reconnect_s=2.0)
        config = run_config(str(tmp_path), mini=4, checkpoint_every=100, mesh=ONE_DEVICE)
        trainer = Trainer(config, param_server=client, mesh=_one_device_mesh())
        assert trainer.initialize() == 0
        first.kill()
        with pytest.raises(ComponentUnreachableError, match="has not answered for 2s"):
            trainer.train_step(0, rollout_batch(0))
        assert trainer.step == 1
        group.start_param_server(None, token=TOKEN, args=["--port", port])
        # The restarted server gets a run's usual wait: on a loaded host the channel's
        # reconnect backoff (up to 2 s) alone can outlast the 2 s that made the first
        # publish fail fast (seen in the xdist suite on 2 busy cores).
        client.reconnect_s = 60.0
        assert trainer.train_step(0, rollout_batch(0)).already_done
        assert client.versions() == [1]  # version 0 went with the memory-only server
        assert_trees_close(client.pull(1, trainer.params()), trainer.params(), rtol=0, atol=0)
        # Lost after its publish (the server died before writing it to storage): the
        # controller asks the trainer to publish it again; an older version it cannot.
        group.processes[-1].kill()
        group.start_param_server(None, token=TOKEN, args=["--port", port])
        trainer.republish(1)
        assert client.versions() == [1]
        with pytest.raises(OutOfOrderStepError, match="holds version 1"):
            trainer.republish(0)
        trainer.close()
        client.close()
    finally:
        group.stop_all()


def test_restore_on_a_four_device_mesh_gives_the_same_values(run):
    trainer = run[0]
    mesh = build_mesh(FOUR_DEVICES, devices=jax.devices()[:4])
    restored = Trainer(trainer.config, mesh=mesh)
    assert restored.initialize() == 2
    assert_trees_close(restored.params(), trainer.params(), rtol=0, atol=0)
    leaf = jax.tree.leaves(restored.params())[0]
    assert len(leaf.sharding.device_set) == 4
    # The recorded results survive the restart: step 1 is still idempotent.
    assert restored.train_step(1, rollout_batch(1)).metrics == run[3][1].metrics
    restored.close()


def _copy_run(trainer, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(trainer.config.storage.run_dir, run_dir)
    config = dataclasses.replace(
        trainer.config, storage=dataclasses.replace(trainer.config.storage, run_dir=str(run_dir))
    )
    return config, run_dir / "checkpoints" / "2"


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(run, tmp_path, caplog):
    trainer, _, after_first, _ = run
    config, newest = _copy_run(trainer, tmp_path)
    chunks = [f for f in (newest / "state").glob("params.*/*") if not f.name.startswith(".")]
    assert chunks
    for chunk in chunks:  # overwrite the array data (not a zstd frame), keep the metadata
        chunk.write_bytes(b"\xa5" * chunk.stat().st_size)
    restored = Trainer(config, mesh=build_mesh(FOUR_DEVICES, devices=jax.devices()[:4]))
    with caplog.at_level(logging.WARNING):
        assert restored.initialize() == 1
    assert "checkpoint 2" in caplog.text
    assert_trees_close(restored.params(), after_first, rtol=0, atol=0)
    restored.close()


def test_incomplete_newest_checkpoint_is_never_loaded(run, tmp_path, caplog):
    trainer, _, after_first, _ = run
    config, newest = _copy_run(trainer, tmp_path)
    (newest / "commit_success.txt").unlink()
    restored = Trainer(config, mesh=build_mesh(FOUR_DEVICES, devices=jax.devices()[:4]))
    with caplog.at_level(logging.WARNING):
        assert restored.initialize() == 1
    assert "incomplete" in caplog.text
    assert_trees_close(restored.params(), after_first, rtol=0, atol=0)
    restored.close()


def test_checksums_are_exact_and_independent_of_sharding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 24)).astype(np.float32)
    state = {"w": jnp.asarray(x), "b": jnp.asarray(x[0], jnp.bfloat16), "n": jnp.arange(5)}
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("a", "b"))
    sharded = dict(
        state, w=jax.device_put(state["w"], NamedSharding(mesh, PartitionSpec("a", "b")))
    )
    assert checksums(sharded) == checksums(state)

    def changed(**arrays):
        return checksums({**state, **{k: jnp.asarray(v) for k, v in arrays.items()}})

    one_ulp = x.copy()
    one_ulp[3, 5] = np.nextafter(one_ulp[3, 5], np.float32(np.inf))
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    bf16 = np.asarray(state["b"]).copy()
    bf16[7] = -bf16[7]
    for other in (changed(w=one_ulp), changed(w=swapped), changed(b=bf16)):
        assert other != checksums(state)


def _nudge_one_element(array_dir, delta: float) -> None:
    """Add `delta` to element 0 of the zarr array stored in `array_dir` (its metadata and
    encoding stay valid: only the value changes, as with silent bit rot)."""
    array = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(array_dir)}})
    array = array.result()
    index = (0,) * array.ndim
    value = array[index].read().result()
    array[index].write(value + np.asarray(delta, value.dtype)).result()
    assert array[index].read().result() != value


def test_one_slightly_changed_value_falls_back_and_is_replaced(run, tmp_path, caplog):
    """One parameter off by 1e-3 in the newest checkpoint: its checksums do not match, so
    the previous checkpoint is restored with the reason logged; retraining the step then
    replaces the bad checkpoint, and the next restore loads the new one."""
    trainer, _, after_first, _ = run
    config, newest = _copy_run(trainer, tmp_path)
    _nudge_one_element(newest / "state" / "params.embed", 1e-3)
    mesh = build_mesh(FOUR_DEVICES, devices=jax.devices()[:4])
    restored = Trainer(config, mesh=mesh)
    with caplog.at_level(logging.WARNING):
        assert restored.initialize() == 1
    assert "checkpoint 2" in caplog.text
    assert "['params']['embed'] does not match its checksums" in caplog.text
    assert_trees_close(restored.params(), after_first, rtol=0, atol=0)
    assert restored.status()["checkpoint_steps"] == [1]

    restored.train_step(1, rollout_batch(1))  # checkpoint_every=1: saves step 2 again
    restored.close()
    again = Trainer(config, mesh=mesh)
    assert again.initialize() == 2
    assert_trees_close(again.params(), restored.params(), rtol=0, atol=0)
    again.close()


def test_checkpoint_saves_are_asynchronous(tmp_path, monkeypatch):
    """A train step that checkpoints returns while the save is still being finalized (the
    finalize thread is held until the test releases it); status() answers meanwhile."""
    release, finalizers = threading.Event(), []
    finalize = ocp.CheckpointManager._finalize

    def held_finalize(self, *args, **kwargs):
        finalizers.append(threading.current_thread())
        if threading.current_thread() is not threading.main_thread():
            release.wait(timeout=120)
        return finalize(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "_finalize", held_finalize)
    config = run_config(
        str(tmp_path / "run"), mesh=ONE_DEVICE, algorithm=NO_REFERENCE, checkpoint_every=1
    )
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    marker = tmp_path / "run" / "checkpoints" / "1" / COMMIT_MARKER
    try:
        assert trainer.train_step(0, rollout_batch(0)).version == 1
        assert trainer.checkpoints.saving()
        assert not marker.exists()
        assert trainer.status()["checkpoint_steps"] == [1]  # in flight, no storage read
    finally:
        release.set()
    trainer.close()
    assert finalizers and threading.main_thread() not in finalizers
    assert marker.exists() and not trainer.checkpoints.saving()


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """A trainer on one device checkpointing every step to a file:// URL, keeping 2, after
    4 steps and close(). Yields (trainer, local run directory)."""
    run_dir = tmp_path_factory.mktemp("file_run")
    config = run_config(
        f"file://{run_dir}",
        mesh=ONE_DEVICE,
        algorithm=NO_REFERENCE,
        checkpoint_every=1,
        max_checkpoints_to_keep=2,
    )
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    for step in range(4):
        trainer.train_step(step, rollout_batch(step))
        trainer.status()  # polled between steps (Health) while a save is in flight
    trainer.close()
    return trainer, run_dir


def test_keep_n_leaves_exactly_the_newest_n_checkpoints(file_run):
    trainer, run_dir = file_run
    on_disk = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert on_disk == [3, 4]
    assert trainer.checkpoints.steps() == [3, 4]
    assert trainer.checkpoints.steps(reload=True) == [3, 4]


def test_checkpoint_round_trip_on_a_file_url(file_run):
    trainer, _ = file_run
    assert trainer.config.storage.run_dir.startswith("file://")
    restored = Trainer(trainer.config, mesh=_one_device_mesh())
    assert restored.initialize() == 4
    assert_trees_close(restored.params(), trainer.params(), rtol=0, atol=0)
    batch = rollout_batch(3)
    assert restored.train_step(3, batch).metrics == trainer.train_step(3, batch).metrics
    restored.close()


def test_checkpoint_round_trip_on_gcs(gcs_bucket):
    """A trained state (params and Adam moments after a step), saved asynchronously by the
    step itself, restores exactly from gs://; keep-N holds there too."""
    # One device and no reference copy: fewer, larger objects on the (slow) emulator.
    config = run_config(
        f"{gcs_bucket}/run",
        mesh=ONE_DEVICE,
        algorithm=NO_REFERENCE,
        checkpoint_every=1,
        max_checkpoints_to_keep=1,
    )
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    first = trainer.train_step(0, rollout_batch(0))
    trainer.train_step(1, rollout_batch(1))
    trainer.close()
    restored = Trainer(config, mesh=_one_device_mesh())
    assert restored.initialize() == 2
    assert restored.checkpoints.steps() == [2]
    assert_trees_close(restored.params(), trainer.params(), rtol=0, atol=0)
    assert_trees_close(restored._opt_state, trainer._opt_state, rtol=0, atol=0)
    assert restored.train_step(0, rollout_batch(0)).metrics == first.metrics
    restored.close()
