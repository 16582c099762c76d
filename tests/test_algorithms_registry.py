"""Open registries: a part and a preset from the user's own module, named in the config.

What registers runs in a fresh interpreter (the registries are process-wide, and the rest of
the suite checks the built-in names), the way a trainer process reads its run's config."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlax_tpu.config import AlgorithmConfig, ConfigError, RunConfig

PLUGIN = textwrap.dedent(
    """
    import jax.numpy as jnp
    from rlax_tpu.algorithms import register_part, register_preset
    from rlax_tpu.algorithms.parts import per_token

    @register_part("advantage", "best_of_group", formula="A_i = r_i − max_g r",
                   source="a test plugin")
    def best_of_group(p, c):
        best = jnp.full_like(p.rewards, -jnp.inf).at[p.group_ids].max(
            jnp.where(p.valid, p.rewards, -jnp.inf))
        return per_token(jnp.where(p.valid, p.rewards - best[p.group_ids], 0.0), p.mask)

    @register_part("kl_estimator", "k_quartic", formula="d⁴", source="a test plugin")
    def k_quartic(d):
        return d ** 4

    register_preset("reinforce_best", base="reinforce", advantage="best_of_group")
    """
)

# Runs in the fresh interpreter: the config as the trainer reads it (from its JSON dict),
# the objective built from it, and the same loss computed by hand from the plugin's formula.
CHECK = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from rlax_tpu.config import RunConfig
    from rlax_tpu.algorithms import RolloutBatch, build_objective, ADVANTAGES, describe
    from rlax_tpu.config import AlgorithmConfig

    config = RunConfig.from_dict(json.loads(sys.argv[1]))  # validation imports the plugin
    algorithm = config.trainer.algorithm
    rng = np.random.default_rng(0)
    B, S = 6, 5
    mask = np.zeros((B, S), bool)
    for i, n in enumerate([3, 2, 4, 1, 5, 2]):
        mask[i, :n] = True
    rewards = rng.normal(size=B)
    group_ids = np.array([0, 0, 0, 3, 3, 3])
    lp = np.where(mask, -rng.uniform(0.1, 2, (B, S)), 0.0)
    batch = RolloutBatch(
        tokens=jnp.zeros((B, S), jnp.int32), response_mask=jnp.asarray(mask),
        group_ids=jnp.asarray(group_ids, jnp.int32), rewards=jnp.asarray(rewards, jnp.float32),
        behaviour_logprobs=jnp.asarray(lp, jnp.float32), versions=jnp.zeros(B, jnp.int32),
        reference_logprobs=jnp.asarray(lp - 0.1, jnp.float32))
    loss, _ = build_objective(algorithm)(batch, jnp.asarray(lp, jnp.float32), step=0)
    best = np.array([rewards[group_ids == g].max() for g in group_ids])
    # REINFORCE's form: J = 1/B Σ_i A_i Σ_t log π; the plugin's A_i = r_i − max_g r.
    expected = -np.sum((rewards - best)[:, None] * lp * mask) / B
    kl = AlgorithmConfig(name="grpo", kl_estimator="k_quartic", plugins=algorithm.plugins)
    print(json.dumps({
        "loss": float(loss), "expected": float(expected),
        "registered": "best_of_group" in ADVANTAGES,
        "describe": describe(algorithm),
        "kl_describe": describe(kl),
    }))
    """
)


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_parts.py"
    path.write_text(PLUGIN)
    return path


def test_a_part_and_a_preset_of_ones_own_train_through_the_config(plugin, tmp_path):
    base = RunConfig().to_dict()
    base["trainer"]["algorithm"] = {"name": "reinforce_best", "plugins": [str(plugin)]}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(base)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["registered"]
    assert result["describe"].startswith("reinforce_best: w=sequence_sum ρ=one A=best_of_group")
    assert "k_quartic" in result["kl_describe"]
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-5)
    assert abs(result["expected"]) > 1e-3  # the check can tell the plugin's A from A = 0


def test_an_unregistered_name_says_where_to_register_it():
    with pytest.raises(ConfigError, match="trainer.algorithm.plugins"):
        AlgorithmConfig(name="reinforce_best")
    with pytest.raises(ConfigError, match="unknown advantage 'best_of_group'"):
        AlgorithmConfig(name="grpo", advantage="best_of_group")


def test_a_plugin_that_does_not_import_names_the_field_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"plugins.*no file") as info:
        AlgorithmConfig(plugins=(str(tmp_path / "absent.py"),))
    assert "absent.py" in str(info.value)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('half-written plugin')\n")
    with pytest.raises(ConfigError, match="RuntimeError: half-written plugin"):
        AlgorithmConfig(plugins=(str(broken),))


def test_a_taken_name_and_a_bad_preset_are_refused(tmp_path):
    code = textwrap.dedent(
        """
        from rlax_tpu.algorithms import register_part, register_preset, RegistrationError
        def refused(call):
            try:
                call()
            except RegistrationError as e:
                print(e)
            else:
                raise SystemExit("not refused")
        refused(lambda: register_part("advantage", "gae", formula="", source="")(lambda p, c: 0))
        refused(lambda: register_part("gradient_mask", "clip2", formula="", source=""))
        refused(lambda: register_part("value", "x", formula="", source=""))
        refused(lambda: register_preset("grpo"))
        refused(lambda: register_preset("mine", base="grpo", clip_eps_low=2.0))
        refused(lambda: register_preset("mine", base="grpo", no_such_field=1))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6
    assert "registered already" in lines[0]
    assert "token_* or sequence_*" in lines[1]
    assert "the kinds are" in lines[2]
    assert "exists already" in lines[3]
    assert "clip.eps_low" in lines[4]  # an old flat name still reaches its field
    assert "no_such_field" in lines[5]


ROOT = Path(__file__).resolve().parents[1]


def docs_plugin_example() -> tuple[str, list[str]]:
    """docs/algorithms.md, "Parts and presets of your own": the plugin file (its first
    python block, `# my_parts.py`) and the `rlax-tpu run` command after it, as argv."""
    text = (ROOT / "docs" / "algorithms.md").read_text()
    section = text.split("## Parts and presets of your own", 1)[1].split("\n## ", 1)[0]
    plugin = re.search(r"```python\n(# my_parts\.py\n.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return plugin, shlex.split(command.replace("\\\n", " "))


def test_the_docs_plugin_preset_selected_as_the_section_reaches_the_dumped_config(tmp_path):
    # `--set trainer.algorithm=<a plugin's preset>` once failed with a config error (issue
    # 38); the run must also keep the plugin, or no other process could read its config.
    plugin, argv = docs_plugin_example()
    assert argv[:3] == ["rlax-tpu", "run", "configs/tiny_cpu.py"], argv
    assert "trainer.algorithm=reinforce_best" in argv, argv
    (tmp_path / "my_parts.py").write_text(plugin)  # the docs' relative path, from cwd
    config = str(ROOT / argv[2])
    show = [sys.executable, "-m", "rlax_tpu", "config", "show", config, *argv[3:]]
    out = subprocess.run(
        [*show, "--format", "json"], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    dumped = json.loads(out.stdout)
    assert dumped["trainer"]["algorithm"]["name"] == "reinforce_best"
    assert dumped["trainer"]["algorithm"]["plugins"] == ["my_parts.py"]
    # Another process reads the dump as the trainer does: the plugin comes with it.
    read = "import json, sys; from rlax_tpu.config import RunConfig; " + (
        "print(RunConfig.from_dict(json.loads(sys.argv[1])).trainer.algorithm.resolved().advantage)"
    )
    again = subprocess.run(
        [sys.executable, "-c", read, out.stdout], capture_output=True, text=True, cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split()[-1] == "best_of_group"


def test_a_plugin_preset_named_before_its_plugin_says_to_set_the_plugin_first():
    with pytest.raises(ConfigError, match="set the plugins first") as info:
        RunConfig().apply_overrides(["trainer.algorithm=reinforce_best"])
    assert info.value.field == "trainer.algorithm.name"
