"""What the parameter server's store knows of a version, and the checks a publish must pass.

`VersionRecord` is one committed version (its pieces, where its arrays live, whether it is in
memory and on storage); `check_pieces` and `check_layout` are the rules every publish is held
to (DESIGN §3: every version has the first version's tree). Used by `store`, `index`,
`publish` and `persistent`; no I/O here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import threading
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from rlax_tpu.api import tensors
from rlax_tpu.api.param_server import (
    InvalidPublishError,
    LayoutMismatchError,
    VersionConflictError,
)
from rlax_tpu.api.tensors import Piece

_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class PublishResult:
    version: int
    version_digest: str
    already_present: bool  # the same content was committed before; nothing changed
    bytes_received: int


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    version: int
    digest: str
    in_memory: bool
    persisted: bool
    num_bytes: int


@dataclasses.dataclass(eq=False)
class VersionRecord:
    """A committed version. `hot` holds its memory arrays, None when it is not in memory."""

    version: int
    digest: str
    pieces: dict[str, Piece]  # by path, in path order
    keys: dict[str, str]  # path -> array directory name
    persisted: bool
    hot: dict[str, np.ndarray] | None = None  # read-only, each the shape of its piece's box
    load_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The persistent array writes still running (futures), until the manifest is written.
    persisting: list[concurrent.futures.Future] | None = None
    persisted_event: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def num_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces.values())

    def info(self) -> VersionInfo:
        return VersionInfo(
            self.version, self.digest, self.hot is not None, self.persisted, self.num_bytes
        )


def without_digests(pieces: dict[str, Piece]) -> dict[str, Piece]:
    """`pieces` as a layout: what every later version must match."""
    return {p: dataclasses.replace(x, digest="") for p, x in pieces.items()}


def check_pieces(version: int, pieces: Sequence[Piece]) -> dict[str, Piece]:
    """`pieces` by path, in path order, if they can make `version`; else InvalidPublishError."""
    if version < 0:
        raise InvalidPublishError(f"version must be >= 0 (the trainer's step), got {version}")
    if not pieces:
        raise InvalidPublishError(f"version {version} has no arrays; publish at least one")
    out: dict[str, Piece] = {}
    for p in pieces:
        name = f"version {version}, array {p.path!r}"
        if not p.path or p.path in out:
            raise InvalidPublishError(f"{name}: paths must be non-empty and unique")
        try:
            tensors.parse_dtype(p.dtype)
            ts.dtype(p.dtype)
        except (TypeError, ValueError):
            raise InvalidPublishError(
                f"{name}: dtype {p.dtype!r} is not supported; use a numpy or ml_dtypes name "
                "such as float32, bfloat16 or int32"
            ) from None
        if len(p.domain) != len(p.shape) or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(p.domain, p.shape, strict=False)
        ):
            raise InvalidPublishError(
                f"{name}: box {list(p.domain)} does not lie inside its shape {list(p.shape)}"
            )
        if p.digest and not _DIGEST.fullmatch(p.digest):
            raise InvalidPublishError(f"{name}: digest must be 64 lower-case hex digits or ''")
        out[p.path] = p
    return dict(sorted(out.items()))


def check_layout(version: int, first: dict[str, Piece], pieces: dict[str, Piece]) -> None:
    """LayoutMismatchError unless `pieces` have the tree of the `first` version's."""
    problems = [
        f"array {p!r} is missing (the first version has {first[p].describe()})"
        for p in sorted(first.keys() - pieces.keys())
    ]
    problems += [
        f"array {p!r} is not in the first version's tree"
        for p in sorted(pieces.keys() - first.keys())
    ]
    problems += [
        f"array {p!r} is {pieces[p].describe()} but the first version has {first[p].describe()}"
        for p in sorted(pieces.keys() & first.keys())
        if not pieces[p].same_layout(first[p])
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        changed = sorted(
            {
                f"{pieces[p].dtype} instead of {first[p].dtype}"
                for p in pieces.keys() & first.keys()
                if pieces[p].dtype != first[p].dtype
            }
        )
        hint = (
            f" Dtypes differ ({', '.join(changed)}): the trainer publishes in "
            'model.publish_dtype ("" = param_dtype), which must stay what this storage was '
            "first published with."
            if changed
            else ""
        )
        raise LayoutMismatchError(
            f"version {version} does not match the layout of the first version published here: "
            f"{'; '.join(problems[:5])}{more}. Every version must have the same tree (paths, "
            "dtypes, shapes, shard boxes); publish the same model, or use new storage for "
            f"another one.{hint}"
        )


def conflict(version: int, existing: str, new: str) -> VersionConflictError:
    return VersionConflictError(
        f"version {version} exists with digest {existing[:16]}… but this publish has "
        f"{new[:16]}…: versions are immutable, so the run is no longer deterministic; find why "
        "the trainer produced different weights for the same step"
    )


def summary(pieces: dict[str, Piece]) -> str:
    """The first few paths of `pieces`, for error messages."""
    names = list(pieces)
    more = f", … ({len(names)} arrays)" if len(names) > 5 else ""
    return ", ".join(repr(n) for n in names[:5]) + more
