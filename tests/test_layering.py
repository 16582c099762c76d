"""The package's layering, checked by reading every import (top-level and inside functions):
the contract between processes (`rlax_tpu.api`), the data package, the environments and the
controller load no JAX; each layer imports only what it may; a function-local import exists
only where a listed reason asks for it."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlax_tpu"
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "tensorstore")

# What each JAX-free layer may import from rlax_tpu (its own modules besides).
MAY_IMPORT = {
    # Everything that crosses a process boundary: types, codecs, clients, errors.
    "api": {"api", "config", "rpc", "failpoints"},
    # Datasets, tokenizers and chat formats (which read the contract's ToolCall and Message).
    "data": {"data", "api", "config", "storage"},
    # Multi-turn environments and tools, on their contract; the user's modules by name.
    "environments": {"environments", "api", "user_modules"},
    # The controller stands beside the components, on their faces (api), not above them;
    # it steps episodes' environments (JAX-free, like it).
    "controller": {
        "controller",
        "api",
        "data",
        "environments",
        "config",
        "rpc",
        "storage",
        "staleness",
        "run_dir",
        "failpoints",
        "shapes",
    },
}
# The components never import the processes that drive them.
COMPONENTS = ("inference", "trainer", "param_server", "verifiers")
DRIVERS = {"controller", "launch", "cli", "deploy"}

# Function-local imports of rlax_tpu or JAX, by file, each with the reason it is local.
# Optional and heavy third-party modules (pyarrow, wandb, sympy, ...) are not listed: they are
# imported where they are needed so that a missing extra fails only the feature that needs it.
LOCAL_IMPORTS = {
    "cli": "a command loads only what it runs: `config show`, `simulate` and `deploy` load no "
    "JAX, and `--help` answers at once",
    "launch/job.py": "the job process (the controller's) loads the trainer, models and JAX only "
    "for an in-process warm start or export",
    "inference/server.py": "entry point: the process joins its distributed job before the "
    "component (and JAX's backends) load",
    "distributed.py": "sets up the JAX environment, so it must run before JAX is imported",
    "runtime.py": "sets up the JAX environment, so it must run before JAX is imported",
    "rpc/process.py": "a child process sets up its environment before anything loads JAX",
    "inference/steps.py": "compile/programs lowers the engine's steps: the engine reaches the "
    "saved executables only when asked to load them",
    "trainer/programs.py": "compile/programs lowers the trainer's steps: the trainer reaches the "
    "saved executables only when asked to load them",
    "compile/programs.py": "the engine and the trainer load only for the programs asked for",
    "compile/topology.py": "libtpu's topology API loads only when compiling for a TPU topology",
    "compile/cost.py": "the analytical FLOP counts load only for a report that prints them",
    "algorithms/registry.py": "a registered part is added to the package that imports this module",
    "config/loader.py": "checkpoint-model resolution loads only for a config that names one",
    "verifiers/math.py": "the pool (and its processes) load only for judging with timeouts",
    "verifiers/repository.py": "problem parsing loads only when a repository is read",
}


def _modules(layer: str) -> Iterator[Path]:
    root = PACKAGE / layer
    yield from (sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")])


def _parse(path: Path) -> ast.Module:
    """`path`'s syntax tree. CPython 3.11's AST constructor keeps its recursion depth in
    interpreter-wide state, so a parse while another thread of the test process runs Python
    (a component's gRPC or asyncio threads left by an earlier test) can fail with
    "SystemError: AST constructor recursion depth mismatch" (seen once in the suite): a
    parse that fails so is made again."""
    text = path.read_text()
    for attempt in range(5):
        try:
            return ast.parse(text, str(path))
        except SystemError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def _imports(path: Path, *, local_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in `path` (relative imports are not used here)."""
    tree = _parse(path)
    if local_only:
        nodes = [
            sub
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for sub in ast.walk(node)
        ]
    else:
        nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rlax_tpu" and len(parts) > 1 else None


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_a_jax_free_layer_imports_only_what_it_may(layer):
    allowed = MAY_IMPORT[layer]
    bad = []
    for path in _modules(layer):
        for line, module in _imports(path):
            top = module.split(".")[0]
            target = _layer_of(module)
            if top in HEAVY or (top == "rlax_tpu" and target not in allowed and target):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, f"the {layer!r} layer may import only {sorted(allowed)}:\n" + "\n".join(bad)


def test_the_components_never_import_what_drives_them():
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for component in COMPONENTS
        for path in _modules(component)
        for line, module in _imports(path)
        if _layer_of(module) in DRIVERS
    ]
    assert not bad, "\n".join(bad)


def test_function_local_imports_are_only_where_a_reason_is_listed():
    """An import inside a function hides an edge from every tool; it is allowed only where
    LOCAL_IMPORTS says why, for rlax_tpu's own modules and JAX's family."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("rpc/gen/"):
            continue
        listed = relative in LOCAL_IMPORTS or relative.split("/")[0] in LOCAL_IMPORTS
        for line, module in _imports(path, local_only=True):
            if module.split(".")[0] in ("rlax_tpu", *HEAVY) and not listed:
                bad.append(f"rlax_tpu/{relative}:{line} imports {module} inside a function")
    assert not bad, (
        "move these imports to the top of their files, or list the file with its reason in "
        "LOCAL_IMPORTS:\n" + "\n".join(bad)
    )


def test_every_listed_exception_is_still_needed():
    """A listed file that no longer imports anything locally loses its exception."""
    stale = []
    for relative in LOCAL_IMPORTS:
        paths = list(_modules(relative.removesuffix(".py")))
        if not any(
            module.split(".")[0] in ("rlax_tpu", *HEAVY)
            for path in paths
            for _, module in _imports(path, local_only=True)
        ):
            stale.append(relative)
    assert not stale, f"no function-local import left in {stale}: remove them from the list"


def test_the_contract_the_data_the_environments_and_the_controller_load_no_jax():
    """Importing every module of rlax_tpu.api, rlax_tpu.data, rlax_tpu.environments and
    rlax_tpu.controller, in a fresh interpreter, loads none of JAX's family (nor
    TensorStore)."""
    code = f"""
import importlib, pkgutil, sys
for name in ("rlax_tpu.api", "rlax_tpu.data", "rlax_tpu.environments", "rlax_tpu.controller"):
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
