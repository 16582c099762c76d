"""Importing the user's own Python modules: reward functions (`module:function`) and
algorithm plugins (modules that register objective parts and presets) are named in a config
as `package.module` (installed, or on PYTHONPATH) or `path/to/file.py` (relative to the
working directory of the process that imports it). JAX-free: the CLI and the controller use
it before JAX starts.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def is_file_spec(module: str) -> bool:
    """Whether `module` names a file (`x.py`, `dir/x`) rather than a dotted module name."""
    return module.endswith(".py") or "/" in module


def describe_exception(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_user_module(module: str, what: str, error: type[Exception]) -> ModuleType:
    """The module `module` (a dotted name or a .py path), imported into this process once.

    A failure raises `error` with a message that starts with `what` (e.g. "reward function
    'pkg.rewards:score'") and says what to fix: no such file, no such module (install it or
    put it on PYTHONPATH, or name the file), or what importing it raised."""
    if is_file_spec(module):
        return _import_file(module, what, error)
    return _import_module(module, what, error)


def _import_file(path_text: str, what: str, error: type[Exception]) -> ModuleType:
    path = Path(path_text).resolve()  # a relative path is relative to the working directory
    if not path.is_file():
        raise error(
            f"{what}: no file {str(path)!r} (paths are relative to the working directory, "
            f"{str(Path.cwd())!r})"
        )
    # One module per file, under a private name: the file is executed once per process.
    name = "_rlax_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, MemoryError | KeyboardInterrupt):
            raise
        raise error(f"{what}: importing {str(path)!r} raised {describe_exception(exc)}") from exc
    return module


def _import_module(name: str, what: str, error: type[Exception]) -> ModuleType:
    if not all(part.isidentifier() for part in name.split(".")):
        raise error(
            f"{what}: {name!r} is neither a module name ('package.module') nor a path to a .py file"
        )
    try:
        return importlib.import_module(name)
    except BaseException as exc:
        if isinstance(exc, MemoryError | KeyboardInterrupt):
            raise
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing and (name == missing or name.startswith(missing + ".")):
            raise error(
                f"{what}: no module named {missing!r} (install it, put its directory on "
                "PYTHONPATH of the process that loads it, or name the file: "
                "'path/to/file.py')"
            ) from exc
        raise error(f"{what}: importing {name!r} raised {describe_exception(exc)}") from exc
