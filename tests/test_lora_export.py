"""A LoRA model exported as PEFT loads it: transformers + peft compute, from the adapter
directory and its base, the logits our model computes with the adapters unmerged; the
merged export is a plain model with those logits; PEFT's own merge of the adapter is ours.
From the library (`export_peft`, `export_merged`) for the three architectures, and through
`rlax-tpu export` of a LoRA run's (scanned) checkpoint.

The adapters are drawn at random, A and B both, at a scale where they move the logits far
beyond the comparison's tolerance: a transposed, misordered or misscaled lora_A / lora_B
fails it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import VOCAB, make_hf_model, save_qwen_checkpoint
from safetensors.numpy import load_file
from trainer_helpers import ENGINE, run_config

from rlax_tpu.checkpoints import CheckpointStore
from rlax_tpu.cli import main
from rlax_tpu.config import LoraConfig, MeshConfig
from rlax_tpu.models import Transformer, lora, stack_layers
from rlax_tpu.models.export import export_merged, export_peft
from rlax_tpu.models.hf import build_model, load_hf_config, load_hf_params
from rlax_tpu.run_dir import CHECKPOINTS, prepare_run_dir
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer.programs import TrainerPrograms

# Every projection LoRA adapts, at a scale alpha / rank = 2 (PEFT's default would be 1).
LORA = LoraConfig(rank=4, alpha=8.0, targets=tuple(lora.TARGET_WEIGHTS))
ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 13)).astype(np.int32)


@dataclasses.dataclass
class LoraModel:
    config: object  # ModelConfig with lora
    params: dict  # per layer, adapters included
    logits: np.ndarray  # ours of TOKENS: float32[2, 13, vocab]
    base_logits: np.ndarray  # ours without the adapters


def _lora_model(source: str, seed: int) -> LoraModel:
    """The checkpoint at `source` as the base of LoRA adapters drawn at random."""
    config = load_hf_config(source, lora=LORA)
    base = load_hf_params(source, config)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    shapes = lora.split(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))[0]
    rng = np.random.default_rng(seed)
    adapters = jax.tree.map(lambda x: rng.normal(0, 0.1, x.shape).astype(x.dtype), shapes)
    params = lora.combine(base, adapters)
    identity = lora.combine(base, jax.tree.map(np.zeros_like, adapters))  # B = 0: the base
    logits, base_logits = (
        np.asarray(_logits(build_model(config, p, rngs=nnx.Rngs(0)), jnp.asarray(TOKENS)))
        for p in (params, identity)
    )
    return LoraModel(config, params, logits, base_logits)


@nnx.jit
def _logits(model, tokens):
    return model.forward_train(tokens, tokens, return_logits=True).logits


@torch.no_grad()
def _hf_logits(model, tokens: np.ndarray = TOKENS) -> np.ndarray:
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _hf_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()


def _assert_same_logits(hf: np.ndarray, ours: LoraModel) -> None:
    # Logits of magnitude ~10 from two float32 implementations: 1e-4 is their reduction-order
    # noise (tests/test_hf_parity.py). The adapters move them by far more:
    assert np.abs(ours.logits - ours.base_logits).max() > 0.1
    np.testing.assert_allclose(hf, ours.logits, rtol=0, atol=1e-4)


# -- the library --------------------------------------------------------------------------------
# Llama 3 (untied, RoPE scaling) and Qwen3 (head_dim != hidden / heads: o_proj's input and
# q/k/v's outputs are heads x head_dim); Qwen2 (q/k/v biases) is the run's below.
@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def model(request, tmp_path_factory) -> LoraModel:
    source = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(source)
    return _lora_model(str(source), seed=1)


def test_peft_loads_the_adapter_on_its_base_with_our_logits(model, tmp_path):
    out = tmp_path / "adapter"
    written = export_peft(model.params, model.config, str(out), tokenizer_dir=None)
    assert written[-1] == str(out / "adapter_config.json")  # last: the export is complete
    config = peft.PeftConfig.from_pretrained(out)
    assert (config.peft_type, config.task_type) == ("LORA", "CAUSAL_LM")
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.0)
    assert set(config.target_modules) == set(LORA.targets)
    assert config.base_model_name_or_path == str(out / "base")
    hf = peft.PeftModel.from_pretrained(_hf_model(out / "base"), out).eval()
    _assert_same_logits(_hf_logits(hf), model)


def test_the_merged_export_is_a_plain_model_with_our_logits_and_pefts_merge(model, tmp_path):
    out = tmp_path / "model"
    export_peft(model.params, model.config, str(out), tokenizer_dir=None)
    theirs = peft.PeftModel.from_pretrained(_hf_model(out / "base"), out).merge_and_unload()
    # Merged over the adapter export: its adapter files go (else transformers applies them).
    export_merged(model.params, model.config, str(out), tokenizer_dir=None)
    assert not (out / "adapter_config.json").exists()
    assert not (out / "adapter_model.safetensors").exists()
    _assert_same_logits(_hf_logits(_hf_model(out)), model)
    # PEFT folds its B @ A · alpha / r into the torch weights: ours, tensor by tensor.
    ours = load_file(out / "model.safetensors")
    their_weights = theirs.state_dict()
    assert ours.keys() <= their_weights.keys()
    for name, x in ours.items():
        np.testing.assert_allclose(their_weights[name].numpy(), x, rtol=0, atol=1e-6, err_msg=name)


# -- rlax-tpu export of a LoRA run --------------------------------------------------------------
@dataclasses.dataclass
class Run:
    run_dir: Path
    model: LoraModel


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """A LoRA run on a Qwen2 checkpoint (with its tokenizer) whose trainer scans stacked
    layers, with one RL checkpoint of random adapters, laid out as Trainer.save writes it
    (Trainer._abstract_state): the whole params tree, the adapters' optimizer state and the
    reference policy's adapters."""
    source = save_qwen_checkpoint(tmp_path_factory.mktemp("qwen2"))
    model = _lora_model(source, seed=2)
    run_dir = tmp_path_factory.mktemp("run") / "run"
    config = run_config(
        str(run_dir), model=model.config, mesh=ONE_DEVICE, inference=ENGINE, scan_layers=True
    )
    prepare_run_dir(config)
    programs = TrainerPrograms(config, build_mesh(ONE_DEVICE, devices=jax.devices()[:1]))
    params = jax.device_put(stack_layers(model.params), programs.param_shardings)
    state = {"params": params, "opt_state": programs.init_opt(params)}
    assert programs.objective.needs_reference_logprobs  # GRPO with a KL penalty
    state["reference"] = programs.split_trainable(params)[0]
    store = CheckpointStore(str(run_dir / CHECKPOINTS), max_to_keep=2, async_saves=False)
    store.save(1, state, {"step": 1}, wait=True)
    store.close()
    return Run(run_dir, model)


def test_export_of_a_lora_run_is_a_peft_adapter_that_names_its_base(run, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["export", str(run.run_dir), str(out)]) == 0
    assert "as a PEFT adapter (LoRA rank 4)" in capsys.readouterr().out
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        assert (out / name).exists(), name
    assert (out / "base" / "config.json").exists() and not (out / "config.json").exists()
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(out / "base")
    # PEFT's loader reads the base from adapter_config.json.
    hf = peft.AutoPeftModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    _assert_same_logits(_hf_logits(hf), run.model)
    assert transformers.AutoTokenizer.from_pretrained(out).vocab_size > 0


def test_merged_export_of_a_lora_run_is_a_plain_model(run, tmp_path):
    out = tmp_path / "merged"
    assert main(["export", str(run.run_dir), str(out), "--merged"]) == 0
    assert not (out / "adapter_config.json").exists()
    _assert_same_logits(_hf_logits(_hf_model(out)), run.model)


def test_merged_is_refused_for_a_run_without_lora(run, tmp_path, capsys):
    config = json.loads((run.run_dir / "config.json").read_text())
    config["model"]["lora"] = None
    config["storage"]["run_dir"] = str(tmp_path / "plain")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    assert main(["export", str(tmp_path / "plain"), str(tmp_path / "out"), "--merged"]) == 2
    err = capsys.readouterr().err
    assert "drop --merged" in err and err.count("\n") == 1
