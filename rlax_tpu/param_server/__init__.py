"""The parameter server (DESIGN §3): versioned model weights from the trainer to the workers.

`VersionStore` (`store.py`, over `index.py`, `publish.py`, `persistent.py`, `records.py`)
keeps immutable versions (hot in memory, persisted with TensorStore on a directory or
gs://); `ParamServerServicer` serves it over gRPC; `rlax-tpu serve param-server` runs it as
a process (`server`). Its face — errors, the wire codec, the host-side client — is
`rlax_tpu.api.param_server`; `trees.TreeClient` publishes and pulls pytrees of JAX arrays
(the trainer's and the workers' client, `arrays.py`).
"""

from rlax_tpu.param_server.publish import PublishTransaction
from rlax_tpu.param_server.records import PublishResult, VersionInfo
from rlax_tpu.param_server.server import RunningServer, ServeOptions, start_server
from rlax_tpu.param_server.service import STATUS_CODES, ParamServerServicer
from rlax_tpu.param_server.store import VersionStore

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
