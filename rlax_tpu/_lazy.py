"""Lazy package exports: a package names what others may use at its top, but a name is
imported from its submodule only when first used. So `import rlax_tpu.inference.client`
(the controller's view of a worker) does not load the engine, JAX and Flax that
`from rlax_tpu.inference import Engine` needs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`, where `exports` maps each public name to the
    submodule (relative to the package) that defines it.

    The first lookup of a name imports its submodule and binds every export of that
    submodule in the package. Importing a submodule binds the submodule under its own name
    in the package, so an export named like its submodule (`algorithms.objective`, a
    function in objective.py) is bound after the import, replacing the module there."""
    by_module: dict[str, list[str]] = {}
    for name, module in exports.items():
        by_module.setdefault(module, []).append(name)

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{module_name}")
        namespace = sys.modules[package].__dict__
        for export in by_module[module_name]:  # later lookups skip this function
            namespace[export] = getattr(module, export)
        return namespace[name]

    def __dir__() -> list[str]:
        return sorted({*exports, *sys.modules[package].__dict__})

    return __getattr__, __dir__
