"""The parameter server (DESIGN §3): versioned model weights from the trainer to the workers.

`VersionStore` keeps immutable versions (hot in memory, persisted with TensorStore on a
directory or gs://); `ParamServerServicer` serves it over gRPC; `rlax-tpu serve param-server`
runs it as a process (`server`). `layout` defines pieces, boxes and digests for both ends,
`wire` the codec of the messages carrying bytes, `errors` the errors both ends raise;
`ParamServerClient` talks to it (JAX only for publish and pull, `arrays`). Names load on
first use, so a client does not load the store and TensorStore, nor a server the client's
JAX.
"""

from rlax_tpu.param_server.server import RunningServer, ServeOptions, start_server
from rlax_tpu.param_server.service import STATUS_CODES, ParamServerServicer
from rlax_tpu.param_server.store import (
    PublishResult,
    PublishTransaction,
    VersionInfo,
    VersionStore,
)

__all__ = [
    "STATUS_CODES",
    "ParamServerServicer",
    "PublishResult",
    "PublishTransaction",
    "RunningServer",
    "ServeOptions",
    "VersionInfo",
    "VersionStore",
    "start_server",
]
