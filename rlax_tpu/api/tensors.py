"""How a version of the weights is laid out: pieces, boxes and digests.

Shared by the parameter server and its client so both agree, byte for byte, on what a
version is. A version is a set of pieces; a piece is the box `domain` of the array at
tree path `path` (global `shape`, `dtype`), stored as C-order little-endian bytes. Its
digest is sha256 of those bytes; the version digest is sha256 of the sorted piece
metadata and digests, so the same content always has the same version digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]  # ((inclusive_min, exclusive_max), ...) per dimension


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_size(box: Box) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None if they do not overlap."""
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) or not out else None


def contains(outer: Box, inner: Box) -> bool:
    return all(
        olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner, strict=True)
    )


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices selecting `box` out of an array that holds the box `origin`."""
    return tuple(slice(lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(box, origin, strict=True))


def box_from_slices(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A box from a tuple of slices (as in jax's devices_indices_map) over `shape`."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided index {s} is not a box")
        out.append((start, stop))
    return tuple(out)


def dtype_name(dtype: np.dtype) -> str:
    """numpy dtype -> the name used on the wire ("float32", "bfloat16", ...)."""
    return np.dtype(dtype).name


def parse_dtype(name: str) -> np.dtype:
    """The inverse of `dtype_name`; bfloat16 and the float8 types come from ml_dtypes."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        try:
            return np.dtype(getattr(ml_dtypes, name))
        except AttributeError:
            raise ValueError(f"unknown dtype {name!r}") from None


def to_bytes(array: np.ndarray) -> memoryview:
    """The C-order little-endian bytes of `array` (no copy when already so laid out)."""
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Viewed as uint8 first: ml_dtypes types (bfloat16, float8) cannot export a buffer.
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def digest_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Piece:
    """Metadata of one stored piece (digest "" when not yet known)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    domain: Box
    digest: str = ""

    @property
    def nbytes(self) -> int:
        return box_size(self.domain) * parse_dtype(self.dtype).itemsize

    def same_layout(self, other: Piece) -> bool:
        return (self.path, self.dtype, self.shape, self.domain) == (
            other.path,
            other.dtype,
            other.shape,
            other.domain,
        )

    def describe(self) -> str:
        return f"{self.path} {self.dtype}{list(self.shape)} box {list(self.domain)}"


def version_digest(pieces: Iterable[Piece]) -> str:
    """sha256 over every piece's layout and digest, in path order."""
    h = hashlib.sha256()
    for p in sorted(pieces, key=lambda p: p.path):
        h.update(f"{p.path}|{p.dtype}|{list(p.shape)}|{list(p.domain)}|{p.digest}\n".encode())
    return h.hexdigest()


def piece_to_proto(piece: Piece, message) -> None:
    """Fill an ArrayInfo message from `piece`."""
    message.path = piece.path
    message.dtype = piece.dtype
    message.shape[:] = list(piece.shape)
    message.domain.inclusive_min[:] = [lo for lo, _ in piece.domain]
    message.domain.exclusive_max[:] = [hi for _, hi in piece.domain]
    message.digest = piece.digest


def piece_from_proto(message) -> Piece:
    domain = tuple(zip(message.domain.inclusive_min, message.domain.exclusive_max, strict=True))
    return Piece(
        path=message.path,
        dtype=message.dtype,
        shape=tuple(message.shape),
        domain=tuple((int(lo), int(hi)) for lo, hi in domain),
        digest=message.digest,
    )


def box_to_proto(box: Box, message) -> None:
    message.inclusive_min[:] = [lo for lo, _ in box]
    message.exclusive_max[:] = [hi for _, hi in box]


def box_from_proto(message) -> Box:
    return tuple(
        (int(lo), int(hi))
        for lo, hi in zip(message.inclusive_min, message.exclusive_max, strict=True)
    )
