"""Tree paths: one naming of a pytree's leaves ("layers/0/attn/wq") shared by the parameter
server's wire format, checkpoints and sharding plans."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flatten(tree: Any) -> dict[str, Any]:
    """{"layers/0/attn/wq": leaf, ...} for a pytree (e.g. nnx.to_pure_dict of a model's params)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}
    if len(out) != len(leaves):
        raise ValueError("two leaves of the tree have the same path; paths must be unique")
    return out


def unflatten_like(like: Any, values: Mapping[str, Any]) -> Any:
    """A tree with the structure of `like` whose leaves are `values[path]`."""
    paths = list(flatten(like))
    treedef = jax.tree_util.tree_structure(like)
    return jax.tree_util.tree_unflatten(treedef, [values[p] for p in paths])
