"""The controller's client of the trainer (protos/rlax_tpu/v1/trainer.proto): train and SFT
steps, save, restore, status. It speaks `rlax_tpu.trainer.wire` and imports no JAX.

A step's batch is streamed in chunks of at most `max_message_bytes` (the config's
`trainer.max_message_bytes`, which `serve trainer` also enforces), so it may be any size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from rlax_tpu.config import TrainerConfig
from rlax_tpu.rpc import get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import trainer_pb2 as pb
from rlax_tpu.rpc.protos import trainer_pb2_grpc as pb_grpc
from rlax_tpu.trainer.wire import (
    TRAIN_STEP,
    RolloutArrays,
    StepResult,
    batch_stream,
    result_from_proto,
)


class TrainerCallError(RpcCallError):
    """A call to the trainer failed; `code` is its gRPC status."""


class TrainerClient(ComponentClient):
    """Drives one trainer process: train and SFT steps, save, restore, status.

    `max_message_bytes`: the largest message of a step's stream; at most the trainer's
    `trainer.max_message_bytes` (default: the config's default)."""

    def __init__(
        self, address: str, *, max_message_bytes: int | None = None, **channel_options: Any
    ) -> None:
        super().__init__(address, **channel_options)
        self.max_message_bytes = max_message_bytes or TrainerConfig.max_message_bytes
        self._stub = pb_grpc.TrainerStub(self._channel)

    def train_step(self, step: int, batch: RolloutArrays | Any) -> StepResult:
        """Train step `step` on `batch` (making version step + 1, published only if workers
        may load it or it is the run's last), or its recorded result."""
        return self._stream("TrainStep", step, TRAIN_STEP.arrays_of(batch))

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> StepResult:
        """tokens, targets: int32[batch, seq]; loss_mask: bool|float32[batch, seq]."""
        arrays = {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}
        return self._stream("SftStep", step, arrays)

    def save(self, wait: bool = True) -> int:
        """Checkpoint the trainer; returns the step the checkpoint holds."""
        return self._call("Save", pb.SaveRequest(wait=wait), "Save").step

    def restore(self, step: int | None = None) -> int:
        """Restore checkpoint `step` (default: the newest complete one); returns the step."""
        request = pb.RestoreRequest() if step is None else pb.RestoreRequest(step=step)
        return self._call("Restore", request, f"Restore({step})").step

    def republish(self, version: int) -> int:
        """Publish `version`, the one the trainer holds, again (a restarted parameter server
        lost it); FAILED_PRECONDITION for any other version."""
        request = pb.RepublishRequest(version=version)
        return self._call("Republish", request, f"Republish({version})").version

    def warm_start_step(self) -> int:
        """The SFT warm start's next step (== controller.sft_steps once version 0 exists)."""
        return int(self.status().details.get("warm_start_step", "0"))

    def status(self) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel)
        except grpc.RpcError as e:
            raise _call_error(e, f"GetStatus on {self.address}") from None

    def _stream(self, method: str, step: int, arrays: Mapping[str, Any]) -> StepResult:
        chunks = batch_stream(step, arrays, max_message_bytes=self.max_message_bytes)
        try:
            reply = getattr(self._stub, method)(chunks, timeout=self.timeout_s)
        except grpc.RpcError as e:
            error = _call_error(e, f"{method}({step}) on {self.address}")
            if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a message over its limit
                error = TrainerCallError(
                    f"{error}; this client sends messages of up to {self.max_message_bytes} "
                    "bytes: give the controller and `serve trainer` the same "
                    "trainer.max_message_bytes",
                    error.code,
                )
            raise error from None
        return result_from_proto(reply)

    def _call(self, method: str, request: Any, what: str) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _call_error(e, f"{what} on {self.address}") from None


def _call_error(e: grpc.RpcError, what: str) -> TrainerCallError:
    return TrainerCallError.from_rpc(e, what)
