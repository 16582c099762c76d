"""Hugging Face checkpoints in and out: config.json + safetensors <-> ModelConfig + Transformer.

Import reads `config.json` and `model.safetensors` (or the shards named by
`model.safetensors.index.json`) from a local directory or gs:// through rlax_tpu.storage,
one tensor per ranged read, and maps the torch layout ([out, in] Linear weights) onto
the model's parameter tree. Export writes the same format back, so a trained policy
loads with `transformers.AutoModelForCausalLM.from_pretrained`; export -> import is
bit-exact. Every mismatch between a checkpoint and the model raises
`CheckpointMismatchError` naming the tensor, the expected and found shapes and the file.

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
from rlax_tpu.config import ModelConfig
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
from rlax_tpu.models.transformer import Transformer, unstack_layers

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


def _to_model(x: np.ndarray, spec: _TensorSpec) -> np.ndarray:
    if spec.kind == "copy":
        return x
    if spec.kind in ("linear", "qkv", "out_proj"):
        return np.ascontiguousarray(x.T).reshape(spec.model_shape)
    if spec.kind == "head_bias":
        return x.reshape(spec.model_shape)
    raise AssertionError(spec.kind)


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


def _read_tensor(tensor: _StoredTensor, name: str) -> np.ndarray:
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
    try:
        data = storage.read_range(tensor.url, tensor.start, nbytes)
    except EOFError as e:
        raise CheckpointError(f"tensor {name!r} is cut short: {e}") from None
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

    The value head (`value_w`, `value_b`) is included only when config.value_head and the
    checkpoint holds value_head.weight / value_head.bias.
    Raises CheckpointMismatchError on a missing, unexpected or misshapen tensor.
    """
    stored = _checkpoint_tensors(path)
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

    param_dtype = _PARAM_NP_DTYPE[config.param_dtype]
    params: dict[str, Any] = {}
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
        value = _to_model(_read_tensor(tensor, spec.name), spec).astype(param_dtype, copy=False)
        _set_path(params, spec.path, value)
    return params


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
