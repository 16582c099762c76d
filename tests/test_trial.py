"""`rlax-tpu run RECIPE --trial` (rlax_tpu/cli/trial.py): a recipe sized for a CPU, keeping
its model, data and algorithm; what --set chose stays; every change is said."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlax_tpu.cli.trial import memory_note, trial
from rlax_tpu.config import load_config
from rlax_tpu.inference.capacity import kv_capacity

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.py")))
def test_every_recipe_keeps_its_model_data_and_algorithm_and_fits_a_cpu(recipe):
    config = load_config(str(CONFIGS / recipe), resolve=False)
    tried, changes = trial(config)
    assert tried.model.to_dict() == load_config(str(CONFIGS / recipe)).model.to_dict()
    assert tried.data == config.data and tried.trainer.algorithm == config.trainer.algorithm
    assert tried.staleness == config.staleness
    assert not tried.trainer.gpu and not tried.inference.gpu
    assert not tried.trainer.mesh.topology and not tried.inference.mesh.topology
    assert tried.inference.num_workers == 1 and tried.controller.num_steps <= 3
    assert tried.storage.run_dir.endswith("_trial") and "://" not in tried.storage.run_dir
    # The pool holds every slot's longest sequence at once: nothing waits or swaps.
    capacity = kv_capacity(tried.model, tried.inference)
    assert capacity.concurrent_sequences_reserved == tried.inference.max_decode_slots
    # Each change is one line naming the field, its old and its new value.
    changed = {line.split(":")[0] for line in changes}
    assert "storage.run_dir" in changed and "controller.num_steps" in changed
    assert all(" -> " in line for line in changes)


def test_what_set_chose_is_kept():
    overrides = ["controller.num_steps=7", "controller.eval_size=20"]
    config = load_config(str(CONFIGS / "tiny_cpu.py"), overrides, resolve=False)
    tried, changes = trial(config, ["controller.num_steps", "controller.eval_size"])
    assert tried.controller.num_steps == 7 and tried.controller.eval_size == 20
    changed = {line.split(":")[0] for line in changes}
    assert not changed & {"controller.num_steps", "controller.eval_size"}
    assert tried.controller.prompts_per_batch == 2  # the rest is still sized for the CPU


def test_a_model_larger_than_the_host_is_said_before_it_runs():
    config, _ = trial(load_config(str(CONFIGS / "llama3_1_8b_tpu_v6e_16.py"), resolve=False))
    note = memory_note(config, host_bytes=24 * 2**30)
    assert "8.0B parameters" in note and "model.num_layers=2" in note
    small, _ = trial(load_config(str(CONFIGS / "tiny_cpu.py"), resolve=False))
    assert memory_note(small, host_bytes=24 * 2**30) == ""
