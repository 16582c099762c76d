"""A Hugging Face checkpoint's config.json as model config fields, without JAX.

`model.hf_checkpoint` alone names a model: `resolve_checkpoint_model` fills every
architecture field of `ModelConfig` from the checkpoint's config.json when a config is
loaded. A field the config sets to something else is a conflict, named with both values,
for the fields that shape the weights (a checkpoint of 24 layers cannot be loaded as 2);
the others (RoPE, norm epsilon, context length) may be overridden.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from rlax_tpu import storage
from rlax_tpu.config.base import ConfigError
from rlax_tpu.config.run import ModelConfig, RopeScalingConfig, RunConfig

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # the shards of a larger checkpoint
WEIGHT_FILES = (SAFETENSORS_FILE, INDEX_FILE)
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class CheckpointError(ValueError):
    """A Hugging Face checkpoint cannot be read (or written) as this model."""


class UnsupportedCheckpointError(CheckpointError):
    """config.json describes a model this package does not implement (architecture, RoPE
    type, sliding window, extra biases); the message names the setting."""


class CheckpointMismatchError(CheckpointError):
    """A tensor is missing, unexpected, or of the wrong shape or dtype; the message names
    the tensor, the expected and found shape and the file."""


# -- config ---------------------------------------------------------------------------------


def load_hf_config(path: str, **overrides: Any) -> ModelConfig:
    """ModelConfig of the HF checkpoint directory `path` (local or gs://), from config.json.

    `overrides` replace fields of the result (e.g. param_dtype="float32", value_head=True);
    hf_checkpoint is set to `path`. See `config_from_hf_dict` for the mapping.
    """
    url = storage.join(path, CONFIG_FILE)
    if not storage.exists(url):
        raise CheckpointError(f"{url} does not exist: {path} is not a Hugging Face checkpoint")
    try:
        hf = json.loads(storage.read_text(url))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{url} is not valid JSON: {e}") from None
    return config_from_hf_dict(hf, source=url, **{"hf_checkpoint": path, **overrides})


def config_from_hf_dict(
    hf: Mapping[str, Any], *, source: str = "config.json", **overrides: Any
) -> ModelConfig:
    """ModelConfig for a parsed HF config.json (transformers v4 or v5 layout).

    param_dtype follows the checkpoint's dtype (float16 loads as float32, which holds it
    exactly); the compute dtype keeps ModelConfig's default. Raises
    UnsupportedCheckpointError naming the setting this package cannot run.
    """
    fields = _fields_from_hf(hf, source)
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except TypeError as e:  # an override that is no ModelConfig field
        raise ConfigError(f"bad override for ModelConfig: {e}") from None


def _fields_from_hf(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    def unsupported(detail: str) -> UnsupportedCheckpointError:
        return UnsupportedCheckpointError(f"{source}: {detail}")

    architectures = hf.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in MODEL_TYPES:
        raise unsupported(
            f"architecture {arch!r} is not supported; supported: {', '.join(MODEL_TYPES)}"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise unsupported(f"hidden_act {act!r} is not supported (only 'silu', SwiGLU MLP)")
    if hf.get("mlp_bias"):
        raise unsupported("mlp_bias: true is not supported (the MLP has no biases)")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise unsupported(
            "sliding-window attention (use_sliding_window: true) is not supported; "
            "only full causal attention is implemented"
        )
    if arch == "Qwen2ForCausalLM":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no output bias
    elif hf.get("attention_bias"):
        raise unsupported(
            f"attention_bias: true on {arch} adds an o_proj bias, which the model does not "
            "have; only Qwen2's q/k/v-only bias is supported"
        )
    else:
        qkv_bias = False
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise unsupported(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported")

    def required(name: str) -> int:
        if hf.get(name) is None:
            raise CheckpointError(f"{source}: required field {name!r} is missing")
        return int(hf[name])

    num_heads = required("num_attention_heads")
    hidden = required("hidden_size")
    head_dim = hf.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope_from_hf(hf, unsupported)
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=required("intermediate_size"),
        num_layers=required("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
    )
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise unsupported(f"dtype {dtype!r} is not supported (float32, bfloat16, float16)")
    fields["param_dtype"] = "bfloat16" if dtype == "bfloat16" else "float32"
    return fields


def _rope_from_hf(hf: Mapping[str, Any], unsupported: Callable[[str], Exception]):
    """(rope_theta, RopeScalingConfig | None) from v5 `rope_parameters` or v4 `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_type" not in params and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type layout
    if isinstance(params, Mapping):  # transformers v5
        spec, theta = params, params.get("rope_theta", hf.get("rope_theta"))
    else:  # v4: rope_theta at the top, rope_scaling null or a dict
        spec, theta = hf.get("rope_scaling") or {}, hf.get("rope_theta")
    theta = 10000.0 if theta is None else theta
    rope_type = spec.get("rope_type", spec.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(spec["factor"]))
    if rope_type == "llama3":
        return theta, RopeScalingConfig(
            type="llama3",
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    raise unsupported(
        f"RoPE type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


# -- a run's model from its checkpoint ------------------------------------------------------

# Fields that decide the weights' shapes and names: the config must agree with the checkpoint.
SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
)
# Fields a config may set to other values than the checkpoint's (a shorter context, another
# RoPE base): the config's value, where it is not the default, wins.
OVERRIDABLE_FIELDS = ("rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings")


def resolve_checkpoint_model(config: RunConfig, *, strict: bool = False) -> RunConfig:
    """`config` with the architecture of `model.hf_checkpoint` filled in (the identity when
    it names no checkpoint). A field left at ModelConfig's default takes the checkpoint's
    value; a shape field set to another value is a ConfigError naming every conflict;
    an overridable field keeps the config's value. Idempotent. param_dtype and dtype stay
    the config's: training precision is the run's choice, not the checkpoint's.

    A config that spells its architecture out (`relies_on_checkpoint` false) is left as
    written unless `strict`: a pod config compiles and deploys from a laptop that cannot
    read its gs:// checkpoint, with no storage call at all. The commands that load the
    weights resolve strictly, so they stop here, before any component starts, with a
    message naming the path or the conflicting fields."""
    model = config.model
    if not model.hf_checkpoint:
        return config
    if not strict and not relies_on_checkpoint(model):
        return config  # spelled out: checked against the checkpoint where a run reads it
    try:
        found = load_hf_config(model.hf_checkpoint)
    except CheckpointError as e:
        raise ConfigError(
            f"{e}. Point model.hf_checkpoint at a Hugging Face checkpoint directory (config.json "
            "and *.safetensors, e.g. from `huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct "
            "--local-dir DIR`; local, file:// or gs://)",
            field="model.hf_checkpoint",
        ) from None
    default = ModelConfig()
    fields = {
        name: getattr(found, name)
        for name in (*SHAPE_FIELDS, *OVERRIDABLE_FIELDS)
        if getattr(model, name) == getattr(default, name)
        and getattr(model, name) != getattr(found, name)
    }
    check_shapes(dataclasses.replace(model, **fields), found)
    if strict:
        _require_weights(model.hf_checkpoint)
    if not fields:
        return config
    try:
        model = dataclasses.replace(model, **fields)
        return dataclasses.replace(config, model=model)
    except ConfigError as e:
        raise ConfigError(
            f"with the architecture of {model.hf_checkpoint} filled in: {e.detail}",
            field=e.field,
        ) from None


def check_shapes(model: ModelConfig, found: ModelConfig) -> None:
    """ConfigError naming every SHAPE_FIELDS field on which `model` disagrees with `found`,
    the model of its checkpoint: the checkpoint's weights have the checkpoint's shapes."""
    conflicts = [
        f"model.{name}={getattr(model, name)!r} (the checkpoint has {getattr(found, name)!r})"
        for name in SHAPE_FIELDS
        if getattr(model, name) != getattr(found, name)
    ]
    if conflicts:
        raise ConfigError(
            f"the config disagrees with the checkpoint {model.hf_checkpoint}/{CONFIG_FILE} on "
            f"{', '.join(conflicts)}: the checkpoint's weights have its shapes. Leave these "
            "fields out of the config (model.hf_checkpoint fills them) or point "
            "model.hf_checkpoint at the checkpoint you meant",
            field="model.hf_checkpoint",
        )


def relies_on_checkpoint(model: ModelConfig) -> bool:
    """Whether `model` takes its architecture from its checkpoint: it names one and leaves
    the sizes (vocabulary, width, depth) at their defaults. Such a config cannot be sized or
    compiled where the checkpoint's config.json cannot be read."""
    default = ModelConfig()
    sizes = ("vocab_size", "hidden_size", "num_layers")
    return bool(model.hf_checkpoint) and all(
        getattr(model, f) == getattr(default, f) for f in sizes
    )


def _require_weights(path: str) -> None:
    if not any(storage.exists(storage.join(path, f)) for f in WEIGHT_FILES):
        raise ConfigError(
            f"{path} has a config.json but no weights ({' or '.join(WEIGHT_FILES)}): download "
            "the checkpoint's safetensors there (e.g. `huggingface-cli download "
            "Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`) and --set model.hf_checkpoint=DIR",
            field="model.hf_checkpoint",
        )
