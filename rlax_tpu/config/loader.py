"""Loading runnable configs (`configs/*.py` with `get_config()`, or a run's config.json dump)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import TypeVar

from rlax_tpu.config.base import ConfigError
from rlax_tpu.config.run import RENAMED_FIELDS, RunConfig

T = TypeVar("T")


def load_config(
    source: str, overrides: list[str] | tuple[str, ...] = (), *, resolve: bool = True
) -> RunConfig:
    """Read a config from a Python file exposing `get_config()` or from a JSON dump, then
    apply `key=value` overrides in order; `model.hf_checkpoint` then fills the model's
    architecture (rlax_tpu.config.checkpoint), unless `resolve` is False (the caller
    resolves it, after changes of its own: `rlax-tpu run --trial`)."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"config file {source!r} does not exist; pass a configs/*.py file or a run's "
            "config.json"
        )
    if path.suffix == ".py":
        config = _from_python(path)
    elif path.suffix == ".json":
        config = RunConfig.from_dict(json.loads(path.read_text()))
    else:
        raise ConfigError(f"config file {source!r} must end in .py or .json")
    config = config.apply_overrides(overrides)
    if not resolve:
        return config
    from rlax_tpu.config.checkpoint import resolve_checkpoint_model

    return resolve_checkpoint_model(config)


def load_fragment(source: str | Path, kind: type[T]) -> T:
    """A part of a config from a Python file exposing `get_config()` that returns a `kind`
    (configs/models/*.py: a ModelConfig), for recipes to compose: the same model is then
    written once for every recipe that trains it."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config fragment {str(source)!r} does not exist")
    fragment = _get_config(path)
    if not isinstance(fragment, kind):
        raise ConfigError(
            f"{path}: get_config() returned {type(fragment).__name__}, expected {kind.__name__}"
        )
    return fragment


def _from_python(path: Path) -> RunConfig:
    config = _get_config(path)
    if not isinstance(config, RunConfig):
        raise ConfigError(
            f"{path}: get_config() returned {type(config).__name__}, expected RunConfig"
        )
    return config


def _get_config(path: Path) -> object:
    module_name = f"rlax_tpu_config_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(module_name, None)
    get_config = getattr(module, "get_config", None)
    if get_config is None:
        raise ConfigError(f"{path} has no get_config() function")
    try:
        return get_config()
    except TypeError as e:
        moved = _renamed_keyword(str(e))
        if moved is None:
            raise
        raise ConfigError(
            f"{path}: {e}. That field moved into a section: "
            + "; ".join(f"{old} is now {new}" for old, new in moved)
            + " (--set and config.json files still take the old path, Python code the new one)"
        ) from e


def _renamed_keyword(message: str) -> list[tuple[str, str]] | None:
    """The (old, new) paths of RENAMED_FIELDS whose old name is the keyword a config class
    refused in `message` (a TypeError of its __init__), or None."""
    match = re.search(r"unexpected keyword argument '(\w+)'", message)
    if match is None:
        return None
    name = match.group(1)
    moved = [(old, new) for old, new in RENAMED_FIELDS.items() if old.split(".")[-1] == name]
    return moved or None
