"""Co-location (`inference.colocated`): the trainer and one inference worker in one process,
on the same devices, as Tunix and verl's hybrid engine run on one host.

The trainer hands each version it publishes to the worker here: the device arrays it
publishes (its params cast to the published dtype, or, uncast, the params themselves, which
a co-located trainer's RL step writes beside rather than over: TrainerPrograms.rl_step).
The worker's load places those arrays on its own mesh (no copy where the trainer's sharding
is the worker's) instead of pulling bytes over gRPC.

With inference.colocated_publish "every", the trainer also sends every version to the
parameter server, in the background after an RL step, so the server holds what it holds in a
disaggregated run. With "needed" (the default) it sends only what a reader of the server
may rely on: at each checkpoint the versions a resume from it generates with (those not sent
yet are still held here), a version a resume may still generate with after it is no longer
held (max_staleness >= 2 * reload_every: sent in the background at its publish), and the
run's last version; a send in the background contends with the worker's load and generation
for the host's cores (docs/controller.md, "Co-located").
`wait_sent` orders what reads the server after a handed version (a worker's confirmation, a
pull of a version no longer held here).

Only the newest `keep` versions are held (each is one copy of the served weights on the
devices); an older one is pulled from the parameter server as before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any

# The newest published version and the one before: what a co-located worker loads next.
DEFAULT_KEEP = 2


def sent_already() -> concurrent.futures.Future:
    """A future that is done: a version the parameter server already holds (or that no
    parameter server is to hold)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(None)
    return future


class SharedVersions:
    """Published versions handed from a trainer to a worker in the same process."""

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._sent: dict[int, concurrent.futures.Future] = {}
        self.handed = 0  # versions taken from here by a load

    def put(self, version: int, params: Any, sent: concurrent.futures.Future) -> None:
        """Hold `params` (device arrays the trainer will not change) as `version`; `sent`
        completes once the parameter server holds it (or its send failed)."""
        with self._lock:
            self._held.pop(version, None)
            self._held[version] = params
            while len(self._held) > self.keep:
                self._held.popitem(last=False)
            self._sent[version] = sent
            for done in [v for v, f in self._sent.items() if f.done() and v != version]:
                del self._sent[done]

    def take(self, version: int) -> Any | None:
        """The arrays of `version` if held here, else None (pull it: `wait_sent` first)."""
        with self._lock:
            params = self._held.get(version)
            self.handed += params is not None
            return params

    def held(self, version: int) -> Any | None:
        """The arrays of `version` if held here (for the trainer to send), else None."""
        with self._lock:
            return self._held.get(version)

    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        with self._lock:
            return list(self._held)

    def wait_sent(self, version: int) -> None:
        """Until every send of a version <= `version` has ended (sent or failed: a failed one
        is sent again by the trainer before its next step)."""
        with self._lock:
            pending = [f for v, f in self._sent.items() if v <= version]
        concurrent.futures.wait(pending)
