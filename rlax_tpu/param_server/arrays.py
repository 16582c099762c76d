"""The JAX side of the parameter-server client: the host bytes of each box a publish sends,
read from a jax.Array's shards (gathered on device where a process does not hold a box
whole), and the device arrays a pull assembles from fetched boxes. Only `publish` and
`pull` import this module, so the client's other calls (the controller's: list, confirm,
garbage-collect, wait) load no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rlax_tpu.api import tensors as layout
from rlax_tpu.api.tensors import Box


# -- publish: host data of each box ----------------------------------------------------------
def host_box(leaf: Any, box: Box) -> np.ndarray:
    """The C-contiguous host copy of `box` of `leaf` (a jax.Array, sharded or not, or numpy).

    A jax.Array is read from this process's shards, each distinct shard once; they must
    cover `box` (`covered_by` says whether a process's do).
    """
    if isinstance(leaf, jax.Array) and len(leaf.addressable_shards) > 1:
        out = np.empty(layout.box_shape(box), dtype=leaf.dtype)
        seen: set[Box] = set()
        for shard in leaf.addressable_shards:
            shard_box = layout.box_from_slices(shard.index, leaf.shape)
            if shard_box in seen:  # a replica of a shard already copied
                continue
            seen.add(shard_box)
            common = layout.intersect(shard_box, box)
            if common is not None:
                data = np.asarray(shard.data)
                out[layout.relative(common, box)] = data[layout.relative(common, shard_box)]
        return out
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        data = leaf.addressable_shards[0]
        shard_box = layout.box_from_slices(data.index, leaf.shape)
        return np.ascontiguousarray(np.asarray(data.data)[layout.relative(box, shard_box)])
    array = np.asarray(leaf)
    return np.ascontiguousarray(array[layout.relative(box, layout.full_box(array.shape))])


def spans_processes(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


def covered_by(leaf: jax.Array, process: int, box: Box) -> bool:
    """Whether the shards on `process`'s devices hold all of `box` of `leaf`."""
    shape = tuple(leaf.shape)
    boxes = {
        layout.box_from_slices(index, shape)
        for device, index in leaf.sharding.devices_indices_map(shape).items()
        if device.process_index == process
    }
    # Distinct shard boxes of a sharding do not overlap, so their parts of `box` add up.
    inside = sum(
        layout.box_size(common)
        for common in (layout.intersect(b, box) for b in boxes)
        if common is not None
    )
    return inside == layout.box_size(box)


_REPLICATED_SLICES: dict[Any, Callable[..., tuple[jax.Array, ...]]] = {}


def _replicated_boxes(leaf: jax.Array, boxes: tuple[Box, ...]) -> tuple[jax.Array, ...]:
    """`boxes` of `leaf` copied to every device of its mesh (a collective: every process of
    the mesh calls it). Only the boxes are gathered, so the device memory this takes is at
    most one array's. Compiled once per shape, sharding and boxes: equal layers share it."""
    sharding = leaf.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise NotImplementedError(
            f"publishing an array sharded by {type(sharding).__name__} across processes; "
            "shard it with a NamedSharding"
        )
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    fn = _REPLICATED_SLICES.get(replicated)
    if fn is None:
        fn = jax.jit(_slice_boxes, static_argnums=1, out_shardings=replicated)
        _REPLICATED_SLICES[replicated] = fn
    return fn(leaf, boxes)


def _slice_boxes(x: jax.Array, boxes: tuple[Box, ...]) -> tuple[jax.Array, ...]:
    return tuple(x[tuple(slice(lo, hi) for lo, hi in box)] for box in boxes)


def multi_process_boxes(
    leaves: Mapping[str, Any], held: Sequence[Mapping[str, Box]], sender: Sequence[int]
) -> dict[tuple[int, str], np.ndarray]:
    """{(replica, path): host data} of the replicas this process sends (`sender[r]` is the
    process that sends replica r's stream).

    A box that its sender's own shards cover is read from them; the others of an array are
    first gathered onto every device (`_replicated_boxes`). Every process takes the same
    decisions in the same order from the global shardings, so the gathers (collectives)
    match up.
    """
    me = jax.process_index()
    out: dict[tuple[int, str], np.ndarray] = {}
    for path in sorted(leaves):
        leaf = leaves[path]
        gather: list[tuple[int, Box]] = []
        for replica, boxes in enumerate(held):
            box = boxes.get(path)
            if box is None:
                continue
            if not spans_processes(leaf) or covered_by(leaf, sender[replica], box):
                if sender[replica] == me:
                    out[(replica, path)] = host_box(leaf, box)
            else:
                gather.append((replica, box))
        if gather:
            gathered = _replicated_boxes(leaf, tuple(box for _, box in gather))
            for (replica, _), data in zip(gather, gathered, strict=True):
                if sender[replica] == me:
                    out[(replica, path)] = np.asarray(data.addressable_data(0))
            del gathered
    return out


# -- pull: device arrays from fetched boxes --------------------------------------------------
def device_boxes(leaf: Any) -> dict[Any, Box]:
    """{device: box} of `leaf` (a jax.Array or jax.ShapeDtypeStruct with a sharding) on this
    process's devices."""
    shape = tuple(leaf.shape)
    index_map = leaf.sharding.addressable_devices_indices_map(shape)
    return {device: layout.box_from_slices(index, shape) for device, index in index_map.items()}


def assemble_all(
    leaves: Mapping[str, Any],
    boxes: Mapping[str, Mapping[Any, Box]],
    fetched: Mapping[tuple[str, Box], np.ndarray],
) -> dict[str, jax.Array]:
    """{path: the jax.Array of `leaves[path]`'s shape, dtype and sharding} from the fetched
    boxes (`fetched[(path, box)]` for each box of `boxes[path]`). Leaves every device of
    which holds the whole array (one device, or replicated) go to their devices in one
    batched transfer; the others shard by shard (`assemble`)."""
    out: dict[str, jax.Array] = {}
    whole = []
    for path, leaf in leaves.items():
        full = layout.full_box(tuple(leaf.shape))
        if leaf.sharding.is_fully_addressable and set(boxes[path].values()) == {full}:
            whole.append(path)
        else:
            shards = {box: fetched[(path, box)] for box in set(boxes[path].values())}
            out[path] = assemble(leaf, boxes[path], shards)
    if whole:
        host = [fetched[(p, layout.full_box(tuple(leaves[p].shape)))] for p in whole]
        host = [h.astype(leaves[p].dtype, copy=False) for h, p in zip(host, whole, strict=True)]
        placed = jax.device_put(host, [leaves[p].sharding for p in whole])
        out.update(zip(whole, placed, strict=True))
    return out


def assemble(leaf: Any, boxes: Mapping[Any, Box], fetched: Mapping[Box, np.ndarray]) -> jax.Array:
    """The jax.Array of `leaf`'s shape, dtype and sharding whose shard on each device of
    `boxes` is `fetched[box]`."""
    arrays = [
        jax.device_put(fetched[box].astype(leaf.dtype, copy=False), device)
        for device, box in boxes.items()
    ]
    return jax.make_array_from_single_device_arrays(tuple(leaf.shape), leaf.sharding, arrays)
