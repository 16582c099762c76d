"""Versions and checkpoints of the trainer: idempotent steps, order, publish to a real
parameter server, restore on another mesh, corrupt/incomplete checkpoints, gs://."""

import dataclasses
import logging
import secrets
import shutil

import jax
import numpy as np
import pytest
from processes import ProcessGroup
from trainer_helpers import assert_trees_close, rollout_batch, run_config

from rlax_tpu.config import AlgorithmConfig, MeshConfig
from rlax_tpu.param_server.client import ParamServerClient
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import OutOfOrderStepError, Trainer

TOKEN = secrets.token_hex(8)
FOUR_DEVICES = MeshConfig(data=1, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trainer on 8 devices publishing to a real parameter server, checkpointing every
    step, after steps 0 and 1. Yields (trainer, client, params after step 0, results)."""
    group = ProcessGroup()
    address = group.start_param_server(None, token=TOKEN).address
    client = ParamServerClient([address], auth_token=TOKEN)
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
    again = trainer.train_step(0, rollout_batch(7))
    assert again.already_done and again.metrics == first.metrics and again.version == 1
    assert trainer.step == 2
    assert_trees_close(trainer.params(), before, rtol=0, atol=0)


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


def test_restore_on_a_four_device_mesh_gives_the_same_values(run):
    trainer = run[0]
    mesh = build_mesh(FOUR_DEVICES, devices=jax.devices()[:4])
    restored = Trainer(trainer.config, mesh=mesh)
    assert restored.initialize() == 2
    assert_trees_close(restored.params(), trainer.params(), rtol=0, atol=0)
    leaf = jax.tree.leaves(restored.params())[0]
    assert len(leaf.sharding.device_set) == 4
    # The recorded results survive the restart: step 1 is still idempotent.
    assert restored.train_step(1, None).metrics == run[3][1].metrics
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


def test_checkpoint_round_trip_on_gcs(gcs_bucket):
    # One device and no reference copy: fewer, larger objects on the (slow) emulator.
    one = MeshConfig(data=1, fsdp=1, tensor=1)
    config = run_config(f"{gcs_bucket}/run", mesh=one, algorithm=AlgorithmConfig(name="grpo"))
    mesh = build_mesh(one, devices=jax.devices()[:1])
    trainer = Trainer(config, mesh=mesh)
    trainer.initialize()
    assert trainer.save(wait=True) == 0
    trainer.close()
    restored = Trainer(config, mesh=mesh)
    assert restored.initialize() == 0
    assert restored.checkpoints.steps() == [0]
    assert_trees_close(restored.params(), trainer.params(), rtol=0, atol=0)
    restored.close()
