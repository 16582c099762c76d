"""Compiled programs saved by `rlax-tpu compile --save-compiled DIR` and loaded by the run.

A pod's first train step compiles for minutes; `rlax-tpu compile` has already compiled the
same programs for the same topology. It can keep them: each executable is serialised
(`jax.experimental.serialize_executable`) beside a manifest entry that says what it is — the
program, the devices it was compiled for (platform, kind, count) and the mesh, the
sha256 of the lowered program's text, the config digest, and the jax/jaxlib versions.
The trainer (`trainer.compiled_dir`) lowers its own program at the same shapes and loads
the saved executable only when every one of those agrees; otherwise it refuses to start,
naming what differs (a mesh or topology other than the one compiled for, a program
changed by the config, another JAX). A program the manifest does not hold is compiled as
usual.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax._src import config as jax_config  # enable_compilation_cache: no public context
from jax.experimental import serialize_executable

MANIFEST = "manifest.json"


class CompiledMismatchError(RuntimeError):
    """A saved executable is not the program this process would run; says what differs."""


def program_key(name: str, lowered: jax.stages.Lowered, mesh: jax.sharding.Mesh) -> dict:
    """What a saved executable must agree on to stand in for `lowered` on `mesh`."""
    device = mesh.devices.flat[0]
    return {
        "program": name,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "num_devices": int(mesh.devices.size),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "program_sha256": hashlib.sha256(lowered.as_text().encode()).hexdigest(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }


def compile_to_save(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """Compile `lowered` past the persistent compilation cache, for `save`. An executable
    the cache answers is itself a deserialised one, and XLA:CPU (jaxlib 0.10) serialises
    such an executable without its kernels: loaded again, its first call fails with
    "Function wrapped_broadcast not found". A fresh compile serialises whole."""
    with jax_config.enable_compilation_cache(False):
        return lowered.compile()


def save(
    directory: str | Path,
    name: str,
    lowered: jax.stages.Lowered,
    compiled: jax.stages.Compiled,
    mesh: jax.sharding.Mesh,
    *,
    config_digest: str,
) -> Path:
    """Write `compiled` (of `lowered`, for `mesh`; from `compile_to_save`) as `name` into
    `directory` and its manifest entry; returns the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    path = directory / f"{name}.executable"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps((payload, in_tree, out_tree)))
    tmp.replace(path)
    manifest = _manifest(directory)
    manifest[name] = {
        **program_key(name, lowered, mesh),
        "config_digest": config_digest,
        "file": path.name,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return path


def _manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def saved_names(directory: str | Path) -> set[str]:
    """The programs `directory` holds executables of (its manifest's names)."""
    return set(_manifest(Path(directory)))


def load(
    directory: str | Path,
    name: str,
    lowered: jax.stages.Lowered,
    mesh: jax.sharding.Mesh,
) -> Callable[..., Any] | None:
    """The saved executable of `name` for `lowered` on `mesh`, loaded onto the mesh's
    devices; None when the directory holds none of that name. CompiledMismatchError, naming
    every field that differs, when it holds one for another program, mesh or JAX."""
    directory = Path(directory)
    entry = _manifest(directory).get(name)
    if entry is None:
        return None
    want = program_key(name, lowered, mesh)
    differ = [k for k in want if entry.get(k) != want[k]]
    if differ:
        what = "; ".join(f"{k}: saved {entry.get(k)!r}, this run {want[k]!r}" for k in differ)
        raise CompiledMismatchError(
            f"the executable of {name} in {directory} was compiled for another program or "
            f"machine ({what}): compile this config for its topology again with "
            "`rlax-tpu compile CONFIG --save-compiled DIR`, or unset trainer.compiled_dir to "
            "compile at start-up"
        )
    payload, in_tree, out_tree = pickle.loads((directory / entry["file"]).read_bytes())
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=list(mesh.devices.flat)
    )


class SavedProgram:
    """A saved executable (rlax-tpu compile --save-compiled) in place of a jitted program:
    it runs the calls at the shapes and static arguments it was compiled for, the jitted
    program (compiling as usual) every other call."""

    def __init__(self, executable: Any, jitted: Any, args: tuple, static: tuple[int, ...]):
        self.executable, self.jitted, self.static = executable, jitted, static
        self._static_values = tuple(args[i] for i in static)
        self._signature = self._shapes([a for i, a in enumerate(args) if i not in static])
        self.calls = 0  # calls the saved executable ran

    @staticmethod
    def _shapes(args: Any) -> Any:
        return [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args)]

    def __call__(self, *args: Any) -> Any:
        dynamic = [a for i, a in enumerate(args) if i not in self.static]
        same = tuple(args[i] for i in self.static) == self._static_values
        if same and self._shapes(dynamic) == self._signature:
            self.calls += 1
            return self.executable(*dynamic)
        return self.jitted(*args)
