"""Low-rank adapters (LoRA) on the transformer's projections (`model.lora`, LoraConfig).

An adapted weight W: [in..., out...] gets two parameters next to it in its module,
`<w>_lora_a`: [in..., rank] and `<w>_lora_b`: [rank, out...], and the projection computes
x·W + (alpha / rank) · (x·A)·B: the adapters stay unmerged in the matmul, in training and in
serving, so an inference worker holds the base once and a new version changes only A and B.
A is drawn as PEFT draws it (uniform in ±1/sqrt(fan_in), from its own stream, after every
base parameter, so the base is the same with and without LoRA), B is zero: a fresh adapter
leaves the model unchanged.

Why not qwix (the issue's first choice): `qwix.apply_lora_to_model` intercepts a module's
einsums and creates its LoRA params lazily in the module on the first call. This model runs
its decoder layers as `nnx.merge(graphdef, state)` inside `jax.checkpoint` / `lax.scan`
(Transformer._run_layers): each call merges a fresh module from the stored state, so the
lazily created adapters are never part of that state — only the lm_head (called outside the
scan) was adapted when tried (qwix 0.1.8, flax 0.12.8). Declaring the adapters as ordinary
parameters with logical axes keeps them in the state every transform sees, sharded by the
same rules as the base.

The adapters of a params tree are the leaves named `*_lora_a` / `*_lora_b` (`is_adapter`);
`split` and `combine` separate and rejoin them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.config import LoraConfig
from rlax_tpu.tree import flatten, unflatten_like

# Hugging Face module name -> (module attribute of the decoder layer, weight attribute,
# number of leading input dimensions of the weight).
TARGET_WEIGHTS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "wq", 1),
    "k_proj": ("attn", "wk", 1),
    "v_proj": ("attn", "wv", 1),
    "o_proj": ("attn", "wo", 2),
    "gate_proj": ("mlp", "w_gate", 1),
    "up_proj": ("mlp", "w_up", 1),
    "down_proj": ("mlp", "w_down", 1),
}
SUFFIXES = ("_lora_a", "_lora_b")


def add_adapters(layer: nnx.Module, lora: LoraConfig, rngs: nnx.Rngs) -> None:
    """Give `layer` (a DecoderLayer) the adapters `lora` names, A drawn from `rngs.params()`
    in the order of `lora.targets`, B zero; logical axes from the weight's, the rank axis
    "lora_rank" (replicated)."""
    for target in lora.targets:
        module_name, weight_name, in_ndim = TARGET_WEIGHTS[target]
        module = getattr(layer, module_name)
        weight = getattr(module, weight_name)
        shape, axes = weight.get_value().shape, tuple(weight.logical_axes)
        dtype = weight.get_value().dtype
        fan_in = math.prod(shape[:in_ndim])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(
            rngs.params(), (*shape[:in_ndim], lora.rank), jnp.float32, -bound, bound
        )
        b = jnp.zeros((lora.rank, *shape[in_ndim:]), jnp.float32)
        setattr(
            module,
            weight_name + "_lora_a",
            nnx.LoRAParam(a.astype(dtype), logical_axes=(*axes[:in_ndim], "lora_rank")),
        )
        setattr(
            module,
            weight_name + "_lora_b",
            nnx.LoRAParam(b.astype(dtype), logical_axes=("lora_rank", *axes[in_ndim:])),
        )


def adapted(module: nnx.Module, name: str, x: jax.Array, y: jax.Array, scale: float) -> jax.Array:
    """y = x·W (the projection by `module.<name>`) plus its adapter's scale · (x·A)·B when
    the module has one; y unchanged otherwise. The contraction is over x's trailing
    dimensions that A's leading ones name."""
    a_param = getattr(module, name + "_lora_a", None)
    if a_param is None:
        return y
    a = a_param.get_value().astype(x.dtype)
    b = getattr(module, name + "_lora_b").get_value().astype(x.dtype)
    in_ndim = a.ndim - 1
    xa = jnp.tensordot(x, a, axes=in_ndim)  # [..., rank]
    return y + (scale * jnp.tensordot(xa, b, axes=1)).astype(y.dtype)


def is_adapter(path: str | tuple) -> bool:
    """Whether a params-tree path ("layers/0/attn/wq_lora_a", or its key tuple) is an adapter."""
    last = path.rsplit("/", 1)[-1] if isinstance(path, str) else str(path[-1])
    return last.endswith(SUFFIXES)


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapters, base): the nested params dict cut in two trees of the same nesting, each
    without the other's leaves (and without subtrees left empty)."""

    def cut(node: Mapping, keep_adapters: bool) -> dict:
        out = {}
        for k, v in node.items():
            if isinstance(v, Mapping):
                sub = cut(v, keep_adapters)
                if sub:
                    out[k] = sub
            elif is_adapter((k,)) == keep_adapters:
                out[k] = v
        return out

    return cut(params, True), cut(params, False)


def combine(base: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict[str, Any]:
    """The params tree of `base` with `adapters` added (the inverse of `split`)."""
    out = dict(base)
    for k, v in adapters.items():
        if isinstance(v, Mapping):
            out[k] = combine(base.get(k, {}), v)
        else:
            out[k] = v
    return out


def merged(params: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """The params tree with every adapter folded into its weight, W + scale · A·B, and the
    adapters removed: the model without LoRA that computes what the adapted one does (within
    rounding). A per-layer tree (`layers/0/...`), host or device arrays."""
    adapters, base = split(params)

    def fold(node: Mapping, extra: Mapping) -> dict:
        out = {}
        for k, v in node.items():
            if isinstance(v, Mapping):
                out[k] = fold(v, extra.get(k, {}))
            elif k + "_lora_a" in extra:
                a, b = extra[k + "_lora_a"], extra[k + "_lora_b"]
                delta = jnp.tensordot(
                    jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), axes=1
                )
                out[k] = (jnp.asarray(v, jnp.float32) + scale * delta).astype(v.dtype)
            else:
                out[k] = v
        return out

    return fold(base, adapters)


# The published form of a LoRA version's adapters: one flat array (`pack`), so that a version
# costs the parameter server, its storage and every pull one array, not two per adapted
# projection and layer (each array carries a fixed cost: framing, hashing, a TensorStore
# write), while the bytes are the adapters' own.
PACKED_KEY = "lora_adapters"


def pack(adapters: Mapping[str, Any]) -> jax.Array:
    """The adapters' leaves raveled and concatenated, in the order of their sorted paths
    (`unpack` reverses it on a tree of the same paths and shapes); one dtype."""
    flat = flatten(adapters)
    return jnp.concatenate([jnp.ravel(flat[path]) for path in sorted(flat)])


def unpack(packed: Any, like: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters tree shaped as `like` (arrays or ShapeDtypeStructs) from `pack`'s flat
    array (host numpy slices of a host copy of it)."""
    if isinstance(packed, jax.Array) and not packed.is_fully_addressable:
        packed = packed.addressable_shards[0].data  # replicated: any shard holds it all
    host = np.asarray(packed)
    flat = flatten(like)
    values, offset = {}, 0
    for path in sorted(flat):
        shape = tuple(flat[path].shape)
        size = math.prod(shape)
        values[path] = host[offset : offset + size].reshape(shape)
        offset += size
    if offset != host.size:
        raise ValueError(
            f"a packed LoRA version holds {host.size} values but the adapters of this model "
            f"take {offset}: the worker's model.lora is not the trainer's"
        )
    return unflatten_like(like, values)


def packed_size(like: Mapping[str, Any]) -> int:
    return sum(math.prod(x.shape) for x in flatten(like).values())
