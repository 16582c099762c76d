"""The parameter-server client used by the trainer (publish), inference workers (pull) and
the controller (list, confirm, garbage-collect, wait for persistence).

`publish(version, tree)` sends a pytree of arrays (JAX arrays, sharded or not, or numpy)
to every replica, each getting the pieces it holds. `pull(version, like)` fills a pytree
with the shardings of `like`, asking each replica only for the boxes this process's
devices hold, so a tensor-parallel worker moves only its slices. Both work in a multi-host
job (arrays spanning processes): every process calls them with the same global tree.
Only those two load JAX (`param_server.arrays`, `rlax_tpu.tree`): the controller's process
imports this module without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from rlax_tpu.failpoints import failpoint
from rlax_tpu.param_server import layout
from rlax_tpu.param_server.errors import ParamServerError, PullMismatchError
from rlax_tpu.param_server.layout import Box, Piece
from rlax_tpu.param_server.wire import decode_pull_chunks, encode_piece_chunks, pack
from rlax_tpu.rpc import make_channel
from rlax_tpu.rpc.client import RpcCallError, retry_unreachable
from rlax_tpu.rpc.protos import param_server_pb2 as pb
from rlax_tpu.rpc.protos import param_server_pb2_grpc as pb_grpc

DEFAULT_CHUNK_BYTES = 2 * 2**20


# -- replica partitioning -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """Which box of each array each parameter-server replica holds.

    Arrays with a split dimension (usually the tensor-parallel one) are cut into
    `num_replicas` equal slabs along it, so a tensor-parallel worker pulls each of its
    shards from the replica that holds it; other arrays (and those that do not divide)
    go whole to one replica, assigned round-robin in path order.
    """

    num_replicas: int = 1
    split_dims: Mapping[str, int | None] = dataclasses.field(default_factory=dict)

    def boxes(self, shapes: Mapping[str, Sequence[int]]) -> list[dict[str, Box]]:
        """For each replica, {path: box} of what it holds."""
        per_replica: list[dict[str, Box]] = [{} for _ in range(self.num_replicas)]
        turn = 0
        for path in sorted(shapes):
            shape = tuple(shapes[path])
            full = layout.full_box(shape)
            dim = self.split_dims.get(path)
            r = self.num_replicas
            if r > 1 and dim is not None and shape and shape[dim] % r == 0:
                step = shape[dim] // r
                for i in range(r):
                    box = list(full)
                    box[dim] = (i * step, (i + 1) * step)
                    per_replica[i][path] = tuple(box)
            else:
                per_replica[turn % r][path] = full
                turn += 1
        return per_replica


def replica_plan_for_model(
    model: Any, rules: Sequence[tuple[str, Sequence[str]]], num_replicas: int
) -> ReplicaPlan:
    """Split a model's parameters across replicas along the dimension `rules` shard over
    the tensor axis, so a tensor-parallel worker pulls each slice from one replica.
    `model` is a ModelConfig."""
    from rlax_tpu.models.transformer import param_logical_axes

    split = split_dims_from_logical(param_logical_axes(model), rules)
    return ReplicaPlan(num_replicas=num_replicas, split_dims=split)


def split_dims_from_logical(
    logical_axes: Mapping[str, Sequence[str | None]],
    rules: Sequence[tuple[str, Sequence[str]]],
    mesh_axis: str = "tensor",
) -> dict[str, int | None]:
    """The dimension of each array that the rules shard over `mesh_axis` (None if none)."""
    table = dict(rules)
    out: dict[str, int | None] = {}
    for path, names in logical_axes.items():
        out[path] = next(
            (d for d, n in enumerate(names) if n is not None and mesh_axis in table.get(n, ())),
            None,
        )
    return out


@dataclasses.dataclass(frozen=True)
class PublishReceipt:
    version: int
    already_present: bool  # every replica already had this content
    bytes_sent: int


class ParamServerCallError(RpcCallError, ParamServerError):
    """A parameter-server call failed; the message carries the server's explanation and
    `code` its gRPC status."""


class VersionsMissingError(ParamServerCallError):
    """`wait_persisted`: a replica does not hold `missing` (NOT_FOUND): a server that restarted
    lost what was not on storage yet."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message, code=grpc.StatusCode.NOT_FOUND)
        self.missing = list(missing)


def _raise_from(e: grpc.RpcError, what: str) -> ParamServerCallError:
    return ParamServerCallError.from_rpc(e, what)


def _serialized(message: bytes) -> bytes:
    return message


class ParamServerClient:
    """Talks to the replicas of one parameter server (addresses in replica order)."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        auth_token: str,
        plan: ReplicaPlan | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 600.0,
        reconnect_s: float = 0.0,
        on_retry: Callable[[str], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """`reconnect_s`: how long each call waits for a replica that does not answer (down
        or restarting: it recovers its committed versions from storage) before it fails;
        every call is idempotent, so it is simply made again. 0: fail at once. `stop` set
        (the caller is stopping) ends such a wait at once."""
        if not addresses:
            raise ValueError("ParamServerClient needs at least one replica address")
        self.plan = plan or ReplicaPlan(num_replicas=len(addresses))
        if self.plan.num_replicas != len(addresses):
            raise ValueError(
                f"the replica plan has {self.plan.num_replicas} replicas but "
                f"{len(addresses)} addresses were given"
            )
        self.addresses = list(addresses)
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.reconnect_s, self._on_retry, self._stop = reconnect_s, on_retry, stop
        self._channels = [make_channel(a, auth_token=auth_token) for a in addresses]
        self._stubs = [pb_grpc.ParamServerStub(c) for c in self._channels]
        # The messages carrying bytes are serialized and parsed by hand, without copying
        # the bytes more than once (param_server.wire).
        self._publishes = [
            c.stream_unary(
                "/rlax_tpu.v1.ParamServer/Publish",
                request_serializer=_serialized,
                response_deserializer=pb.PublishReply.FromString,
            )
            for c in self._channels
        ]
        self._pulls = [
            c.unary_stream(
                "/rlax_tpu.v1.ParamServer/Pull",
                request_serializer=pb.PullRequest.SerializeToString,
                response_deserializer=decode_pull_chunks,
            )
            for c in self._channels
        ]
        self._held: list[dict[str, Piece]] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(addresses)))
        self.bytes_pulled = 0  # payload bytes received by pulls (for benchmarks and metrics)
        self._count_lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> ParamServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publish --------------------------------------------------------------------------
    def publish(self, version: int, tree: Any) -> PublishReceipt:
        """Publish `tree` as `version` to every replica (atomic per replica; idempotent).

        Multi-host (leaves span several processes): every process of the job calls this with
        its global arrays. Replica r's stream is sent by process r mod P, which reads its box
        of each array from its own shards or, where they do not hold it all, from an
        on-device gather of that box; every byte goes to each replica once. The receipt
        covers every process's streams.
        """
        from rlax_tpu.param_server import arrays
        from rlax_tpu.tree import flatten

        leaves = flatten(tree)
        shapes = {path: tuple(np.shape(leaf)) for path, leaf in leaves.items()}
        held = self.plan.boxes(shapes)
        if any(arrays.spans_processes(leaf) for leaf in leaves.values()):
            return self._publish_multi_process(version, leaves, shapes, held)
        return self._publish_replicas(
            version,
            range(len(self._stubs)),
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
        import jax
        from jax.experimental import multihost_utils

        from rlax_tpu.param_server import arrays

        count, me = jax.process_count(), jax.process_index()
        sender = [r % count for r in range(len(self._stubs))]
        error: BaseException | None = None
        receipt = PublishReceipt(version=version, already_present=True, bytes_sent=0)
        try:
            host = arrays.multi_process_boxes(leaves, held, sender)
            mine = [r for r in range(len(self._stubs)) if sender[r] == me]
            receipt = self._publish_replicas(
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

    def _publish_replicas(
        self,
        version: int,
        replicas: Iterable[int],
        shapes: Mapping[str, tuple[int, ...]],
        held: Sequence[Mapping[str, Box]],
        data_of: Callable[[int, str], np.ndarray],
    ) -> PublishReceipt:
        """Send the streams of `replicas`, in parallel; `data_of(replica, path)` is the host
        data of that replica's box of `path`."""

        def one(replica: int) -> tuple[bool, int]:
            pieces, payload = [], {}
            for path, box in sorted(held[replica].items()):
                data = data_of(replica, path)
                payload[path] = layout.to_bytes(data)
                # No digest: the server hashes the bytes as they arrive, so the sender's
                # critical path does not (a version's digest is the server's).
                dtype = layout.dtype_name(data.dtype)
                pieces.append(Piece(path=path, dtype=dtype, shape=shapes[path], domain=box))
            what = f"publish of version {version} to {self.addresses[replica]}"

            def send() -> pb.PublishReply:  # the whole stream again after a reconnect
                requests = self._publish_requests(version, pieces, payload)
                try:
                    return self._publishes[replica](requests, timeout=self.timeout_s)
                except grpc.RpcError as e:
                    raise _raise_from(e, what) from None

            reply = self._retrying(send, what)
            return reply.already_present, reply.bytes_received

        results = list(self._pool.map(one, list(replicas)))
        return PublishReceipt(
            version=version,
            already_present=all(present for present, _ in results),
            bytes_sent=sum(n for _, n in results),
        )

    def _publish_requests(
        self, version: int, pieces: list[Piece], payload: Mapping[str, memoryview]
    ) -> Iterator[bytes]:
        """The serialized stream: begin, the pieces' bytes in messages of about chunk_bytes
        (small pieces share one), commit."""
        begin = pb.PublishBegin(version=version)
        for piece in pieces:
            layout.piece_to_proto(piece, begin.pieces.add())
        yield pb.PublishRequest(begin=begin).SerializeToString()
        items = ((piece.path, payload[piece.path]) for piece in pieces)
        for batch in pack(items, self.chunk_bytes):
            yield encode_piece_chunks(version, batch)
            failpoint("trainer.publish", version)  # the sender dies mid-stream (chaos test)
        yield pb.PublishRequest(commit=pb.PublishCommit(version=version)).SerializeToString()

    # -- pull -----------------------------------------------------------------------------
    def held_pieces(self, refresh: bool = False) -> list[dict[str, Piece]]:
        """For each replica, {path: piece} it holds (from its layout)."""
        if self._held is None or refresh:
            self._held = []
            for replica in range(len(self._stubs)):
                reply = self._call(replica, "ListVersions", pb.ListVersionsRequest())
                pieces = [layout.piece_from_proto(p) for p in reply.layout]
                self._held.append({p.path: p for p in pieces})
        return self._held

    def _layout(self) -> list[dict[str, Piece]]:
        """`held_pieces()`, read again if a replica had no layout yet."""
        held = self.held_pieces()
        return self.held_pieces(refresh=True) if any(not h for h in held) else held

    def pull_boxes(
        self, version: int, wanted: Mapping[str, Sequence[Box]], wait_s: float = 0.0
    ) -> dict[tuple[str, Box], np.ndarray]:
        """Fetch the given boxes of the given arrays: {(path, box): array of the box}.

        Each box is assembled from the replicas that hold parts of it. With `wait_s` > 0, a
        version not yet committed is waited for (that long at most) and sent as it commits.
        """
        held = self._layout()
        requests: list[dict[str, list[Box]]] = [{} for _ in self._stubs]
        out: dict[tuple[str, Box], np.ndarray] = {}
        for path, boxes in wanted.items():
            owners = [(r, h[path]) for r, h in enumerate(held) if path in h]
            if not owners:
                raise ParamServerCallError(f"no replica holds an array named {path!r}")
            for box in boxes:
                out[(path, box)] = np.empty(
                    layout.box_shape(box), dtype=layout.parse_dtype(owners[0][1].dtype)
                )
                for replica, piece in owners:
                    common = layout.intersect(piece.domain, box)
                    if common is not None:
                        requests[replica].setdefault(path, []).append(common)

        targets_of: dict[str, list[tuple[Box, np.ndarray]]] = {}
        for (path, box), target in out.items():
            targets_of.setdefault(path, []).append((box, target))

        def target_for(path: str, sub_box: Box) -> tuple[np.ndarray, tuple[slice, ...]]:
            for want_box, target in targets_of[path]:
                if layout.contains(want_box, sub_box):
                    return target, layout.relative(sub_box, want_box)
            raise ParamServerCallError(f"the server sent an unrequested box of {path!r}")

        replicas = [r for r in range(len(self._stubs)) if requests[r]]
        # A pull that may wait gets threads of its own: it must not hold the shared pool's
        # threads, which other pulls need meanwhile.
        pool = self._pool if wait_s <= 0 else concurrent.futures.ThreadPoolExecutor(len(replicas))
        try:
            futures = [
                # The replica's whole stream again after a reconnect.
                pool.submit(
                    self._retrying,
                    functools.partial(self._pull_from, r, version, requests[r], target_for, wait_s),
                    f"pull of version {version} from {self.addresses[r]}",
                )
                for r in replicas
            ]
            for future in futures:
                future.result()
        finally:
            if pool is not self._pool:
                pool.shutdown(wait=False)
        return out

    def _pull_from(
        self,
        replica: int,
        version: int,
        select: Mapping[str, list[Box]],
        target_for: Callable[[str, Box], tuple[np.ndarray, tuple[slice, ...]]],
        wait_s: float = 0.0,
    ) -> None:
        """Stream the selected boxes from one replica into their targets.

        A box that fills its whole target is written straight into the target's bytes;
        a part of a target goes through a temporary array of the box.
        """
        request = pb.PullRequest(version=version, wait_s=wait_s)
        for path, boxes in select.items():
            selection = request.select.add(path=path)
            for box in boxes:
                layout.box_to_proto(box, selection.domains.add())
        received = 0
        flat = None
        pending: tuple[np.ndarray, tuple[slice, ...], np.ndarray] | None = None
        try:
            for message in self._pulls[replica](request, timeout=self.timeout_s + wait_s):
                for header, data in message:
                    if header.HasField("info"):
                        if pending is not None:
                            pending[0][pending[1]] = pending[2]
                            pending = None
                        info = layout.piece_from_proto(header.info)
                        target, where = target_for(info.path, info.domain)
                        if target[where].shape == target.shape:
                            flat = target.reshape(-1).view(np.uint8)
                        else:
                            box = np.empty(layout.box_shape(info.domain), dtype=target.dtype)
                            pending = (target, where, box)
                            flat = box.reshape(-1).view(np.uint8)
                    assert flat is not None, "a pull stream starts with a box's info"
                    end = header.offset + len(data)
                    flat[header.offset : end] = np.frombuffer(data, np.uint8)
                    received += len(data)
        except grpc.RpcError as e:
            raise _raise_from(
                e, f"pull of version {version} from {self.addresses[replica]}"
            ) from None
        if pending is not None:
            pending[0][pending[1]] = pending[2]
        with self._count_lock:
            self.bytes_pulled += received

    def pull_arrays(
        self, version: int, paths: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Whole arrays as numpy, {path: array} (all of them by default)."""
        held = self.held_pieces()
        shapes = {p: piece.shape for h in held for p, piece in h.items()}
        if not shapes:
            held = self.held_pieces(refresh=True)
            shapes = {p: piece.shape for h in held for p, piece in h.items()}
        wanted = {p: [layout.full_box(shapes[p])] for p in (paths or sorted(shapes))}
        return {path: array for (path, _), array in self.pull_boxes(version, wanted).items()}

    def fetch(
        self, version: int, like: Any, wait_s: float = 0.0
    ) -> dict[tuple[str, Box], np.ndarray]:
        """The first half of `pull`: the host bytes of every box of this process's devices
        under `like`'s shardings ({(path, box): array}), checked against the published
        arrays. `place` puts them on the devices. An inference worker fetches the next
        version it will load while it generates (`wait_s`: see `pull_boxes`)."""
        from rlax_tpu.param_server import arrays
        from rlax_tpu.tree import flatten

        targets = flatten(like)
        self._check_like(targets)
        wanted = {
            path: sorted(set(arrays.device_boxes(leaf).values())) for path, leaf in targets.items()
        }
        return self.pull_boxes(version, wanted, wait_s)

    def place(self, fetched: Mapping[tuple[str, Box], np.ndarray], like: Any) -> Any:
        """The second half of `pull`: a tree like `like` on its devices from `fetch`'s
        bytes."""
        from rlax_tpu.param_server import arrays
        from rlax_tpu.tree import flatten, unflatten_like

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

    def _check_like(self, targets: Mapping[str, Any]) -> None:
        stored = {path: piece for h in self._layout() for path, piece in h.items()}
        problems = []
        for path, leaf in targets.items():
            piece = stored.get(path)  # an unknown path: pull_boxes names it
            here = (layout.dtype_name(leaf.dtype), tuple(leaf.shape))
            if piece is not None and here != (piece.dtype, piece.shape):
                problems.append(
                    f"{path!r} is {piece.dtype}{list(piece.shape)} there, "
                    f"{here[0]}{list(here[1])} here"
                )
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise PullMismatchError(
                f"the tree to pull into does not match the published arrays: "
                f"{'; '.join(problems[:5])}{more}. A pull does not convert: build the model "
                "to pull into from the run's config with ModelConfig.served() (param_dtype = "
                "model.publish_dtype)"
            )

    # -- bookkeeping ----------------------------------------------------------------------
    def list_versions(self, replica: int = 0) -> pb.ListVersionsReply:
        return self._call(replica, "ListVersions", pb.ListVersionsRequest())

    def versions(self) -> list[int]:
        """Versions that every replica has (committed)."""
        common: set[int] | None = None
        for replica in range(len(self._stubs)):
            have = {v.version for v in self.list_versions(replica).versions}
            common = have if common is None else common & have
        return sorted(common or ())

    def confirm(self, consumer: str, oldest_needed: int) -> None:
        """Tell every replica that `consumer` no longer needs versions below `oldest_needed`."""
        request = pb.ConfirmRequest(consumer=consumer, oldest_needed=oldest_needed)
        for replica in range(len(self._stubs)):
            self._call(replica, "Confirm", request)

    def garbage_collect(self, oldest_needed: int) -> list[int]:
        """Ask every replica, in order, to delete each version `v` with `v < oldest_needed`,
        `v` below the `oldest_needed` confirmed by every registered consumer, and `v` not
        the replica's newest version: from memory and from persistent storage.

        Returns the versions deleted on every replica, ascending. A replica whose call
        fails raises ParamServerCallError (those before it have collected; calling again
        is safe)."""
        deleted: set[int] | None = None
        for replica in range(len(self._stubs)):
            reply = self._call(
                replica, "GarbageCollect", pb.GarbageCollectRequest(oldest_needed=oldest_needed)
            )
            deleted = set(reply.deleted) if deleted is None else deleted & set(reply.deleted)
        return sorted(deleted or ())

    def wait_persisted(self, versions: Iterable[int], timeout_s: float = 600.0) -> None:
        """Return once every replica has `versions` on storage (a publish returns when the
        memory copy is complete; the persistent copy follows). Servers without storage
        have nothing to wait for. Raises ParamServerCallError naming the versions that a
        replica does not hold (VersionsMissingError, with `.missing`) or did not persist
        within `timeout_s`, and why."""
        versions = sorted(set(int(v) for v in versions))
        if not versions:
            return
        request = pb.WaitPersistedRequest(versions=versions, timeout_s=timeout_s)
        for replica in range(len(self._stubs)):
            reply = self._call(replica, "WaitPersisted", request, timeout_s=timeout_s)
            if not reply.persistent:
                continue
            missing = list(reply.missing)
            late = sorted(set(versions) - set(reply.persisted) - set(missing))
            if missing or late or reply.persist_error:
                problems = []
                if missing:
                    problems.append(f"versions {missing} are not held there")
                if late:
                    problems.append(f"versions {late} are not on storage after {timeout_s:g} s")
                if reply.persist_error:
                    problems.append(reply.persist_error)
                message = f"parameter server {self.addresses[replica]}: " + "; ".join(problems)
                if missing:
                    raise VersionsMissingError(message, missing)
                raise ParamServerCallError(message, code=grpc.StatusCode.UNAVAILABLE)

    def _call(self, replica: int, method: str, request: Any, timeout_s: float = 0.0) -> Any:
        """`method` on `replica`; `timeout_s` is time the server may take beyond the usual
        deadline (a call that waits server-side)."""
        call: Callable[..., Any] = getattr(self._stubs[replica], method)
        what = f"{method} on {self.addresses[replica]}"

        def once() -> Any:
            try:
                return call(request, timeout=self.timeout_s + timeout_s)
            except grpc.RpcError as e:
                raise _raise_from(e, what) from None

        return self._retrying(once, what)

    def _retrying(self, call: Callable[[], Any], what: str) -> Any:
        return retry_unreachable(
            call,
            wait_s=self.reconnect_s,
            what=f"the parameter server ({what})",
            on_retry=self._on_retry,
            stop=self._stop,
        )
