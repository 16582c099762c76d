"""An inference worker's side of the parameter server: the layout of the served params it
pulls into, pulls, and the next loadable version fetched into host memory while the worker
generates (`inference.prefetch_weights`), so that its load only places bytes on devices.
A worker co-located with its trainer (`inference.colocated`) takes the versions the trainer
handed it in this process (rlax_tpu.colocation) and pulls only those no longer held."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rlax_tpu.api.inference import NoParamServerError, PullFailedError, UnknownVersionError
from rlax_tpu.api.param_server import ParamServerCallError, PullMismatchError
from rlax_tpu.colocation import SharedVersions
from rlax_tpu.config import RunConfig
from rlax_tpu.models import Transformer, lora, lora_base, quantization
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.sharding import state_shardings

_log = logging.getLogger(__name__)

# A prefetch waits for the next version in calls of this length, until the version comes or
# the prefetch is abandoned (a load of another version), so an abandoned one ends soon.
PREFETCH_WAIT_S = 5.0


def _keys(path: tuple) -> tuple:
    return tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)


class WeightFetcher:
    """Pulls versions into the served params' layout (`like()`), and prefetches the next one.

    `stopped()` tells a prefetch waiting for its version to give up (the worker failed)."""

    def __init__(
        self,
        config: RunConfig,
        param_server: TreeClient | None,
        *,
        mesh: Mesh | None,
        stopped: Callable[[], bool],
        shared: SharedVersions | None = None,
    ) -> None:
        self.config, self.param_server, self.mesh = config, param_server, mesh
        self.shared = shared  # co-located: the versions the trainer in this process handed
        self._stopped = stopped
        self._like: Any = None  # the param tree's shapes and shardings, built on first use
        # LoRA (model.lora): versions hold the adapters and their base's digest; the base is
        # read once from the run's base store (rlax_tpu.models.lora_base) and kept here.
        self.lora = config.model.lora is not None
        self._base: Any = None
        self._base_digest: bytes | None = None
        self._pull_like: Any = None  # what a LoRA version pulls into (`like`), built once
        self._parts: tuple | None = None  # (adapters, base) of full_like(), abstract
        self.base_loads = 0  # bases read from the base store
        # The next version's bytes, fetched while generating: (version, future of
        # TreeClient.fetch), or None.
        self._prefetch: tuple[int, concurrent.futures.Future] | None = None
        self.prefetched_loads = 0  # loads placed from prefetched bytes

    @property
    def pending(self) -> tuple[int, concurrent.futures.Future] | None:
        """The prefetch under way: (version, future of its host bytes), or None."""
        return self._prefetch

    def drop_prefetch(self) -> None:
        """Forget the prefetch: one still waiting stops at its next call."""
        self._prefetch = None

    def like(self) -> Any:
        """What a version pulls into: the served model's param pure dict (`ModelConfig.served`:
        the published dtype) as jax.ShapeDtypeStruct leaves with the shardings the engine
        uses: the inference mesh's (by logical axes), else the first device. With LoRA the
        adapters alone, packed in one flat array (`lora.PACKED_KEY`, models.lora.pack), and
        the base's digest (`lora_base.DIGEST_KEY`, uint8[32])."""
        if not self.lora:
            return self.full_like()
        if self._pull_like is not None:
            return self._pull_like
        adapters = self._lora_parts()[0]
        dtype = jax.tree.leaves(adapters)[0].dtype
        packed = (lora.packed_size(adapters),)
        self._pull_like = {
            lora.PACKED_KEY: jax.ShapeDtypeStruct(packed, dtype, sharding=self._replicated()),
            lora_base.DIGEST_KEY: jax.ShapeDtypeStruct(
                (32,), np.uint8, sharding=self._replicated()
            ),
        }
        return self._pull_like

    def _lora_parts(self) -> tuple[Any, Any]:
        """(adapters, base) of the served model's abstract tree, split once."""
        if self._parts is None:
            self._parts = lora.split(self.full_like())
        return self._parts

    def _replicated(self) -> Any:
        if self.mesh is not None:
            return NamedSharding(self.mesh, PartitionSpec())
        return SingleDeviceSharding(jax.devices()[0])

    def complete(self, pulled: Any) -> Any:
        """The whole params tree of a pulled version: itself, or with LoRA its adapters on
        the base its digest names (read from the base store when it is not the one held)."""
        if not self.lora:
            return pulled
        pulled = dict(pulled)
        digest = lora_base.digest_of_leaf(pulled.pop(lora_base.DIGEST_KEY))
        if digest != self._base_digest:
            store = lora_base.LoraBaseStore(self.config.storage.run_dir)
            try:
                base = store.read(digest, self._lora_parts()[1])
            finally:
                store.close()
            if self.config.inference.weight_dtype:
                # Served quantized: the engine keeps the projections' int8/fp8 copies, made
                # once from these same arrays (ServedWeights), so the published-dtype ones
                # stay on the host, not beside them on the devices.
                base = jax.tree_util.tree_map_with_path(
                    lambda path, x: np.asarray(x) if quantization.is_projection(_keys(path)) else x,
                    base,
                )
            self._base = base
            self._base_digest = digest
            self.base_loads += 1
        adapters = lora.unpack(pulled[lora.PACKED_KEY], self._lora_parts()[0])
        return lora.combine(self._base, adapters)

    def full_like(self) -> Any:
        """The served model's whole param tree, abstract (see `like`)."""
        if self._like is None:
            served = self.config.model.served()
            abstract = nnx.eval_shape(lambda: Transformer(served, rngs=nnx.Rngs(0)))
            state = nnx.state(abstract, nnx.Param)
            if self.mesh is not None:
                rules = self.config.inference.mesh.logical_axis_rules
                shardings = nnx.to_pure_dict(state_shardings(state, self.mesh, rules))
            else:
                device = SingleDeviceSharding(jax.devices()[0])
                shardings = jax.tree.map(lambda _: device, nnx.to_pure_dict(state))
            self._like = jax.tree.map(
                lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                nnx.to_pure_dict(state),
                shardings,
            )
        return self._like

    def start_prefetch(self, following: int) -> None:
        """Fetch the next loadable version into host memory in the background; the
        parameter server sends it as it commits (a head start for the next load only: the
        load pulls as usual when this fails or the controller asks for another version)."""
        if (
            self.param_server is None
            or not self.config.inference.prefetch_weights
            or self.shared is not None  # co-located: the next version is handed, not fetched
        ):
            return
        like = self.like()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def fetch() -> None:
            while True:
                try:
                    fetched = self.param_server.fetch(following, like, PREFETCH_WAIT_S)
                except ParamServerCallError as e:
                    pending = self._prefetch  # read once: a load may take it meanwhile
                    wanted = pending is not None and pending[1] is future
                    if e.code == grpc.StatusCode.NOT_FOUND and wanted and not self._stopped():
                        continue  # not published yet: wait on
                    future.set_exception(e)
                except BaseException as e:  # noqa: BLE001 - handed to the load that wants it
                    future.set_exception(e)
                else:
                    future.set_result(fetched)
                return

        self._prefetch = (following, future)
        # A daemon thread: a fetch still waiting for its version must not hold up the
        # process's exit.
        threading.Thread(target=fetch, name="inference-prefetch", daemon=True).start()

    def prefetched(self, version: int) -> Any:
        """`version` on the devices from the prefetched bytes, if those are `version`'s
        (waiting for a fetch still under way); else None."""
        pending, self._prefetch = self._prefetch, None
        if pending is None or pending[0] != version:
            return None
        try:
            fetched = pending[1].result()
        except Exception as e:  # noqa: BLE001 - the load pulls as usual and says why
            _log.debug("prefetching version %d failed (%s); pulling it", version, e)
            return None
        self.prefetched_loads += 1
        return self.complete(self.param_server.place(fetched, self.like()))

    def wait_sent(self, version: int) -> None:
        """Co-located: until the trainer's sends of versions <= `version` to the parameter
        server have ended, so that what reads the server finds them."""
        if self.shared is not None:
            self.shared.wait_sent(version)

    def pull(self, version: int) -> Any:
        """`version`'s whole params tree: handed by a co-located trainer if it holds it, else
        pulled from the parameter server (placed as `like()` says)."""
        if self.shared is not None:
            handed = self.shared.take(version)
            if handed is not None:
                return self.complete(handed)
            self.shared.wait_sent(version)
        if self.param_server is None:
            raise NoParamServerError(
                "this worker has no parameter server to pull weights from (start it with "
                "--param-server ADDR)"
            )
        try:
            pulled = self.param_server.pull(version, self.like())
        except PullMismatchError as e:  # this worker's config is not the trainer's
            raise PullFailedError(f"version {version} cannot be loaded: {e}") from e
        except ParamServerCallError as e:
            missing = e.code == grpc.StatusCode.NOT_FOUND
            if e.code is None:  # e.g. nothing published yet: no layout to pull from
                try:
                    missing = version not in self.param_server.versions()
                except ParamServerCallError:
                    pass
            if missing:
                raise UnknownVersionError(
                    f"version {version} is not on the parameter server ({e})"
                ) from e
            raise PullFailedError(f"pulling version {version} failed: {e}") from e
        try:
            return self.complete(pulled)
        except lora_base.BaseMismatchError as e:
            raise PullFailedError(f"version {version} cannot be loaded: {e}") from e
