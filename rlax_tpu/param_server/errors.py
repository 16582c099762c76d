"""The parameter server's errors, shared by the store, the service (which maps them to gRPC
status codes) and the client (whose call errors are ParamServerErrors too). No imports, so
a client catches them without loading the store or TensorStore."""

from __future__ import annotations


class ParamServerError(Exception):
    """Base of the parameter server's errors; each message says what to do about it."""


class InvalidPublishError(ParamServerError):
    """A publish that cannot be accepted as sent: bytes, digests or metadata are wrong."""


class LayoutMismatchError(InvalidPublishError):
    """A version whose tree (paths, dtypes, shapes, boxes) differs from the first version's."""


class VersionConflictError(ParamServerError):
    """The version exists already with different content: the run is no longer deterministic."""


class VersionNotFoundError(ParamServerError):
    """The version was never published here, was garbage-collected or is not committed yet."""


class PublishInProgressError(ParamServerError):
    """Another publish of the same version is under way; retry when it has finished."""


class StorageFailedError(ParamServerError):
    """Persisting a version failed earlier; publishes are refused until a restart."""


class PullMismatchError(ParamServerError):
    """A pull into a tree whose arrays differ (shape, dtype) from those the server holds: pulls
    never convert, so a worker must build its model in the published dtype."""


class InvalidReadError(ParamServerError):
    """A read of an array or box that this replica does not hold."""
