"""Hugging Face checkpoints in and out: config.json + safetensors <-> ModelConfig + Transformer.

Import reads `config.json` and `model.safetensors` (or the shards named by
`model.safetensors.index.json`) from a local directory or gs:// through rlax_tpu.storage
by ranged reads, and maps the torch layout ([out, in] Linear weights) onto the model's
parameter tree: whole, on the host (`load_hf_params`), or straight into a sharding on a
mesh, each process reading only the rows its devices' shards need (`load_hf_sharded`, the
trainer's start-up). Export writes the same format back, so a trained policy
loads with `transformers.AutoModelForCausalLM.from_pretrained`; export -> import is
bit-exact. Every mismatch between a checkpoint and the model raises
`CheckpointMismatchError` naming the tensor, the expected and found shapes and the file.

A LoRA model's adapters are written as a PEFT adapter (`save_peft_adapter`: its
adapter_config.json and adapter_model.safetensors), in the layout of the weights they adapt.

The optional value head is not part of the HF format: import keeps the model's own
(zero-initialised) head unless the checkpoint holds `value_head.weight` [hidden] and
`value_head.bias` [], which `save_hf(..., include_value_head=True)` writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from rlax_tpu import storage
from rlax_tpu.config import LoraConfig, ModelConfig
from rlax_tpu.config.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_TYPES,
    SAFETENSORS_FILE,
    CheckpointError,
    CheckpointMismatchError,
    UnsupportedCheckpointError,
    check_shapes,
    config_from_hf_dict,  # noqa: F401 - re-exported: the HF config mapping lives there
    load_hf_config,
)
from rlax_tpu.models.lora import TARGET_WEIGHTS
from rlax_tpu.models.transformer import Transformer, is_stacked, unstack_layers

VALUE_HEAD_WEIGHT = "value_head.weight"
VALUE_HEAD_BIAS = "value_head.bias"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


# Tensors some checkpoints carry that hold nothing the model needs (RoPE tables are
# recomputed from the config).
_HARMLESS_EXTRA = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# safetensors dtype code <-> numpy dtype. bfloat16 comes from ml_dtypes (numpy has none).
_ST_TO_NP: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")
_PARAM_NP_DTYPE = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_HF_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16"}


def config_to_hf_dict(config: ModelConfig) -> dict[str, Any]:
    """The config.json that transformers (v4 and v5) needs to rebuild `config`."""
    _check_exportable(config)
    model_type = MODEL_TYPES[config.architecture]
    dtype = _HF_DTYPE_NAMES[config.param_dtype]
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope_scaling = {"rope_type": s.type, "factor": s.factor}
        if s.type == "llama3":
            rope_scaling.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
        rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
    out: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif model_type == "qwen2":
        out.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers
        )
    else:
        out.update(
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.num_layers,
        )
    return out


def _check_exportable(config: ModelConfig) -> None:
    arch = config.architecture
    if config.qkv_bias and arch != "Qwen2ForCausalLM":
        raise UnsupportedCheckpointError(
            f"{arch} in Hugging Face has no q/k/v-only bias; qkv_bias=True needs "
            "architecture='Qwen2ForCausalLM'"
        )
    if arch == "Qwen2ForCausalLM" and not config.qkv_bias:
        raise UnsupportedCheckpointError(
            "Qwen2ForCausalLM in Hugging Face always has q/k/v biases; set qkv_bias=True"
        )
    if config.qk_norm != (arch == "Qwen3ForCausalLM"):
        raise UnsupportedCheckpointError(
            f"qk_norm={config.qk_norm} cannot be written as {arch}: Hugging Face's "
            "Qwen3ForCausalLM always has q/k norms and the other architectures never do"
        )


# -- the name map ---------------------------------------------------------------------------

# How a torch tensor maps onto a model parameter; E = hidden, H = heads, D = head_dim.
#   copy:      same layout (embeddings, norm scales)
#   linear:    [out, in] -> [in, out]
#   qkv:       [H*D, E] -> [E, H, D]
#   out_proj:  [E, H*D] -> [H, D, E]
#   head_bias: [H*D] -> [H, D]


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    name: str  # HF tensor name
    path: tuple[str | int, ...]  # path in the model's pure parameter dict
    hf_shape: tuple[int, ...]
    kind: str
    model_shape: tuple[int, ...]


def _specs(config: ModelConfig) -> list[_TensorSpec]:
    """Every HF tensor of `config`'s model, in checkpoint order."""
    c = config
    e, h, kv, d, m = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    specs: list[_TensorSpec] = []

    def add(name: str, path: tuple, kind: str, hf_shape: tuple, model_shape: tuple | None = None):
        model_shape = hf_shape if model_shape is None else model_shape
        specs.append(_TensorSpec(name, path, hf_shape, kind, model_shape))

    add("model.embed_tokens.weight", ("embed",), "copy", (c.vocab_size, e))
    for i in range(c.num_layers):
        p, layer = f"model.layers.{i}.", ("layers", i)
        attn = (*layer, "attn")
        add(p + "input_layernorm.weight", (*layer, "attn_norm", "scale"), "copy", (e,))
        heads = {"q": h, "k": kv, "v": kv}
        for x, n in heads.items():
            add(f"{p}self_attn.{x}_proj.weight", (*attn, f"w{x}"), "qkv", (n * d, e), (e, n, d))
        if c.qkv_bias:
            for x, n in heads.items():
                add(f"{p}self_attn.{x}_proj.bias", (*attn, f"b{x}"), "head_bias", (n * d,), (n, d))
        if c.qk_norm:
            for x in "qk":
                add(f"{p}self_attn.{x}_norm.weight", (*attn, f"{x}_norm", "scale"), "copy", (d,))
        add(p + "self_attn.o_proj.weight", (*attn, "wo"), "out_proj", (e, h * d), (h, d, e))
        add(p + "post_attention_layernorm.weight", (*layer, "mlp_norm", "scale"), "copy", (e,))
        add(p + "mlp.gate_proj.weight", (*layer, "mlp", "w_gate"), "linear", (m, e), (e, m))
        add(p + "mlp.up_proj.weight", (*layer, "mlp", "w_up"), "linear", (m, e), (e, m))
        add(p + "mlp.down_proj.weight", (*layer, "mlp", "w_down"), "linear", (e, m), (m, e))
    add("model.norm.weight", ("final_norm", "scale"), "copy", (e,))
    if not c.tie_word_embeddings:
        add("lm_head.weight", ("lm_head",), "linear", (c.vocab_size, e), (e, c.vocab_size))
    return specs


def _value_head_specs(config: ModelConfig) -> list[_TensorSpec]:
    e = config.hidden_size
    return [
        _TensorSpec(VALUE_HEAD_WEIGHT, ("value_w",), (e,), "copy", (e,)),
        _TensorSpec(VALUE_HEAD_BIAS, ("value_b",), (), "copy", ()),
    ]


def _model_view(spec: _TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(view, perm): the HF tensor reshaped to `view` (a row-major view of its bytes: view
    dimension 0 is HF dimension 0) is the model parameter once transposed by `perm`,
    model = view.transpose(perm). E = hidden, H = heads, D = head_dim."""
    m = spec.model_shape
    if spec.kind in ("copy", "head_bias"):  # [H*D] viewed as [H, D] is already the model's
        return m, tuple(range(len(m)))
    if spec.kind == "linear":  # [out, in] -> [in, out]
        return spec.hf_shape, (1, 0)
    if spec.kind == "qkv":  # [H*D, E] viewed as [H, D, E] -> [E, H, D]
        return (m[1], m[2], m[0]), (2, 0, 1)
    if spec.kind == "out_proj":  # [E, H*D] viewed as [E, H, D] -> [H, D, E]
        return (m[2], m[0], m[1]), (1, 2, 0)
    raise AssertionError(spec.kind)


def _to_model(x: np.ndarray, spec: _TensorSpec) -> np.ndarray:
    view, perm = _model_view(spec)
    y = x.reshape(view).transpose(perm)
    return y if y.flags.c_contiguous else np.ascontiguousarray(y)


def _to_hf(x: np.ndarray, spec: _TensorSpec) -> np.ndarray:
    if spec.kind == "copy":
        return x
    if spec.kind == "linear":
        return np.ascontiguousarray(x.T)
    if spec.kind == "qkv":
        return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    if spec.kind == "out_proj":
        return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
    if spec.kind == "head_bias":
        return x.reshape(spec.hf_shape)
    raise AssertionError(spec.kind)


# -- safetensors over the storage API ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    url: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _read_safetensors_header(url: str) -> dict[str, _StoredTensor]:
    """Tensor table of one safetensors file: 8-byte little-endian header size, JSON header,
    then the data, each tensor at [data_offsets) relative to the end of the header."""
    try:
        prefix = storage.read_range(url, 0, 8)
        (header_len,) = np.frombuffer(prefix, "<u8")
        if header_len > 100 * 1024**2:
            raise CheckpointError(f"{url}: not a safetensors file (header of {header_len} bytes)")
        raw = storage.read_range(url, 8, int(header_len))
    except EOFError as e:
        raise CheckpointError(f"{url}: not a safetensors file or truncated: {e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{url}: safetensors header is not valid JSON: {e}") from None
    data_start = 8 + int(header_len)
    table = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(o) for o in entry["data_offsets"])
            shape = tuple(int(n) for n in entry["shape"])
            table[name] = _StoredTensor(
                url, entry["dtype"], shape, data_start + begin, data_start + end
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{url}: malformed header entry for {name!r}: {e!r}") from None
    return table


def _checkpoint_tensors(path: str) -> dict[str, _StoredTensor]:
    """All tensors of the checkpoint at `path`: a single model.safetensors or a sharded index."""
    single = storage.join(path, SAFETENSORS_FILE)
    if storage.exists(single):
        return _read_safetensors_header(single)
    index_url = storage.join(path, INDEX_FILE)
    if not storage.exists(index_url):
        raise CheckpointError(
            f"{path} has neither {SAFETENSORS_FILE} nor {INDEX_FILE} (only safetensors "
            "checkpoints are supported; convert pytorch_model.bin with transformers first)"
        )
    weight_map: dict[str, str] = json.loads(storage.read_text(index_url))["weight_map"]
    tensors: dict[str, _StoredTensor] = {}
    for filename in sorted(set(weight_map.values())):
        shard = _read_safetensors_header(storage.join(path, filename))
        for name, tensor in shard.items():
            if weight_map.get(name) == filename:
                tensors[name] = tensor
    for name, filename in weight_map.items():
        if name not in tensors:
            raise CheckpointMismatchError(
                f"tensor {name!r} is listed in {index_url} as stored in {filename}, "
                f"but {storage.join(path, filename)} does not contain it"
            )
    return tensors


def _stored_dtype(tensor: _StoredTensor, name: str) -> np.dtype:
    """The numpy dtype of a stored tensor, checking that its offsets span its bytes."""
    if tensor.dtype not in _ST_TO_NP:
        raise CheckpointMismatchError(
            f"tensor {name!r} in {tensor.url} has unsupported dtype {tensor.dtype}"
        )
    dtype = _ST_TO_NP[tensor.dtype]
    nbytes = math.prod(tensor.shape) * dtype.itemsize
    if tensor.end - tensor.start != nbytes:
        raise CheckpointError(
            f"{tensor.url}: tensor {name!r} of shape {list(tensor.shape)} and dtype "
            f"{tensor.dtype} needs {nbytes} bytes but its offsets span {tensor.end - tensor.start}"
        )
    return dtype


def _read_bytes(tensor: _StoredTensor, name: str, start: int, length: int) -> bytes:
    """`length` bytes of a stored tensor from byte `start` of its data."""
    try:
        return storage.read_range(tensor.url, tensor.start + start, length)
    except EOFError as e:
        raise CheckpointError(f"tensor {name!r} is cut short: {e}") from None


def _read_tensor(tensor: _StoredTensor, name: str) -> np.ndarray:
    dtype = _stored_dtype(tensor, name)
    data = _read_bytes(tensor, name, 0, tensor.end - tensor.start)
    return np.frombuffer(data, dtype).reshape(tensor.shape)


def _safetensors_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, x in tensors.items():
        header[name] = {
            "dtype": _NP_TO_ST[x.dtype],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    parts = [np.array([len(raw)], "<u8").tobytes(), raw]
    parts += [np.ascontiguousarray(x).tobytes() for x in tensors.values()]
    return b"".join(parts)


# -- import ---------------------------------------------------------------------------------


def load_hf_params(path: str, config: ModelConfig) -> dict[str, Any]:
    """The checkpoint's weights as the model's pure parameter dict (numpy arrays on the host,
    in config.param_dtype; layers keyed by int), for `nnx.replace_by_pure_dict`.

    The whole checkpoint is read into host memory: for a model to train, `load_hf_sharded`
    places it on a mesh shard by shard instead.
    The value head (`value_w`, `value_b`) is included only when config.value_head and the
    checkpoint holds value_head.weight / value_head.bias.
    Raises CheckpointMismatchError on a missing, unexpected or misshapen tensor.
    """
    stored = _checkpoint_tensors(path)
    param_dtype = _PARAM_NP_DTYPE[config.param_dtype]
    params: dict[str, Any] = {}
    for spec in _checked_specs(path, config, stored):
        value = _to_model(_read_tensor(stored[spec.name], spec.name), spec)
        _set_path(params, spec.path, value.astype(param_dtype, copy=False))
    return params


def _checked_specs(
    path: str, config: ModelConfig, stored: Mapping[str, _StoredTensor]
) -> list[_TensorSpec]:
    """The specs of the tensors to load from the checkpoint at `path` (the value head's only
    when config.value_head and the checkpoint holds it), each checked against `stored`
    before a byte of data is read: CheckpointMismatchError on a missing, unexpected or
    misshapen tensor or a non-float dtype, CheckpointError on offsets that do not span it."""
    specs = _specs(config)
    expected = {s.name for s in specs}
    missing = [s for s in specs if s.name not in stored]
    if missing:
        s = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointMismatchError(
            f"tensor {s.name!r} (expected shape {list(s.hf_shape)}) is missing from the "
            f"checkpoint at {path}{more}; is config.json describing these weights?"
        )
    if config.value_head and all(v.name in stored for v in _value_head_specs(config)):
        specs += _value_head_specs(config)
        expected |= {VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS}
    for name, tensor in stored.items():
        if name in expected or _HARMLESS_EXTRA.search(name):
            continue
        if name in (VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS):
            continue  # a value head the config does not ask for
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints store the (shared) output matrix anyway
        raise CheckpointMismatchError(
            f"unexpected tensor {name!r} of shape {list(tensor.shape)} in {tensor.url}: the "
            f"{config.architecture} config expects no such tensor"
        )
    for spec in specs:
        tensor = stored[spec.name]
        if tensor.shape != spec.hf_shape:
            raise CheckpointMismatchError(
                f"tensor {spec.name!r} in {tensor.url} has shape {list(tensor.shape)}, "
                f"expected {list(spec.hf_shape)}"
            )
        if tensor.dtype not in _FLOAT_CODES:
            raise CheckpointMismatchError(
                f"tensor {spec.name!r} in {tensor.url} has dtype {tensor.dtype}, expected a "
                f"floating-point dtype ({', '.join(_FLOAT_CODES)})"
            )
        _stored_dtype(tensor, spec.name)
    return specs


def load_hf_model(
    path: str, *, seed: int = 0, rngs: nnx.Rngs | None = None, **config_overrides: Any
) -> Transformer:
    """A Transformer with the weights of the HF checkpoint at `path` (local or gs://).

    `config_overrides` go to `load_hf_config` (e.g. param_dtype, dtype, value_head). Params
    that the checkpoint lacks by design (a value head) keep the model's own initialisation
    from `rngs` (default nnx.Rngs(seed)); nothing else is initialised, so loading a large
    model does not first build a random one.
    """
    config = load_hf_config(path, **config_overrides)
    params = load_hf_params(path, config)
    rngs = rngs if rngs is not None else nnx.Rngs(seed)
    return build_model(config, params, rngs=rngs)


def load_model_for_config(config: ModelConfig, *, seed: int = 0) -> Transformer:
    """The model of a run whose `config.hf_checkpoint` is set.

    The checkpoint's weight-shaping architecture (config.checkpoint.SHAPE_FIELDS) must equal
    the run config's — loading a config resolves it from the checkpoint, so a difference
    means the checkpoint changed under the run; a ConfigError names each differing field.
    The rest (dtypes, RoPE, context length) is the run config's.
    """
    check_shapes(config, load_hf_config(config.hf_checkpoint))
    return build_model(config, load_hf_params(config.hf_checkpoint, config), rngs=nnx.Rngs(seed))


def build_model(config: ModelConfig, params: Mapping[str, Any], *, rngs: nnx.Rngs) -> Transformer:
    """A Transformer holding `params` (a possibly partial pure dict); params not given are
    initialised exactly as `Transformer(config, rngs=rngs)` would, and only those."""
    abstract = nnx.eval_shape(lambda r: Transformer(config, rngs=r), rngs)
    graphdef, state = nnx.split(abstract)
    wanted = list(_flatten(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))))
    values: dict[Any, Any] = {}
    absent = []
    for path, want in wanted:
        try:
            got = _get_path(params, path)
        except KeyError:
            absent.append(path)
            continue
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointMismatchError(
                f"parameter {'.'.join(map(str, path))} has shape {list(got.shape)}, "
                f"expected {list(want.shape)}"
            )
        _set_path(values, path, jnp.asarray(got, dtype=want.dtype))
    if absent:
        # Under jit, XLA drops the random inits whose results are not returned.
        def init_absent(r: nnx.Rngs) -> list[jax.Array]:
            full = nnx.to_pure_dict(nnx.state(Transformer(config, rngs=r), nnx.Param))
            return [_get_path(full, path) for path in absent]

        for path, x in zip(absent, nnx.jit(init_absent)(rngs), strict=True):
            _set_path(values, path, x)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


# -- import straight into a sharding ---------------------------------------------------------

# The most bytes one ranged read asks for: the HF rows a parameter's shards need are read in
# blocks of at most this many bytes (or one row, where a row is larger).
MAX_READ_BYTES = 128 * 1024**2


def load_hf_sharded(
    config: ModelConfig,
    like: Mapping[str, Any],
    *,
    seed: int = 0,
    max_read_bytes: int = MAX_READ_BYTES,
) -> dict[str, Any]:
    """The weights of the checkpoint at `config.hf_checkpoint`, every parameter created in
    its sharding: a pure dict like `like` of jax.Arrays. `like`'s leaves have .shape, .dtype
    and .sharding (jax.ShapeDtypeStruct); its decoder layers are per layer (`layers/0/...`)
    or stacked on a leading axis (`layers/...`, trainer.scan_layers).

    One parameter at a time, each process builds on the host the distinct shards of its own
    devices (`jax.make_array_from_callback` asks only for those; devices that replicate a
    shard share one buffer), in the leaf's dtype, then puts them on their devices. The HF
    rows (dimension 0) those shards need are read once each, in blocks of at most
    `max_read_bytes`, and each block is cut to the shards' columns, transposed to the model's
    layout and converted as it arrives; a stacked parameter's shards are filled from each
    layer's tensor in turn. So a device never holds more than its own shards, and the host
    holds this process's shards of one parameter plus one block.

    The architecture must be the checkpoint's (`check_shapes`); checkpoint errors are those
    of `load_hf_params`. Params the checkpoint lacks by design (a value head) are
    initialised as `build_model` does, from nnx.Rngs(seed), directly in their sharding.
    """
    path = config.hf_checkpoint
    check_shapes(config, load_hf_config(path))
    stored = _checkpoint_tensors(path)
    specs = {spec.path: spec for spec in _checked_specs(path, config, stored)}
    stacked = is_stacked(like)
    params: dict[str, Any] = {}
    absent: list[tuple[tuple, Any]] = []
    for leaf_path, leaf in _flatten(like):
        key = tuple(int(k) if str(k).isdigit() else k for k in leaf_path)  # as in _specs
        layered = stacked and key[0] == "layers"  # [layers, ...]: one tensor per layer
        if layered:
            sources = [specs.get(("layers", i, *key[1:])) for i in range(config.num_layers)]
        else:
            sources = [specs.get(key)]
        if None in sources:
            absent.append((leaf_path, leaf))
            continue
        shape = sources[0].model_shape
        shape = (len(sources), *shape) if layered else shape
        if tuple(leaf.shape) != shape:
            raise CheckpointMismatchError(
                f"parameter {'.'.join(map(str, leaf_path))} has shape {list(shape)}, "
                f"expected {list(leaf.shape)}"
            )
        _set_path(params, leaf_path, _load_sharded(leaf, stored, sources, layered, max_read_bytes))
    if absent:
        # Under jit, XLA drops the random inits whose results are not returned.
        def init_absent() -> list[jax.Array]:
            model = Transformer(config, rngs=nnx.Rngs(seed), scan_layers=stacked)
            full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            return [_get_path(full, p).astype(leaf.dtype) for p, leaf in absent]

        init = jax.jit(init_absent, out_shardings=[leaf.sharding for _, leaf in absent])
        for (leaf_path, _), x in zip(absent, init(), strict=True):
            _set_path(params, leaf_path, x)
    return params


_Bounds = tuple[tuple[int, int], ...]  # [start, stop) of each dimension of a shard


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Bounds:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _load_sharded(
    leaf: Any,
    stored: Mapping[str, _StoredTensor],
    sources: list[_TensorSpec],
    layered: bool,
    max_read_bytes: int,
) -> jax.Array:
    """One parameter in `leaf`'s sharding from its HF tensor (`sources[0]`) or, `layered`,
    from one tensor per layer ([layers, ...]): this process's distinct shards are filled on
    the host, then placed by `jax.make_array_from_callback` (host buffers released with it)."""
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    index_map = leaf.sharding.addressable_devices_indices_map(shape)
    wanted = list(dict.fromkeys(_bounds(index, shape) for index in index_map.values()))
    shards = {b: np.empty([stop - start for start, stop in b], dtype) for b in wanted}
    if not layered:
        _fill_shards(stored, sources[0], list(shards.items()), max_read_bytes)
    else:
        for layer, spec in enumerate(sources):
            targets = [
                (b[1:], out[layer - b[0][0]])
                for b, out in shards.items()
                if b[0][0] <= layer < b[0][1]
            ]
            if targets:
                _fill_shards(stored, spec, targets, max_read_bytes)
    return jax.make_array_from_callback(
        shape, leaf.sharding, lambda index: shards[_bounds(index, shape)], dtype=dtype
    )


def _fill_shards(
    stored: Mapping[str, _StoredTensor],
    spec: _TensorSpec,
    targets: list[tuple[_Bounds, np.ndarray]],
    max_read_bytes: int,
) -> None:
    """Fill each target (bounds in the model layout of `spec`'s parameter, the host buffer of
    that shard) from `spec`'s HF tensor. The rows of the HF tensor's row-major view that the
    targets need are read once each, in blocks of at most max_read_bytes (one row at least);
    each block is cut to every target's part, transposed and converted on the host."""
    tensor = stored[spec.name]
    source = _stored_dtype(tensor, spec.name)
    view, perm = _model_view(spec)
    if not view:  # a scalar
        value = np.frombuffer(_read_bytes(tensor, spec.name, 0, source.itemsize), source)
        for _, out in targets:
            out[...] = value.reshape(()).astype(out.dtype)
        return
    # The targets' bounds in the view: view dimension perm[k] is model dimension k.
    in_view = []
    for bounds, out in targets:
        view_bounds = [(0, 0)] * len(view)
        for model_dim, view_dim in enumerate(perm):
            view_bounds[view_dim] = bounds[model_dim]
        in_view.append((view_bounds, out))
    row_bytes = math.prod(view[1:]) * source.itemsize
    rows_per_read = max(1, max_read_bytes // max(row_bytes, 1))
    row_dim = perm.index(0)  # the model dimension the HF rows become
    for first, last in _merged(sorted(b[0] for b, _ in in_view)):
        for start in range(first, last, rows_per_read):
            stop = min(start + rows_per_read, last)
            data = _read_bytes(tensor, spec.name, start * row_bytes, (stop - start) * row_bytes)
            block = np.frombuffer(data, source).reshape((stop - start, *view[1:]))
            for view_bounds, out in in_view:
                (lo, hi), rest = view_bounds[0], view_bounds[1:]
                lo, hi = max(lo, start), min(hi, stop)
                if lo >= hi:
                    continue
                cut = (slice(lo - start, hi - start), *(slice(a, b) for a, b in rest))
                where = [slice(None)] * out.ndim
                where[row_dim] = slice(lo - view_bounds[0][0], hi - view_bounds[0][0])
                out[tuple(where)] = block[cut].transpose(perm).astype(out.dtype, copy=False)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [start, stop) ranges merged where they overlap or touch."""
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


# -- export ---------------------------------------------------------------------------------


def save_hf(
    model_or_params: Transformer | nnx.State | Mapping[str, Any],
    config: ModelConfig,
    path: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    include_value_head: bool = False,
) -> list[str]:
    """Write `config.json` and safetensors weights loadable by transformers' from_pretrained.

    Weights keep config.param_dtype. One `model.safetensors` when the weights fit in
    `max_shard_bytes`, else `model-0000k-of-0000n.safetensors` shards and
    `model.safetensors.index.json`; a stale file of the other layout is removed. The value
    head is written as value_head.weight / value_head.bias only with include_value_head.
    Files are written atomically, config.json last. Returns the files written.
    """
    params = _pure_params(model_or_params)
    specs = _specs(config)
    if include_value_head:
        if not config.value_head:
            raise CheckpointError("include_value_head=True but config.value_head is False")
        specs += _value_head_specs(config)
    config_json = config_to_hf_dict(config)
    param_dtype = _PARAM_NP_DTYPE[config.param_dtype]

    tensors: dict[str, np.ndarray] = {}
    for spec in specs:
        try:
            value = np.asarray(_get_path(params, spec.path))
        except KeyError:
            raise CheckpointMismatchError(
                f"parameter {'.'.join(map(str, spec.path))} (for tensor {spec.name!r}) is "
                "missing from the params to export"
            ) from None
        if value.shape != spec.model_shape:
            raise CheckpointMismatchError(
                f"parameter {'.'.join(map(str, spec.path))} (for tensor {spec.name!r}) has "
                f"shape {list(value.shape)}, expected {list(spec.model_shape)}"
            )
        tensors[spec.name] = _to_hf(value.astype(param_dtype, copy=False), spec)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes

    storage.makedirs(path)
    written = []
    single_url, index_url = storage.join(path, SAFETENSORS_FILE), storage.join(path, INDEX_FILE)
    if len(shards) == 1:
        storage.write_bytes(single_url, _safetensors_bytes(shards[0]))
        written.append(single_url)
        stale = [index_url]
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            filename = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            url = storage.join(path, filename)
            storage.write_bytes(url, _safetensors_bytes(shard))
            written.append(url)
            weight_map.update(dict.fromkeys(shard, filename))
        total = sum(x.nbytes for x in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        storage.write_text(index_url, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(index_url)
        stale = [single_url]
    for url in stale:
        if storage.exists(url):
            storage.remove(url)
    config_url = storage.join(path, CONFIG_FILE)
    storage.write_text(config_url, json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    written.append(config_url)
    return written


def _pure_params(model_or_params: Any) -> Mapping[str, Any]:
    """A per-layer pure params dict (scanned, stacked layers are unstacked: HF files hold
    one tensor per layer)."""
    if isinstance(model_or_params, nnx.Module):
        model_or_params = nnx.state(model_or_params, nnx.Param)
    if isinstance(model_or_params, nnx.State):
        model_or_params = nnx.to_pure_dict(model_or_params)
    return unstack_layers(model_or_params)


# -- LoRA adapters as a PEFT adapter ------------------------------------------------------------

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
# Where PEFT's LoraModel holds the wrapped model's modules: the prefix of a saved adapter's
# tensor names.
_PEFT_PREFIX = "base_model.model."


def peft_adapter_config(lora: LoraConfig, base_model: str | None) -> dict[str, Any]:
    """adapter_config.json of `lora` as PEFT's LoraConfig reads it: plain LoRA (no dropout,
    bias, rsLoRA or DoRA), so PEFT scales by lora_alpha / r, `lora.scale`."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": alpha,
        "target_modules": list(lora.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_adapter_tensors(
    model_or_params: Transformer | nnx.State | Mapping[str, Any], config: ModelConfig
) -> dict[str, np.ndarray]:
    """The adapters of a LoRA model (`config.lora`) by PEFT tensor name, in torch's Linear
    layout and config.param_dtype: `<module>.lora_A.weight`: [r, in_features] and
    `<module>.lora_B.weight`: [out_features, r], <module> being PEFT's name of the HF module
    whose weight the adapted one is written as (base_model.model.model.layers.0.self_attn.
    q_proj).

    A weight W: [in..., out...] is written as W.reshape(prod(in), prod(out)).T (`_to_hf`:
    q/k/v outputs and o_proj's input are flattened heads-major, [H, D] -> H*D), so the HF
    form of the update scale·A·B, with A2 = A.reshape(prod(in), r) and
    B2 = B.reshape(r, prod(out)), is scale · B2.T @ A2.T: lora_B = B2.T, lora_A = A2.T.
    """
    lora = config.lora
    if lora is None:
        raise CheckpointError("the model has no LoRA adapters to export (model.lora is unset)")
    params = _pure_params(model_or_params)
    param_dtype = _PARAM_NP_DTYPE[config.param_dtype]
    in_ndims = {TARGET_WEIGHTS[t][:2]: TARGET_WEIGHTS[t][2] for t in lora.targets}
    r = lora.rank
    tensors: dict[str, np.ndarray] = {}
    for spec in _specs(config):
        in_ndim = in_ndims.get(spec.path[-2:])
        if spec.path[0] != "layers" or in_ndim is None:
            continue
        module = _PEFT_PREFIX + spec.name.removesuffix(".weight")
        ins, outs = spec.model_shape[:in_ndim], spec.model_shape[in_ndim:]
        *parent, weight = spec.path
        for suffix, name, shape, rows in (
            ("_lora_a", "lora_A", (*ins, r), math.prod(ins)),
            ("_lora_b", "lora_B", (r, *outs), r),
        ):
            path = (*parent, weight + suffix)
            try:
                value = np.asarray(_get_path(params, path))
            except KeyError:
                raise CheckpointMismatchError(
                    f"adapter {'/'.join(map(str, path))} (of model.lora.targets) is missing "
                    "from the params to export"
                ) from None
            if value.shape != shape:
                raise CheckpointMismatchError(
                    f"adapter {'/'.join(map(str, path))} has shape {list(value.shape)}, "
                    f"expected {list(shape)}"
                )
            value = value.astype(param_dtype, copy=False).reshape(rows, -1)
            tensors[f"{module}.{name}.weight"] = np.ascontiguousarray(value.T)
    return tensors


def save_peft_adapter(
    model_or_params: Transformer | nnx.State | Mapping[str, Any],
    config: ModelConfig,
    path: str,
    *,
    base_model: str | None,
) -> list[str]:
    """Write the adapters of a LoRA model (`config.lora`) to `path` as a PEFT adapter:
    adapter_model.safetensors (`peft_adapter_tensors`) and adapter_config.json, last, naming
    `base_model` (the directory or hub id of the base they apply to) when given. Returns the
    files written."""
    tensors = peft_adapter_tensors(model_or_params, config)
    storage.makedirs(path)
    weights_url = storage.join(path, PEFT_WEIGHTS_FILE)
    storage.write_bytes(weights_url, _safetensors_bytes(tensors))
    config_url = storage.join(path, PEFT_CONFIG_FILE)
    adapter_config = peft_adapter_config(config.lora, base_model)
    storage.write_text(config_url, json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return [weights_url, config_url]


# -- nested-dict helpers ----------------------------------------------------------------------


def _flatten(tree: Mapping[Any, Any], prefix: tuple = ()):
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _flatten(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _get_path(tree: Mapping[Any, Any], path: tuple) -> Any:
    node: Any = tree
    for k in path:
        if k in node:
            node = node[k]
        elif str(k) in node:  # layer indices may come as strings from other serialisers
            node = node[str(k)]
        else:
            raise KeyError(path)
    return node


def _set_path(tree: dict[Any, Any], path: tuple, value: Any) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value
