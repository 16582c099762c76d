"""Compiled programs saved by `rlax-tpu compile --save-compiled` and loaded by the trainer
(`trainer.compiled_dir`): tested on 8 CPU devices, the topology the executables are
compiled for here. A trainer on the mesh they were compiled for runs them (and trains as it
does when it compiles); one on another mesh refuses to start, naming the mesh."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from trainer_helpers import rollout_batch, run_config, with_trainer

from rlax_tpu.compile import executables
from rlax_tpu.compile.executables import SavedProgram
from rlax_tpu.config import MeshConfig
from rlax_tpu.sharding import build_mesh, use_mesh
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.programs import TrainerPrograms

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
        compiled = executables.compile_to_save(lowered)
        executables.save(directory, name, lowered, compiled, mesh, config_digest=config.digest())
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
    optimizer = dataclasses.replace(config.trainer.optimizer, learning_rate=3e-2)
    changed = with_trainer(config, optimizer=optimizer, compiled_dir=str(directory))
    with pytest.raises(executables.CompiledMismatchError, match="program_sha256"):
        Trainer(changed.override("storage.run_dir", str(tmp_path / "run")))


SAVE_AFTER_CACHE = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from jax.experimental import serialize_executable
    from rlax_tpu.compile.executables import compile_to_save

    def f(x, w):
        y = jnp.broadcast_to(x[:, None, :], (x.shape[0], 4, x.shape[1]))
        return jnp.tanh(y @ w).sum(axis=1) + jnp.arange(x.shape[1], dtype=x.dtype)

    x, w = jnp.ones((8, 16)), jnp.full((16, 16), 0.01)
    lowered = jax.jit(f).lower(x, w)
    compiled = lowered.compile() if sys.argv[1] == "warm" else compile_to_save(lowered)
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    print(float(loaded(x, w).sum()), float(f(x, w).sum()))
    """
)


def test_an_executable_saved_after_the_compilation_cache_holds_it_still_runs(tmp_path):
    """The persistent compilation cache answers a program another process compiled with a
    deserialised executable, which XLA:CPU serialises without its kernels. What is saved
    (`compile_to_save`) is compiled past the cache: it loads and runs in a fresh process."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",  # one device: the program is not sharded
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    for step in ("warm", "save"):  # the first process fills the cache, the second saves
        done = subprocess.run(
            [sys.executable, "-c", SAVE_AFTER_CACHE, step],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        ran, expected = map(float, done.stdout.split())
        assert ran == expected
    assert any((tmp_path / "cache").iterdir())  # the second process could have used it


def test_an_inference_engine_runs_the_saved_programs_of_its_mesh(tmp_path):
    """`--save-compiled` keeps the engine's programs too (prefill and decode at each bucket,
    the swap copies): an engine on the same mesh runs them and generates what one that
    compiles does; one on another mesh refuses them, naming the mesh."""
    from rlax_tpu.api.inference import GenerationRequest
    from rlax_tpu.config import InferenceConfig, ModelConfig
    from rlax_tpu.inference.engine import Engine
    from rlax_tpu.inference.sampling import SamplingParams
    from rlax_tpu.models import Transformer

    model = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4)
    inference = InferenceConfig(
        max_decode_slots=2,
        page_size=4,
        kv_cache_bytes=2**20,
        prefill_buckets=(16,),
        max_prompt_len=16,
        max_new_tokens=6,
    )
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=jax.devices()[:2])
    directory = tmp_path / "compiled"
    compiling = Engine(model, inference, seed=0, mesh=mesh)
    for key in compiling.lowerings():
        lowered = compiling.lower(key)
        compiled = executables.compile_to_save(lowered)
        executables.save(directory, key, lowered, compiled, mesh, config_digest="test")

    saved = Engine(model, inference, seed=0, mesh=mesh)
    assert sorted(saved.use_saved_executables(str(directory))) == sorted(compiling.lowerings())
    from flax import nnx

    params = nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(4)), nnx.Param))
    rng = np.random.default_rng(0)
    requests = [
        GenerationRequest(
            f"r{i}",
            f"p{i}",
            0,
            tuple(int(t) for t in rng.integers(0, 128, 5 + 3 * i)),
            SamplingParams(temperature=1.0 if i % 2 else 0.0, max_new_tokens=6),
        )
        for i in range(3)
    ]
    results = {}
    for name, engine in (("saved", saved), ("compiling", compiling)):
        engine.load(0, params)
        results[name] = [(r.tokens, r.logprobs) for r in engine.run(requests)]
    assert results["saved"] == results["compiling"]  # the same programs, the same machine
    programs = saved.saved_programs
    assert programs["prefill@16"].calls > 0 and programs["decode@2"].calls > 0

    other = build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    with pytest.raises(executables.CompiledMismatchError, match="mesh"):
        Engine(model, inference, seed=0, mesh=other).use_saved_executables(str(directory))
