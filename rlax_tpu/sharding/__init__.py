"""Device meshes and logical-axis sharding.

The model names every parameter and activation dimension with a logical axis
("embed", "heads", "batch", ...); the config's rules map logical axes to mesh axes
(data, fsdp, tensor). The same model thus runs on one CPU device or a pod slice.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rlax_tpu.config import ConfigError, MeshConfig

Rules = tuple[tuple[str, tuple[str, ...]], ...]
LogicalAxes = tuple[str | None, ...]

_log = logging.getLogger(__name__)
_active: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "rlax_tpu_active_mesh", default=None
)


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (data, fsdp, tensor) over `devices` (default: all devices).

    One slice: the devices in their order, reshaped. Several (`config.num_slices`): a hybrid
    mesh whose `dcn_axis` spans the slices (each slice one contiguous block of it, in slice
    order) while the other axes stay inside a slice, laid out on its ICI torus by JAX's
    `create_hybrid_device_mesh`. A TPU device's slice is its `slice_index`; on other
    platforms (CPU, GPU) each process counts as a slice.

    Axes use GSPMD-style `Auto` types so shardings propagate through jit.
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = MeshConfig.AXES
    if config.num_slices == 1:
        shape = config.shape_for(len(devices))
        grid = np.asarray(devices, dtype=object).reshape([shape[a] for a in axes])
    else:
        grid = _hybrid_grid(config, devices)
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def _hybrid_grid(config: MeshConfig, devices: list[jax.Device]) -> np.ndarray:
    ici, dcn = config.slice_shapes(len(devices))
    # TPU devices tell their slice (slice_index, on a multi-slice job); CPU and GPU devices
    # have none, or one for all: JAX's fallback then counts each process as a slice.
    by_slice = devices[0].platform == "tpu"
    slices = {getattr(d, "slice_index", 0) if by_slice else d.process_index for d in devices}
    if len(slices) != config.num_slices:
        unit = "TPU slices" if by_slice else f"processes ({devices[0].platform}: one a slice)"
        raise ConfigError(
            f"mesh {config.shape_for(len(devices))} with num_slices="
            f"{config.num_slices} (dcn_axis {config.dcn_axis}) over {len(devices)} devices "
            f"that lie in {len(slices)} {unit}: run on {config.num_slices} slices, or set "
            f"mesh.num_slices={len(slices)}",
            field="num_slices",
        )
    # allow_split_physical_axes: any factorisation of a slice's chips is a valid mesh, as
    # the one-slice reshape accepts (e.g. tensor 8 over a 4x4 torus).
    return mesh_utils.create_hybrid_device_mesh(
        [ici[a] for a in MeshConfig.AXES],
        [dcn[a] for a in MeshConfig.AXES],
        devices,
        process_is_granule=not by_slice,
        allow_split_physical_axes=True,
    )


# Logical axes placed without a rule in the mesh's logical_axis_rules (a rule there wins):
# the LoRA rank, a handful of columns every device keeps whole.
IMPLICIT_RULES: dict[str, tuple[str, ...]] = {"lora_rank": ()}


def logical_to_spec(
    logical_axes: LogicalAxes,
    rules: Rules,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """The PartitionSpec for an array whose dimensions have these logical names.

    A mesh axis is used at most once per array (later dimensions drop an axis already
    taken). With `shape` and `mesh`, mesh axes that do not divide a dimension are
    dropped, so a small dimension (e.g. 2 KV heads on tensor=4) is replicated instead
    of failing.
    """
    table = {**IMPLICIT_RULES, **dict(rules)}
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        if name is not None and name not in table:
            raise KeyError(
                f"logical axis {name!r} has no rule; add ({name!r}, (...mesh axes...)) to "
                "the mesh's logical_axis_rules"
            )
        mesh_axes = [a for a in table.get(name, ()) if a not in used] if name else []
        if shape is not None and mesh is not None:
            kept: list[str] = []
            size = 1
            for axis in mesh_axes:
                axis_size = mesh.shape[axis]
                if shape[dim] % (size * axis_size) == 0:
                    kept.append(axis)
                    size *= axis_size
                else:
                    _log.info(
                        "dimension %d (%s, size %d) is not divisible by mesh axis %s (%d); "
                        "replicating it along that axis",
                        dim,
                        name,
                        shape[dim],
                        axis,
                        axis_size,
                    )
            mesh_axes = kept
        used.update(mesh_axes)
        spec.append(
            None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)
        )
    return PartitionSpec(*spec)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules) -> Iterator[Mesh]:
    """Make `mesh` and `rules` active: `constrain` then shards activations with them."""
    token = _active.set((mesh, tuple(rules)))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _active.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh made active by `use_mesh`, or None."""
    active = _active.get()
    return None if active is None else active[0]


def logical_spec(logical_axes: LogicalAxes, shape: Sequence[int]) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` under the active mesh and rules (for
    shard_map specs); all-replicated without an active mesh."""
    active = _active.get()
    if active is None:
        return PartitionSpec(*([None] * len(shape)))
    mesh, rules = active
    return logical_to_spec(logical_axes, rules, shape=shape, mesh=mesh)


def target_platform() -> str:
    """The platform code is being traced for: that of the active mesh's devices ("tpu" for
    abstract TPU devices of `rlax-tpu compile` on a CPU host), else JAX's default backend.
    Kernels choose between compiled and interpreted Pallas by this, not by the host."""
    active = _active.get()
    if active is not None:
        return active[0].devices.flat[0].platform
    return jax.default_backend()


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Shard an activation by logical names under the active mesh; identity without one."""
    active = _active.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(logical_axes, rules, shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _variables(state: nnx.State) -> list[nnx.Variable]:
    return jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """A tree like `state` whose leaves are the NamedSharding of each variable."""

    def one(variable: nnx.Variable) -> NamedSharding:
        names = getattr(variable, "logical_axes", None)
        value = variable.get_value()
        if names is None:
            names = (None,) * value.ndim
        if len(names) != value.ndim:
            raise ValueError(
                f"variable of shape {value.shape} has logical axes {names}: one name per dimension"
            )
        return NamedSharding(mesh, logical_to_spec(names, rules, shape=value.shape, mesh=mesh))

    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Place every variable of `model` on `mesh` by its logical axes (in place; returns it)."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    for variable, sharding in zip(_variables(state), jax.tree.leaves(shardings), strict=True):
        variable.set_value(jax.device_put(variable.get_value(), sharding))
    nnx.update(model, state)
    return model


__all__ = [
    "LogicalAxes",
    "Rules",
    "active_mesh",
    "build_mesh",
    "constrain",
    "logical_spec",
    "logical_to_spec",
    "shard_model",
    "target_platform",
    "state_shardings",
    "use_mesh",
]
