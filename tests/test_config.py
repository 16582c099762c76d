"""Config validation, overrides, round trips and the golden text of every shipped config."""

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlax_tpu.config import (
    ConfigError,
    ConfigRenamedWarning,
    MeshConfig,
    ModelConfig,
    RunConfig,
    StalenessConfig,
    TrainerConfig,
    load_config,
)
from rlax_tpu.config.base import field_descriptions
from rlax_tpu.config.run import ADDED_FIELDS, RENAMED_FIELDS

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.py"))
GOLDEN = Path(__file__).with_name("golden")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_matches_golden_text(path):
    """A changed default or recipe shows up in review as a golden diff.

    Regenerate with RLAX_TPU_UPDATE_GOLDEN=1 after an intended change.
    """
    text = load_config(str(path)).to_text()
    golden = GOLDEN / f"{path.stem}.txt"
    if os.environ.get("RLAX_TPU_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no golden file for {path.name}; run with RLAX_TPU_UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_every_golden_file_has_a_shipped_config():
    assert {p.stem for p in GOLDEN.glob("*.txt")} == {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_round_trips_through_json(path):
    config = load_config(str(path))
    again = RunConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.digest() == config.digest()


def test_override_parses_by_field_type():
    config = RunConfig().apply_overrides(
        [
            "trainer.optimizer.learning_rate=1e-5",
            "controller.num_steps=7",
            "model.tie_word_embeddings=true",
            "inference.stop_token_ids=(3, 5)",
            "trainer.mesh.logical_axis_rules=(('batch', ('data',)),)",
            "model.param_dtype=bfloat16",
        ]
    )
    assert config.trainer.optimizer.learning_rate == 1e-5
    assert config.controller.num_steps == 7
    assert config.model.tie_word_embeddings is True
    assert config.inference.stop_token_ids == (3, 5)
    assert config.trainer.mesh.logical_axis_rules == (("batch", ("data",)),)
    assert config.model.param_dtype == "bfloat16"


def test_overrides_apply_in_order_and_section_presets_replace_the_section():
    config = RunConfig().apply_overrides(
        ["staleness=off_policy", "staleness.max_staleness=20", "model.rope_scaling=llama3"]
    )
    assert (config.staleness.reload_every, config.staleness.max_staleness) == (16, 20)
    assert config.model.rope_scaling.type == "llama3"
    assert RunConfig().apply_overrides(["model.rope_scaling=none"]).model.rope_scaling is None


@pytest.mark.parametrize(
    "override, field, words",
    [
        ("trainer.optimizer.learnin_rate=1", "trainer.optimizer", "did you mean 'learning_rate'"),
        ("nosuch=1", "RunConfig", "unknown key 'nosuch'"),
        (
            "trainer.optimizer.learning_rate=fast",
            "trainer.optimizer.learning_rate",
            "cannot read 'fast' as float",
        ),
        ("controller.num_steps=1.5", "controller.num_steps", "cannot read '1.5' as int"),
        ("model.tie_word_embeddings=maybe", "model.tie_word_embeddings", "bool"),
        ("model.param_dtype=float16", "model.param_dtype", "'float32' | 'bfloat16'"),
        ("staleness=sometimes", "staleness", "presets: off_policy, on_policy"),
        ("model.rope_scaling.factor=2", "model.rope_scaling", "set model.rope_scaling to a preset"),
        ("trainer.optimizer.learning_rate=0", "trainer.optimizer.learning_rate", "must be > 0"),
        ("trainer.micro_batch_size=3", "trainer.micro_batch_size", "must divide mini_batch_size"),
        ("model.num_kv_heads=3", "model.num_kv_heads", "must divide num_heads"),
        ("trainer.mesh.fsdp=0", "trainer.mesh.fsdp", "must be >= 1 or -1"),
        ("controller.prompts_per_batch=3", "trainer.mini_batch_size", "must divide the global"),
        ("param_server.hot_versions=0", "param_server.hot_versions", "must be >= 1"),
        ("storage.run_dir=s3://bucket/x", "storage.run_dir", "use a local path, file:// or gs://"),
        (
            "controller.datasets=[{'path': 'a.jsonl', 'weight': -2}]",
            "controller.datasets[0].weight",
            "must be > 0",
        ),
        ("trainer.optimizer.learning_rate", None, "key=value"),
    ],
)
def test_bad_override_names_the_field_and_the_fix(override, field, words):
    with pytest.raises(ConfigError) as info:
        RunConfig().apply_overrides([override])
    message = str(info.value)
    if field is not None:
        assert message.startswith(f"{field}") or message.startswith(f"RunConfig.{field}"), message
    assert words in message


def test_reload_every_must_be_positive():
    with pytest.raises(ConfigError, match=r"reload_every: η must be >= 1"):
        StalenessConfig(reload_every=0, max_staleness=0)


def test_max_staleness_must_be_non_negative():
    with pytest.raises(ConfigError, match=r"max_staleness: N must be >= 0"):
        StalenessConfig(reload_every=1, max_staleness=-1)


def test_max_staleness_below_reload_every_minus_one_is_rejected_with_the_fix():
    with pytest.raises(ConfigError, match=r"set max_staleness >= 3 or lower reload_every"):
        StalenessConfig(reload_every=4, max_staleness=2)


@given(eta=st.integers(1, 64), n=st.integers(0, 128))
def test_staleness_knobs_are_valid_exactly_when_n_covers_eta(eta, n):
    if n >= eta - 1:
        assert StalenessConfig(reload_every=eta, max_staleness=n).max_staleness == n
    else:
        with pytest.raises(ConfigError):
            StalenessConfig(reload_every=eta, max_staleness=n)


def test_staleness_presets_are_the_three_paradigms():
    presets = {name: make() for name, make in StalenessConfig.PRESETS.items()}
    assert (presets["on_policy"].reload_every, presets["on_policy"].max_staleness) == (1, 0)
    one_step = presets["one_step_off_policy"]
    assert (one_step.reload_every, one_step.max_staleness) == (1, 1)
    assert presets["off_policy"].max_staleness >= presets["off_policy"].reload_every - 1
    assert {name: p.paradigm for name, p in presets.items()} == {name: name for name in presets}


def test_wrong_type_in_python_construction_is_rejected():
    with pytest.raises(ConfigError, match=r"ModelConfig.hidden_size: expected int, got '64'"):
        ModelConfig(hidden_size="64")
    with pytest.raises(ConfigError, match=r"TrainerConfig.mesh: expected a MeshConfig"):
        TrainerConfig(mesh=3)


def test_configs_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().seed = 3


def test_digest_changes_with_any_field():
    base = RunConfig()
    assert base.digest() == RunConfig().digest()
    assert base.digest() != base.apply_overrides(["trainer.optimizer.adam_eps=1e-7"]).digest()


def test_hot_versions_below_what_a_batch_may_read_is_rejected():
    # off_policy: η=16, N=32; published versions are multiples of 16, a batch reads 3.
    with pytest.raises(
        ConfigError, match=r"param_server.hot_versions: K=2 .* need K >= N // η \+ 1 = 3"
    ):
        RunConfig().apply_overrides(["staleness=off_policy", "param_server.hot_versions=2"])


def test_hot_versions_default_follows_what_is_published():
    assert RunConfig().apply_overrides(["staleness=off_policy"]).hot_versions == 32 // 16 + 2
    assert RunConfig().hot_versions == 2  # on-policy: version s and the next


@pytest.mark.parametrize(
    "sizes, devices, expected",
    [
        ((1, -1, 1), 8, {"data": 1, "fsdp": 8, "tensor": 1}),
        ((2, -1, 2), 8, {"data": 2, "fsdp": 2, "tensor": 2}),
        ((2, 2, 2), 8, {"data": 2, "fsdp": 2, "tensor": 2}),
        ((1, 1, -1), 1, {"data": 1, "fsdp": 1, "tensor": 1}),
    ],
)
def test_mesh_shape_resolves_the_rest_axis(sizes, devices, expected):
    data, fsdp, tensor = sizes
    assert MeshConfig(data=data, fsdp=fsdp, tensor=tensor).shape_for(devices) == expected


@pytest.mark.parametrize("sizes, devices", [((3, -1, 1), 8), ((2, 2, 1), 8), ((2, 2, 4), 8)])
def test_mesh_that_does_not_fit_the_devices_is_rejected(sizes, devices):
    data, fsdp, tensor = sizes
    with pytest.raises(ConfigError, match="devices"):
        MeshConfig(data=data, fsdp=fsdp, tensor=tensor).shape_for(devices)


def test_load_config_rejects_missing_file_and_file_without_get_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="no get_config"):
        load_config(str(bad))


def test_load_config_reads_a_json_dump(tmp_path):
    config = load_config(str(SHIPPED[0]), ["seed=5"])
    dump = tmp_path / "config.json"
    dump.write_text(json.dumps(config.to_dict()))
    assert load_config(str(dump)) == config


# -- multi-slice meshes ------------------------------------------------------------------------
def test_a_multi_slice_mesh_splits_its_dcn_axis_across_the_slices():
    data = MeshConfig(data=2, fsdp=-1, tensor=4, topology="v5p:2x4x4", num_slices=2)
    assert data.shape_for(64) == {"data": 2, "fsdp": 8, "tensor": 4}
    within, across = data.slice_shapes(64)
    assert within == {"data": 1, "fsdp": 8, "tensor": 4}
    assert across == {"data": 2, "fsdp": 1, "tensor": 1}
    fsdp = MeshConfig(data=1, fsdp=-1, tensor=4, num_slices=2, dcn_axis="fsdp")
    assert fsdp.slice_shapes(64) == (
        {"data": 1, "fsdp": 8, "tensor": 4},
        {"data": 1, "fsdp": 2, "tensor": 1},
    )


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        # The default data=1 cannot cross 2 slices: the message names the axis and the fix.
        ({"num_slices": 2}, "data: is 1, but data is the axis across the 2 slices"),
        ({"num_slices": 2, "dcn_axis": "fsdp", "fsdp": 3}, "set fsdp=2"),
        ({"num_slices": 0}, "num_slices: must be >= 1"),
        # 2 slices of 32 chips: data 2 × fsdp 4 × tensor 4 fills one of them.
        (
            {"data": 2, "fsdp": 4, "tensor": 4, "topology": "v5p:2x4x4", "num_slices": 2},
            "must fill its topology 2 × v5p:2x4x4 (64 chips)",
        ),
    ],
)
def test_a_multi_slice_mesh_that_cannot_span_its_slices_is_refused(fields, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        MeshConfig(**fields)


def test_a_dcn_axis_left_to_minus_one_must_come_out_a_multiple_of_the_slices():
    mesh = MeshConfig(data=-1, fsdp=2, tensor=1, num_slices=2)
    assert mesh.shape_for(8)["data"] == 4
    with pytest.raises(ConfigError, match=r"data \(dcn_axis.*multiple of num_slices=2"):
        mesh.shape_for(6)  # data 3 cannot be split over 2 slices


def test_only_the_trainer_on_tpu_spans_several_slices():
    with pytest.raises(ConfigError, match="an inference worker runs on one slice"):
        RunConfig().apply_overrides(["inference.mesh.data=2", "inference.mesh.num_slices=2"])
    with pytest.raises(ConfigError, match="set mesh.num_slices=1, or clear gpu"):
        RunConfig().apply_overrides(
            ["trainer.mesh.data=2", "trainer.mesh.num_slices=2", "trainer.gpu=h100:8"]
        )


def test_one_slice_keeps_the_digest_of_a_config_without_the_multi_slice_fields():
    base = RunConfig()
    assert "num_slices" not in base.identity()["trainer"]["mesh"]
    # dcn_axis places nothing on one slice: the same run.
    assert base.apply_overrides(["trainer.mesh.dcn_axis=fsdp"]).digest() == base.digest()
    two = base.apply_overrides(["trainer.mesh.data=2", "trainer.mesh.num_slices=2"])
    assert two.identity()["trainer"]["mesh"]["num_slices"] == 2
    assert two.digest() != base.apply_overrides(["trainer.mesh.data=2"]).digest()


@pytest.mark.parametrize("reverse", [False, True])
def test_overrides_are_validated_once_as_a_whole_so_their_order_does_not_matter(reverse):
    """Fields valid only together: each --set alone would be refused (a function verifier
    needs its reward function and a reward function needs the function verifier; a batch
    of 16 does not hold the demo's mini-batch of 64, nor 64 a mini-batch of 16)."""
    pairs = [
        ("qwen2_5_0_5b_gsm8k_gpu.py", ["data.verifier=function", "data.reward_function=m.py:f"]),
        (
            "tiny_cpu.py",
            [
                "controller.prompts_per_batch=4",
                "controller.samples_per_prompt=4",
                "trainer.mini_batch_size=16",
                "trainer.micro_batch_size=16",
            ],
        ),
    ]
    for recipe, overrides in pairs:
        path = str(ROOT / "configs" / recipe)
        config = load_config(path, overrides[::-1] if reverse else overrides)
        for item in overrides:
            key, _, value = item.partition("=")
            section, field = key.split(".")
            assert str(getattr(getattr(config, section), field)) == value
    # The whole is still validated: a batch its mini-batch does not divide is refused.
    with pytest.raises(ConfigError, match="trainer.mini_batch_size: must divide"):
        load_config(str(ROOT / "configs" / "tiny_cpu.py"), pairs[1][1][:2])


@pytest.mark.parametrize("text", ["128", "128,", "(128,)", "[128]"])
def test_a_tuple_field_reads_one_item_with_or_without_its_comma(text):
    config = load_config(
        str(ROOT / "configs" / "tiny_cpu.py"), [f"inference.prefill_buckets={text}"]
    )
    assert config.inference.prefill_buckets == (128,)


# -- moved fields (issue 39) -------------------------------------------------------------------
@pytest.mark.parametrize(
    "old, new, value",
    [
        ("controller.replay_global_cap=64", "controller.replay.global_cap", 64),
        ("controller.replay=true", "controller.replay.enabled", True),
        ("controller.dynamic_sampling=true", "controller.dynamic_sampling.enabled", True),
        ("controller.verify_deadline_s=30", "controller.verify.deadline_s", 30.0),
        ("trainer.learning_rate=3e-6", "trainer.optimizer.learning_rate", 3e-6),
        ("controller.sft_steps=7", "trainer.warm_start.steps", 7),
        ("controller.sft_learning_rate=2e-3", "trainer.warm_start.learning_rate", 2e-3),
    ],
)
def test_an_old_path_sets_its_new_field_with_a_warning_naming_it(old, new, value):
    with pytest.warns(ConfigRenamedWarning, match=re.escape(f"is now {new}")):
        config = RunConfig().apply_overrides([old])
    section = config
    for key in new.split("."):
        section = getattr(section, key)
    assert section == value
    assert config == RunConfig().apply_overrides([f"{new}={old.partition('=')[2]}"])


def test_every_old_path_names_an_existing_new_field_and_no_longer_exists():
    leaves = {key for key, _ in RunConfig().flat_items()}
    for old, new in RENAMED_FIELDS.items():
        assert new in leaves, new
        assert old not in leaves, old


def test_a_config_json_of_an_older_version_loads_as_the_same_run(tmp_path):
    """A run directory's config.json written before the fields moved (flat trainer optimizer,
    controller.sft_*, replay_*, verify_*): it loads with one warning naming the new paths,
    its values land there, and its digest is the one that older version wrote, so
    `rlax-tpu resume` accepts its checkpoints and snapshots."""
    old = GOLDEN / "tiny_cpu_config_before_issue_39.json"
    assert "learning_rate" in json.loads(old.read_text())["trainer"]
    with pytest.warns(ConfigRenamedWarning) as caught:
        config = load_config(str(old))
    assert len(caught) == 1
    assert "controller.replay_global_cap -> controller.replay.global_cap" in str(caught[0].message)
    assert config.controller.replay.enabled and config.controller.dynamic_sampling.enabled
    assert config.trainer.warm_start.steps == 3
    assert config.trainer.optimizer.warmup_steps == 2
    assert config.controller.verify.retries == 1
    # The digest that version computed for this config (`rlax-tpu config show` of it then).
    assert config.digest() == "689f5215284b6a7c66eb25ec52a11c952ec9dba26a2d03476dfce724c19bf154"
    new = RunConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert new == config


def test_a_config_setting_a_field_at_both_paths_is_refused():
    data = RunConfig().to_dict()
    data["controller"]["verify_retries"] = 5
    with pytest.raises(ConfigError, match="set twice, as controller.verify.retries"):
        RunConfig.from_dict(data)


def test_the_shipped_configs_kept_their_digests_when_the_fields_moved():
    """Moved fields enter the digest at their old paths: the same values are the same run."""
    digests = {
        "tiny_cpu": "929528180c198f61177ef508f2fcadbe7acfa81d3edf0a5f68e5db88b47cbe93",
        "qwen2_5_0_5b_gsm8k_gpu": (
            "f4639173e64da76287f31a1bae84b69964b391a12e658c014d95beb03aa62a1d"
        ),
        # A new run since issue 42: the recipe packs its training rows (tokens_per_row).
        "llama3_1_8b_tpu_v6e_16": (
            "3cd8f1f62e4ba635fd246dfaa48e74efb662e8cfce13f2035a20093bc8ce1026"
        ),
    }
    for name, digest in digests.items():
        assert load_config(str(ROOT / "configs" / f"{name}.py")).digest() == digest, name


def test_every_field_has_a_description():
    """`rlax-tpu config show --help-fields` prints a description of every field: the comment
    above or after its declaration."""
    rows = field_descriptions(RunConfig)
    missing = [path for path, _, _, text in rows if not text]
    assert missing == [], f"fields without a description comment: {missing}"
    paths = [path for path, _, _, _ in rows]
    assert "controller.replay.global_cap" in paths and "trainer.optimizer.adam_eps" in paths
    assert "controller.datasets[].reward_function" in paths


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "models").glob("*.py")), ids=str)
def test_a_model_fragment_loads_as_a_model_config(path):
    """configs/models/*.py are the models recipes compose; each is a valid ModelConfig."""
    from rlax_tpu.config import ModelConfig, load_fragment

    model = load_fragment(path, ModelConfig)
    model.validate()
    assert model.param_dtype == "float32" and model.publish_dtype == "bfloat16"


def test_load_fragment_names_what_is_wrong(tmp_path):
    from rlax_tpu.config import ConfigError, ModelConfig, TrainerConfig, load_fragment

    with pytest.raises(ConfigError, match="does not exist"):
        load_fragment(tmp_path / "absent.py", ModelConfig)
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "from rlax_tpu.config import TrainerConfig\n\n"
        "def get_config():\n    return TrainerConfig()\n"
    )
    assert isinstance(load_fragment(trainer, TrainerConfig), TrainerConfig)
    with pytest.raises(ConfigError, match="returned TrainerConfig, expected ModelConfig"):
        load_fragment(trainer, ModelConfig)


def test_a_python_config_with_a_moved_keyword_names_its_new_path(tmp_path):
    """A configs/*.py written before the sections (TrainerConfig(learning_rate=...)) fails
    with a ConfigError naming where the field went, not a bare TypeError."""
    from rlax_tpu.config import ConfigError, load_config

    old = tmp_path / "old.py"
    old.write_text(
        "from rlax_tpu.config import AlgorithmConfig, RunConfig, TrainerConfig\n\n"
        "def get_config():\n"
        "    return RunConfig(trainer=TrainerConfig(\n"
        "        algorithm=AlgorithmConfig(kl_beta=0.1)))\n"
    )
    with pytest.raises(
        ConfigError, match=r"trainer\.algorithm\.kl_beta is now trainer\.algorithm\.kl\.beta"
    ):
        load_config(str(old))
    typo = tmp_path / "typo.py"  # a keyword no section ever had stays the TypeError it is
    typo.write_text(
        "from rlax_tpu.config import RunConfig, TrainerConfig\n\n"
        "def get_config():\n    return RunConfig(trainer=TrainerConfig(learning_rat=1.0))\n"
    )
    with pytest.raises(TypeError, match="learning_rat"):
        load_config(str(typo))


def test_a_field_added_since_runs_existed_changes_no_digest_at_its_old_behaviour():
    base = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    assert "in_flight_update" not in base.identity()["inference"]
    keep = dataclasses.replace(
        base, inference=dataclasses.replace(base.inference, in_flight_update="keep")
    )
    assert keep.identity()["inference"]["in_flight_update"] == "keep"
    assert keep.digest() != base.digest()


def test_a_dataset_field_added_since_runs_existed_changes_no_digest_at_its_default():
    """sft_field is left out of every dataset section at "" (controller.datasets[] and
    data), so the shipped configs, with datasets in either place, keep their digests."""
    tiny = load_config(str(ROOT / "configs" / "tiny_cpu.py"))  # controller.datasets
    gsm8k = load_config(str(ROOT / "configs" / "qwen2_5_0_5b_gsm8k_gpu.py"))  # data
    assert tiny.digest() == "929528180c198f61177ef508f2fcadbe7acfa81d3edf0a5f68e5db88b47cbe93"
    assert gsm8k.digest() == "f4639173e64da76287f31a1bae84b69964b391a12e658c014d95beb03aa62a1d"
    assert "sft_field" not in tiny.identity()["controller"]["datasets"][0]
    (dataset,) = tiny.controller.datasets
    solved = dataclasses.replace(dataset, sft_field="solution")
    worked = dataclasses.replace(
        tiny, controller=dataclasses.replace(tiny.controller, datasets=(dataset, solved))
    )
    assert [d.get("sft_field") for d in worked.identity()["controller"]["datasets"]] == [
        None,
        "solution",
    ]
    assert worked.digest() != tiny.digest()
    assert gsm8k.override("data.sft_field", "solution").digest() != gsm8k.digest()


def test_every_dataset_section_leaves_its_added_fields_out():
    """A field added to DatasetConfig is named in ADDED_FIELDS at every path a dataset
    section has (as `config show --help-fields` writes them)."""
    paths = [p for p, _, _, _ in field_descriptions(RunConfig) if p.endswith(".sft_field")]
    assert paths == ["controller.datasets[].sft_field", "data.sft_field"]
    assert set(paths) <= set(ADDED_FIELDS)
