"""`rlax-tpu export`: a run's checkpoint as a Hugging Face model directory that transformers
loads with the trainer's logits, the source's tokenizer and chat template, and its stop
tokens; half-written checkpoints are passed over; a run with nothing to export says so.

The run is a tiny Qwen2 checkpoint (tests/hf_fixtures.py) with a byte-level BPE tokenizer
and Qwen's chat template, trained one RL step by a Trainer in this process, with and
without scanned layers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import VOCAB, make_hf_model
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer
from trainer_helpers import ENGINE, rollout_batch, run_config

from rlax_tpu import storage
from rlax_tpu.checkpoints import COMMIT_MARKER
from rlax_tpu.cli import main
from rlax_tpu.config import MeshConfig
from rlax_tpu.data.char_tokenizer import write_char_tokenizer
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.models.export import export_hf, generation_config
from rlax_tpu.models.hf import build_model, load_hf_config, load_hf_params
from rlax_tpu.run_dir import prepare_run_dir
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5-Instruct's generation settings: sampling, and two stop tokens.
SOURCE_GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
TEXT = "What is 12 + 30? The answer is 42."
MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]


# Qwen2's pre-tokenizer split: transformers (v5) rebuilds a Qwen2 tokenizer around its own
# vocabulary and merges with this pipeline, whatever tokenizer.json says, as for real Qwen.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _tokenizer(path: Path) -> None:
    """A byte-level BPE of at most VOCAB ids with Qwen's pipeline, special tokens and chat
    template."""
    backend = BackendTokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([TEXT, "The quick brown fox jumps over the lazy dog."] * 4, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_TEMPLATE,
    )
    hf.save_pretrained(path, save_jinja_files=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A Hugging Face Qwen2 directory: weights, tokenizer, chat template, generation config."""
    path = tmp_path_factory.mktemp("qwen2")
    make_hf_model("Qwen2ForCausalLM").save_pretrained(path)
    _tokenizer(path)
    endoftext, im_end = (Tokenizer.load(str(path)).token_to_id(t) for t in SPECIALS[::2])
    generation = {
        "bos_token_id": endoftext,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        **SOURCE_GENERATION,
    }
    (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def _one_device_mesh():
    return build_mesh(ONE_DEVICE, devices=jax.devices()[:1])


def _host(params) -> dict:
    return jax.tree.map(np.asarray, params)


@dataclasses.dataclass
class Run:
    config: object
    run_dir: Path
    params: dict[int, dict]  # checkpoint step -> its params (per layer, numpy)


@pytest.fixture(scope="module", params=[False, True], ids=["layers", "scan_layers"])
def run(request, source, tmp_path_factory) -> Run:
    """A run directory with RL checkpoints of steps 0 (the source weights) and 1 (one step
    of GRPO on them)."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    config = run_config(
        str(run_dir),
        model=load_hf_config(source),
        mesh=ONE_DEVICE,
        inference=ENGINE,  # prompts and responses that fit trainer.max_seq_len
        scan_layers=request.param,
        checkpoint_every=100,
    )
    prepare_run_dir(config)
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    params = {0: _host(trainer.params())}
    trainer.save(wait=True)
    trainer.train_step(0, rollout_batch(0))
    params[1] = _host(trainer.params())
    trainer.save(wait=True)
    trainer.close()
    return Run(config, run_dir, params)


def _export(*args: str) -> int:
    return main(["export", *map(str, args)])


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "model"
    assert _export(run.run_dir, out) == 0
    return out


def _assert_same_params(out: Path, config, expected: dict) -> None:
    got = load_hf_params(str(out), config.model)
    leaves, tree = jax.tree.flatten(got)
    want, want_tree = jax.tree.flatten(expected)
    assert tree == want_tree
    for x, y in zip(leaves, want, strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@nnx.jit
def _logits(model, tokens):
    return model.forward_train(tokens, tokens, return_logits=True).logits


@torch.no_grad()
def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


# -- the export ---------------------------------------------------------------------------------
def test_export_writes_the_newest_checkpoints_weights(run, exported, capsys):
    _assert_same_params(exported, run.config, run.params[1])


def test_transformers_runs_the_export_with_the_trainers_logits(run, source, exported):
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 19)).astype(np.int32)
    model = build_model(run.config.model, run.params[1], rngs=nnx.Rngs(0))
    ours = np.asarray(_logits(model, jnp.asarray(tokens)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    # Logits of magnitude ~10 from two float32 implementations: 1e-4 is their reduction-order
    # noise (tests/test_hf_parity.py); the weights themselves are compared bit for bit above.
    np.testing.assert_allclose(_hf_logits(hf, tokens), ours, rtol=0, atol=1e-4)
    # The trained step is what was exported: the source model's logits are elsewhere.
    before = transformers.AutoModelForCausalLM.from_pretrained(
        source, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert np.abs(_hf_logits(before, tokens) - ours).max() > 1e-2


def test_the_export_carries_the_sources_tokenizer_and_chat_template(source, exported):
    ours = Tokenizer.load(source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer(TEXT)["input_ids"] == ours.encode(TEXT)
    assert len(tokenizer) == ours.vocab_size
    assert (exported / "chat_template.jinja").exists()
    assert tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    ) == ours.apply_chat_template(MESSAGES)


def test_generation_config_stops_on_every_eos_and_keeps_the_sources_settings(source, exported):
    ours = Tokenizer.load(source)
    endoftext, im_end = (ours.token_to_id(t) for t in SPECIALS[::2])
    generation = transformers.GenerationConfig.from_pretrained(exported)
    assert generation.eos_token_id == [im_end, endoftext]
    assert (generation.pad_token_id, generation.bos_token_id) == (endoftext, endoftext)
    for key, value in SOURCE_GENERATION.items():
        assert getattr(generation, key) == value, key


def test_step_and_checkpoint_directory_pick_an_older_checkpoint(run, tmp_path, capsys):
    assert _export(run.run_dir, tmp_path / "by_step", "--step", "0") == 0
    assert "RL checkpoint of step 0" in capsys.readouterr().out
    _assert_same_params(tmp_path / "by_step", run.config, run.params[0])
    assert _export(run.run_dir / "checkpoints" / "0", tmp_path / "by_dir") == 0
    _assert_same_params(tmp_path / "by_dir", run.config, run.params[0])


def _embedding_chunk(step_dir: Path) -> Path:
    """The data of the checkpoint's embedding matrix (a zarr chunk: a missing one would read
    back as zeros, were the arrays not checked against their checksums)."""
    (chunk,) = (p for p in (step_dir / "state" / "params.embed").iterdir() if p.name[0] != ".")
    return chunk


@pytest.mark.parametrize("damage", ["unfinished", "missing_array"])
def test_a_half_written_newest_checkpoint_is_passed_over(run, tmp_path, damage, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(run.run_dir, run_dir)
    step_dir = run_dir / "checkpoints" / "1"
    if damage == "unfinished":
        (step_dir / COMMIT_MARKER).unlink()
    else:
        _embedding_chunk(step_dir).unlink()
    assert _export(run_dir, tmp_path / "model") == 0
    assert "RL checkpoint of step 0" in capsys.readouterr().out
    _assert_same_params(tmp_path / "model", run.config, run.params[0])
    # Asked for by name, it is refused rather than exported.
    assert _export(step_dir, tmp_path / "named") == 2
    assert "nothing to export" in capsys.readouterr().err
    assert not (tmp_path / "named" / "config.json").exists()


# -- nothing to export -------------------------------------------------------------------------
def test_a_run_without_checkpoints_has_nothing_to_export(run, tmp_path, capsys):
    run_dir = tmp_path / "fresh"
    prepare_run_dir(
        dataclasses.replace(
            run.config, storage=dataclasses.replace(run.config.storage, run_dir=str(run_dir))
        )
    )
    assert _export(run_dir, tmp_path / "model") == 2
    err = capsys.readouterr().err
    assert err.startswith("rlax-tpu export: nothing to export") and err.count("\n") == 1
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("missing", "does not exist"),
        ("no_run", "neither a run directory nor a checkpoint"),
        ("inside", "is not a checkpoint"),
    ],
)
def test_a_path_that_is_no_run_or_checkpoint_is_one_line_and_exit_2(
    run, tmp_path, capsys, where, message
):
    path = {
        "missing": tmp_path / "missing",
        "no_run": tmp_path,
        "inside": run.run_dir / "config.txt",
    }[where]
    assert _export(path, tmp_path / "model") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# -- the SFT warm start -----------------------------------------------------------------------
def test_a_run_with_only_a_warm_start_exports_it(source, tmp_path, capsys):
    config = run_config(
        str(tmp_path / "run"), model=load_hf_config(source), mesh=ONE_DEVICE, inference=ENGINE
    )
    config = config.override("trainer.warm_start.steps", 1)
    prepare_run_dir(config)
    trainer = Trainer(config, mesh=_one_device_mesh())
    trainer.initialize()
    batch = rollout_batch(0)
    tokens = np.asarray(batch.tokens)
    trainer.sft_step(0, tokens, np.roll(tokens, -1, axis=1), np.asarray(batch.response_mask))
    trained = _host(trainer.params())
    trainer.close()

    assert _export(tmp_path / "run", tmp_path / "model") == 0
    assert "SFT warm-start checkpoint at step 1" in capsys.readouterr().out
    _assert_same_params(tmp_path / "model", config, trained)


def test_sft_model_of_the_warm_start_carries_the_tokenizer(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [
        "cpu_devices=8",
        "trainer.mesh.data=-1",
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_layers=1",
        "model.head_dim=16",
        "trainer.warm_start.steps=1",
        "controller.eval_dataset=",
        f"storage.run_dir={run_dir}",
    ]
    assert main(["sft", TINY, *[a for o in overrides for a in ("--set", o)]]) == 0
    capsys.readouterr()
    model_dir = run_dir / "sft_model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.load(str(run_dir / "tokenizer"))
    assert tokenizer("12 + 30 = 42")["input_ids"] == ours.encode("12 + 30 = 42")
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == (
        ours.apply_chat_template(MESSAGES)
    )
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.eos_token_id == 2


# -- generation_config.json ----------------------------------------------------------------------
def test_eos_ids_are_the_tokenizers_then_the_sources(tmp_path):
    directory = write_char_tokenizer(str(tmp_path / "tokenizer"))
    storage.write_text(
        storage.join(directory, "generation_config.json"), json.dumps({"eos_token_id": [5, 2]})
    )
    tokenizer = Tokenizer.load(directory)
    source = {"eos_token_id": 7, "top_p": 0.9, "_from_model_config": True}
    assert generation_config(tokenizer, source) == {
        "bos_token_id": 1,
        "eos_token_id": [2, 5, 7],
        "pad_token_id": 0,
        "top_p": 0.9,
    }
    assert generation_config(None, None) == {}


def test_export_hf_without_a_tokenizer_writes_weights_and_generation_config(source, tmp_path):
    config = load_hf_config(source)
    params = load_hf_params(source, config)
    written = export_hf(params, config, str(tmp_path / "m"), tokenizer_dir=None)
    names = sorted(Path(u).name for u in written)
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert written[-1].endswith("config.json")  # last: its presence means complete
