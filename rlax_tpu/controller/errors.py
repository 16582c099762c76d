"""The controller's errors: the run cannot go on, and says why and what to do."""

from __future__ import annotations


class ControllerError(RuntimeError):
    """The run cannot go on (a component failed, a prompt cannot be generated, ...)."""


class UnjudgedError(ControllerError):
    """Too much of a batch stayed unjudged after the verifier retries: training on it would
    train on missing rewards, so the run stops (see `controller.verify.max_unjudged_fraction`)."""
