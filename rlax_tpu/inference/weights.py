"""The served weights of an inference engine: where each leaf of the model state comes from
in a params tree, in which dtype and placement the jitted steps take it, and the placement
of a version's params (a mesh's devices each get their own shard of a host array, no
device ever the whole of it). With `inference.weight_dtype` the projections are quantized
here, at load, on the devices (rlax_tpu.models.quantization): the trainer and the parameter
server keep publishing and holding the published dtype."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.models import Transformer, quantization
from rlax_tpu.sharding import state_shardings


class ParamsMismatchError(ValueError):
    """A params tree given to `load` does not match the model config (names or shapes)."""


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One leaf of the model state: its keys in a params tree, shape, dtype, placement."""

    keys: tuple
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any  # None without a mesh
    # A quantized projection's values: the index of its scale's leaf in the layout; -1 else.
    scale: int = -1


def _on_mesh(value: Any, leaf: _Leaf) -> jax.Array:
    """`value` in `leaf`'s dtype and sharding. A device array is cast where it lies (an
    elementwise op keeps its sharding) and moved only if its sharding differs; a host array
    is sliced per device and each slice cast on the host (jnp.asarray of the whole would put
    it on one device first)."""
    if isinstance(value, jax.Array):
        return jax.device_put(jnp.asarray(value, leaf.dtype), leaf.sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(
        leaf.shape,
        leaf.sharding,
        lambda index: np.asarray(host[index]).astype(leaf.dtype),
        dtype=leaf.dtype,
    )


class _Tag:
    """A placeholder leaf that remembers its keys (not a pytree, so it stays a leaf)."""

    def __init__(self, keys: tuple) -> None:
        self.keys = keys


class ServedWeights:
    """The model state's leaves as the jitted steps take them (in `jax.tree.leaves` order),
    in the served dtype (the published one, `ModelConfig.served`) and placed on `mesh` (none:
    the default device). `graphdef` and `treedef` rebuild the model from the leaves.
    `load` places a version's params; `version` and `leaves` are what is served now (-1 and
    None before any load).

    With `inference.weight_dtype` ("int8", "fp8") each decoder layer's projection is two
    leaves, its quantized values and `<name>_scale` (`quantization.quantize_model`), made
    from the published weight by `place`; the params given are the published tree as
    before."""

    def __init__(
        self, model_config: ModelConfig, inference_config: InferenceConfig, mesh: Mesh | None
    ):
        self.model_config = model_config
        self.weight_dtype = inference_config.weight_dtype
        self._mesh = mesh
        self._rules = inference_config.mesh.logical_axis_rules
        self.graphdef, abstract_state = nnx.split(self._abstract_model())
        self.treedef = jax.tree.structure(abstract_state)
        self._layout = self._param_leaves(abstract_state)  # keys, shape, dtype, placement
        # The last quantization of each projection: (weak reference to the published array
        # it was made from, values, scale). A LoRA worker gives the same frozen base arrays
        # with every version's adapters: they are quantized once.
        self._quantized: dict[int, tuple[weakref.ref, jax.Array, jax.Array]] = {}
        self._quantizers: dict[tuple, Any] = {}  # jitted, by projection shape and sharding
        self._reshards: dict[tuple[int, ...], Any] = {}  # jitted identities (`_moved`)
        self.version = -1
        self.leaves: list[jax.Array] | None = None

    def load(self, version: int, params: Mapping[str, Any]) -> None:
        """Serve `version` with `params` (`place`: a bad tree raises and changes nothing)."""
        leaves = self.place(params)
        self.leaves, self.version = leaves, int(version)

    def _param_leaves(self, abstract_state: nnx.State) -> list[_Leaf]:
        """Where each leaf of the model state (in `jax.tree.leaves` order, the order the
        jitted steps take params in) comes from in a params tree, its shape, dtype and
        placement. Computed once: tracing the model's construction on every load would cost
        more than the load itself."""
        _, state = nnx.split(self._abstract_model())  # a copy to tag; abstract_state stays
        flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
        tagged: dict = {}
        for path, _ in flat:
            keys = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
            node = tagged
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = _Tag(keys)
        nnx.replace_by_pure_dict(state, tagged)
        order = [tag.keys for tag in jax.tree.leaves(state)]
        abstract = jax.tree.leaves(abstract_state)
        if self._mesh is None:
            shardings = [None] * len(abstract)
        else:
            rules = self._rules
            shardings = jax.tree.leaves(state_shardings(abstract_state, self._mesh, rules))
        index = {keys: i for i, keys in enumerate(order)}

        def scale_of(keys: tuple) -> int:
            scale_keys = (*keys[:-1], f"{keys[-1]}{quantization.SCALE_SUFFIX}")
            return index.get(scale_keys, -1)

        return [
            _Leaf(keys, tuple(a.shape), a.dtype, sharding, scale_of(keys))
            for keys, a, sharding in zip(order, abstract, shardings, strict=True)
        ]

    def place(self, params: Mapping[str, Any]) -> list[jax.Array]:
        """`params` as the model state's leaves, cast to the served param dtype (the published
        one, `ModelConfig.served`) and placed on the mesh (ParamsMismatchError naming what is
        missing or misshapen). Pulled params already have that dtype and placement; a float32
        master tree given in-process is rounded to it as the trainer's publish rounds it. On a
        mesh, a host array goes to each device as that device's slice (`_on_mesh`): no device
        holds more of it than its shard. With `inference.weight_dtype` the projections are
        quantized from the published weights (`_place_quantized`)."""
        scales = {leaf.scale for leaf in self._layout if leaf.scale >= 0}
        missing, wrong, values = [], [], []
        for i, leaf in enumerate(self._layout):
            if i in scales:  # made from its projection's published weight
                values.append(None)
                continue
            node: Any = params
            for k in leaf.keys:
                if isinstance(node, Mapping) and k in node:
                    node = node[k]
                elif isinstance(node, Mapping) and str(k) in node:
                    node = node[str(k)]
                else:
                    node = None
                    break
            name = ".".join(map(str, leaf.keys))
            if node is None:
                missing.append(name)
            elif tuple(np.shape(node)) != leaf.shape:
                wrong.append(f"{name}: {list(np.shape(node))} != {list(leaf.shape)}")
            values.append(node)
        if missing or wrong:
            raise ParamsMismatchError(
                f"params do not match the model config: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, wrong shapes {wrong[:5]}"
            )
        if not scales:
            if self._mesh is None:
                leaves = zip(values, self._layout, strict=True)
                return jax.device_put([jnp.asarray(v, leaf.dtype) for v, leaf in leaves])
            if all(isinstance(v, jax.Array) for v in values):
                # Device arrays (a co-located trainer's): cast where they lie, then moved.
                layout = zip(values, self._layout, strict=True)
                return self._moved([jnp.asarray(v, leaf.dtype) for v, leaf in layout])
            return [_on_mesh(v, leaf) for v, leaf in zip(values, self._layout, strict=True)]
        return self._place_quantized(values)

    def _moved(self, arrays: list[jax.Array]) -> list[jax.Array]:
        """Device arrays in the served dtypes, in this mesh's shardings. A leaf replicated on
        its devices (a data-parallel trainer's) is sliced where it lies, all such leaves by one
        jitted identity compiled once per set of them; a leaf sharded another way (an FSDP
        trainer's) is moved with the rest by one `jax.device_put`, which copies the shards
        between devices, where XLA:CPU's all-to-all took 2.5-2.8x as long at 20M; a leaf
        already laid out as served is relabelled (no copy). tools/bench_colocated_load.py
        measures both layouts (docs/controller.md, "Co-located")."""
        shardings = [leaf.sharding for leaf in self._layout]
        moving = {
            i
            for i, (array, sharding) in enumerate(zip(arrays, shardings, strict=True))
            if not array.sharding.is_equivalent_to(sharding, array.ndim)
        }
        sliced = tuple(
            i
            for i in sorted(moving)
            if arrays[i].is_fully_replicated
            and arrays[i].sharding.device_set == shardings[i].device_set
        )
        put = [i for i in range(len(arrays)) if i not in sliced]
        out = list(arrays)
        for i, array in zip(
            put, jax.device_put([arrays[i] for i in put], [shardings[i] for i in put]), strict=True
        ):
            out[i] = array
        if sliced:
            program = self._reshards.get(sliced)
            if program is None:
                program = jax.jit(lambda xs: xs, out_shardings=[shardings[i] for i in sliced])
                self._reshards[sliced] = program
            for i, array in zip(sliced, program([arrays[i] for i in sliced]), strict=True):
                out[i] = array
        return out

    def _place_quantized(self, values: list[Any]) -> list[jax.Array]:
        """`place` with quantized projections: each leaf placed as it is served, a projection
        first in the published dtype and sharding, then quantized on its devices, one at a
        time (of a host tree, at most one projection is on the devices unquantized). A
        projection given as the same array as in the last load (a LoRA base: host arrays,
        `WeightFetcher.complete`) keeps its quantized leaves."""
        published = jnp.dtype(self.model_config.served().param_dtype)
        out: list[Any] = [None] * len(self._layout)
        for i, (value, leaf) in enumerate(zip(values, self._layout, strict=True)):
            if value is None:  # a scale: set with its projection
                continue
            if leaf.scale < 0:
                out[i] = self._put(value, leaf)
                continue
            scale_leaf = self._layout[leaf.scale]
            cached = self._quantized.get(i)
            if (
                isinstance(value, (jax.Array, np.ndarray))
                and cached is not None
                and cached[0]() is value
            ):
                out[i], out[leaf.scale] = cached[1], cached[2]
                continue
            source = self._put(value, dataclasses.replace(leaf, dtype=published, scale=-1))
            q, scale = self._quantizer(leaf, scale_leaf)(source)
            out[i], out[leaf.scale] = q, scale
            if isinstance(value, (jax.Array, np.ndarray)):
                self._quantized[i] = (weakref.ref(value), q, scale)
        return out

    def _put(self, value: Any, leaf: _Leaf) -> jax.Array:
        if self._mesh is None:
            return jax.device_put(jnp.asarray(value, leaf.dtype))
        return _on_mesh(value, leaf)

    def _quantizer(self, leaf: _Leaf, scale_leaf: _Leaf) -> Any:
        """The jitted quantization of `leaf`'s published weight into its values and scale, in
        their shardings (reducing over the dimensions the scale keeps at size 1); one per
        projection shape, kept."""
        key = (leaf.shape, leaf.sharding, scale_leaf.shape, scale_leaf.sharding)
        if key not in self._quantizers:
            in_axes = tuple(d for d, n in enumerate(scale_leaf.shape) if n == 1)
            fn = functools.partial(
                quantization.quantize, weight_dtype=self.weight_dtype, in_axes=in_axes
            )
            if self._mesh is None:
                self._quantizers[key] = jax.jit(fn)
            else:
                shardings = (leaf.sharding, scale_leaf.sharding)
                self._quantizers[key] = jax.jit(fn, out_shardings=shardings)
        return self._quantizers[key]

    def _abstract_model(self) -> Transformer:
        # Weights in the published dtype (what the parameter server holds), the projections
        # quantized with inference.weight_dtype; the KV cache and compute stay in
        # model_config.dtype.
        served = self.model_config.served()

        def build() -> Transformer:
            model = Transformer(served, rngs=nnx.Rngs(0))
            if self.weight_dtype:
                quantization.quantize_model(model, self.weight_dtype)
            return model

        return nnx.eval_shape(build)

    def abstract(self) -> list[jax.ShapeDtypeStruct]:
        """The served weights as the jitted steps take them (leaves in the served dtype,
        placed on the mesh), abstract."""
        return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in self._layout]
