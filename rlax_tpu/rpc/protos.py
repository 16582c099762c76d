"""Generated protobuf/gRPC modules under short names (`from rlax_tpu.rpc.protos import common_pb2`).

The build generates them (setup.py runs tools/gen_protos.py). In a source tree that was never
built, or whose .proto files changed since, they are (re)generated here on first import.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the repository, when run from source
_SCRIPT = _SOURCE_ROOT / "tools" / "gen_protos.py"


def _gen_protos_script() -> ModuleType | None:
    """tools/gen_protos.py as a module, or None outside a source tree (an installed wheel)."""
    if not (_SCRIPT.is_file() and (_SOURCE_ROOT / "protos").is_dir()):
        return None
    spec = importlib.util.spec_from_file_location("rlax_tpu_gen_protos", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_generated() -> None:
    """Generate rlax_tpu/rpc/gen from protos/ if it is missing or older than the .proto files."""
    gen = _gen_protos_script()
    if gen is None or gen.is_current():
        return
    try:
        gen.generate()
    except gen.ProtoGenError as e:
        raise ImportError(f"rlax_tpu.rpc.gen is missing or stale and cannot be rebuilt: {e}") from e
    importlib.invalidate_caches()


ensure_generated()

from rlax_tpu.rpc.gen.rlax_tpu.v1 import (  # noqa: E402
    common_pb2,
    common_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    param_server_pb2,
    param_server_pb2_grpc,
    tensorboard_pb2,
    trainer_pb2,
    trainer_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

__all__ = [
    "common_pb2",
    "common_pb2_grpc",
    "ensure_generated",
    "inference_pb2",
    "inference_pb2_grpc",
    "param_server_pb2",
    "param_server_pb2_grpc",
    "tensorboard_pb2",
    "trainer_pb2",
    "trainer_pb2_grpc",
    "verifier_pb2",
    "verifier_pb2_grpc",
]
