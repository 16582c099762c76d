"""Compiled programs saved by `rlax-tpu compile --save-compiled` and loaded by the trainer
(`trainer.compiled_dir`): tested on 8 CPU devices, the topology the executables are
compiled for here. A trainer on the mesh they were compiled for runs them (and trains as it
does when it compiles); one on another mesh refuses to start, naming the mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from trainer_helpers import rollout_batch, run_config, with_trainer

from rlax_tpu.compile import executables
from rlax_tpu.config import MeshConfig
from rlax_tpu.sharding import build_mesh, use_mesh
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.programs import SavedProgram, TrainerPrograms

MESH = MeshConfig(data=2, fsdp=2, tensor=2)
SEQ = 32  # trainer.max_seq_len: the shape the programs are compiled at


def save_all(config, directory) -> list[str]:
    """What `rlax-tpu compile --save-compiled` does, for this machine's CPU devices."""
    mesh = build_mesh(config.trainer.mesh)
    programs = TrainerPrograms(config, mesh)
    names = []
    for name, (jitted, args, _) in programs.lowerings().items():
        with use_mesh(mesh, programs.rules):
            lowered = jitted.lower(*args)
        executables.save(
            directory, name, lowered, lowered.compile(), mesh, config_digest=config.digest()
        )
        names.append(name)
    return names


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compiled")
    config = run_config(str(tmp_path_factory.mktemp("unused")), mesh=MESH)
    return config, directory, save_all(config, directory)


def test_a_trainer_on_the_compiled_mesh_runs_the_saved_programs(saved, tmp_path):
    config, directory, names = saved
    assert {"init", "init_opt", "rl_step", "recompute"} <= set(names)
    batch = rollout_batch(seq=SEQ)
    results = {}
    for how, compiled_dir in (("saved", str(directory)), ("jit", "")):
        run = with_trainer(config, compiled_dir=compiled_dir)
        trainer = Trainer(run.override("storage.run_dir", str(tmp_path / how)))
        trainer.initialize()
        trainer.train_step(0, batch)
        results[how] = jax.tree.map(np.asarray, trainer.params())
        if how == "saved":
            rl_step = trainer.programs.rl_step
            assert isinstance(rl_step, SavedProgram) and rl_step.calls == 1
            assert trainer.programs.random_init.calls == 1  # version 0: the saved random init
        trainer.close()
    # The same program, compiled once ahead and once here: the same weights (same machine).
    jax.tree.map(np.testing.assert_array_equal, results["saved"], results["jit"])


def test_a_trainer_on_another_mesh_refuses_the_saved_programs(saved, tmp_path):
    config, directory, _ = saved
    other = with_trainer(
        config, mesh=MeshConfig(data=1, fsdp=4, tensor=2), compiled_dir=str(directory)
    )
    with pytest.raises(executables.CompiledMismatchError) as info:
        Trainer(other.override("storage.run_dir", str(tmp_path / "run")))
    message = str(info.value)
    assert "mesh: saved {'data': 2, 'fsdp': 2, 'tensor': 2}" in message
    assert "rlax-tpu compile CONFIG --save-compiled DIR" in message


def test_a_changed_program_is_refused_even_on_the_same_mesh(saved, tmp_path):
    config, directory, _ = saved
    changed = with_trainer(config, learning_rate=3e-2, compiled_dir=str(directory))
    with pytest.raises(executables.CompiledMismatchError, match="program_sha256"):
        Trainer(changed.override("storage.run_dir", str(tmp_path / "run")))
