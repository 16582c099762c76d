"""The parameter-server client of the JAX processes (the trainer, the inference workers):
`publish(version, tree)` sends a pytree of arrays (JAX arrays, sharded or not, or numpy) to
every replica, each getting the pieces it holds; `pull(version, like)` fills a pytree with the
shardings of `like`, asking each replica only for the boxes this process's devices hold, so a
tensor-parallel worker moves only its slices. Both work in a multi-host job (arrays spanning
processes): every process calls them with the same global tree. The host side (boxes,
bookkeeping) is the JAX-free `rlax_tpu.api.param_server.ParamServerClient`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rlax_tpu.api.param_server import ParamServerCallError, ParamServerClient, PublishReceipt
from rlax_tpu.api.tensors import Box
from rlax_tpu.param_server import arrays
from rlax_tpu.tree import flatten, unflatten_like


class TreeClient(ParamServerClient):
    """A ParamServerClient that publishes and pulls pytrees of (sharded) arrays."""

    def publish(self, version: int, tree: Any) -> PublishReceipt:
        """Publish `tree` as `version` to every replica (atomic per replica; idempotent).

        Multi-host (leaves span several processes): every process of the job calls this with
        its global arrays. Replica r's stream is sent by process r mod P, which reads its box
        of each array from its own shards or, where they do not hold it all, from an
        on-device gather of that box; every byte goes to each replica once. The receipt
        covers every process's streams.
        """
        leaves = flatten(tree)
        shapes = {path: tuple(np.shape(leaf)) for path, leaf in leaves.items()}
        held = self.plan.boxes(shapes)
        if any(arrays.spans_processes(leaf) for leaf in leaves.values()):
            return self._publish_multi_process(version, leaves, shapes, held)
        return self.publish_boxes(
            version,
            range(self.num_replicas),
            shapes,
            held,
            lambda replica, path: arrays.host_box(leaves[path], held[replica][path]),
        )

    def _publish_multi_process(
        self,
        version: int,
        leaves: Mapping[str, Any],
        shapes: Mapping[str, tuple[int, ...]],
        held: Sequence[Mapping[str, Box]],
    ) -> PublishReceipt:
        """Every process sends its replicas' streams; then all learn how every stream went
        (a collective), so that publish returns in every process only once the version is
        committed on every replica, and fails in every process if any stream failed."""
        count, me = jax.process_count(), jax.process_index()
        sender = [r % count for r in range(self.num_replicas)]
        error: BaseException | None = None
        receipt = PublishReceipt(version=version, already_present=True, bytes_sent=0)
        try:
            host = arrays.multi_process_boxes(leaves, held, sender)
            mine = [r for r in range(self.num_replicas) if sender[r] == me]
            receipt = self.publish_boxes(
                version, mine, shapes, held, lambda replica, path: host.pop((replica, path))
            )
        except Exception as e:  # reported to every process below, then raised here
            error = e
        status = np.array(
            [error is None, receipt.already_present, receipt.bytes_sent], dtype=np.int64
        )
        every = np.asarray(multihost_utils.process_allgather(status)).reshape(count, 3)
        if error is not None:
            raise error
        failed = [p for p in range(count) if not every[p, 0]]
        if failed:
            raise ParamServerCallError(
                f"publish of version {version} failed in process(es) {failed} of this "
                "multi-host job; their logs say why"
            )
        return PublishReceipt(
            version=version,
            already_present=bool(every[:, 1].all()),
            bytes_sent=int(every[:, 2].sum()),
        )

    def fetch(
        self, version: int, like: Any, wait_s: float = 0.0
    ) -> dict[tuple[str, Box], np.ndarray]:
        """The first half of `pull`: the host bytes of every box of this process's devices
        under `like`'s shardings ({(path, box): array}), checked against the published
        arrays. `place` puts them on the devices. An inference worker fetches the next
        version it will load while it generates (`wait_s`: see `pull_boxes`)."""
        targets = flatten(like)
        self._check_like(targets)
        wanted = {
            path: sorted(set(arrays.device_boxes(leaf).values())) for path, leaf in targets.items()
        }
        return self.pull_boxes(version, wanted, wait_s)

    def place(self, fetched: Mapping[tuple[str, Box], np.ndarray], like: Any) -> Any:
        """The second half of `pull`: a tree like `like` on its devices from `fetch`'s
        bytes."""
        targets = flatten(like)
        device_boxes = {path: arrays.device_boxes(leaf) for path, leaf in targets.items()}
        return unflatten_like(like, arrays.assemble_all(targets, device_boxes, fetched))

    def pull(self, version: int, like: Any, wait_s: float = 0.0) -> Any:
        """A tree like `like` (leaves with .shape, .dtype, .sharding: jax arrays or
        jax.ShapeDtypeStruct) holding `version`, placed with `like`'s shardings.

        Only the boxes of this process's devices are fetched. With `wait_s` > 0, a version not
        yet committed is waited for, that long at most (`pull_boxes`). The arrays are not converted:
        a leaf of `like` whose shape or dtype differs from the array the server holds is a
        PullMismatchError, before any byte moves (build the model to pull into with
        `ModelConfig.served()`, the published dtype).
        """
        return self.place(self.fetch(version, like, wait_s), like)
