"""The controller's client of the trainer (protos/rlax_tpu/v1/trainer.proto): train and SFT
steps, save, restore, status. It speaks `rlax_tpu.trainer.wire` and imports no JAX.
"""

from __future__ import annotations

from typing import Any

import grpc

from rlax_tpu.rpc import MAX_MESSAGE_BYTES, get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import trainer_pb2 as pb
from rlax_tpu.rpc.protos import trainer_pb2_grpc as pb_grpc
from rlax_tpu.trainer.wire import (
    RolloutArrays,
    StepResult,
    batch_to_proto,
    result_from_proto,
    tensor_to_proto,
)


class TrainerCallError(RpcCallError):
    """A call to the trainer failed; `code` is its gRPC status."""


class TrainerClient(ComponentClient):
    """Drives one trainer process: train and SFT steps, save, restore, status."""

    def __init__(self, address: str, **channel_options: Any) -> None:
        super().__init__(address, **channel_options)
        self._stub = pb_grpc.TrainerStub(self._channel)

    def train_step(self, step: int, batch: RolloutArrays | Any) -> StepResult:
        """Train step `step` on `batch` (publishing version step + 1), or its recorded result."""
        request = pb.TrainStepRequest(step=step)
        batch_to_proto(batch, request.batch)
        return result_from_proto(self._call("TrainStep", request, f"TrainStep({step})"))

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> StepResult:
        """tokens, targets: int32[batch, seq]; loss_mask: bool|float32[batch, seq]."""
        request = pb.SftStepRequest(step=step)
        for name, array in (("tokens", tokens), ("targets", targets), ("loss_mask", loss_mask)):
            tensor_to_proto(array, getattr(request, name))
        return result_from_proto(self._call("SftStep", request, f"SftStep({step})"))

    def save(self, wait: bool = True) -> int:
        """Checkpoint the trainer; returns the step the checkpoint holds."""
        return self._call("Save", pb.SaveRequest(wait=wait), "Save").step

    def restore(self, step: int | None = None) -> int:
        """Restore checkpoint `step` (default: the newest complete one); returns the step."""
        request = pb.RestoreRequest() if step is None else pb.RestoreRequest(step=step)
        return self._call("Restore", request, f"Restore({step})").step

    def warm_start_step(self) -> int:
        """The SFT warm start's next step (== controller.sft_steps once version 0 exists)."""
        return int(self.status().details.get("warm_start_step", "0"))

    def status(self) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel)
        except grpc.RpcError as e:
            raise _call_error(e, f"GetStatus on {self.address}") from None

    def _call(self, method: str, request: Any, what: str) -> Any:
        size = request.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise TrainerCallError(
                f"{what}: the request is {size / 2**20:.1f} MiB, over the "
                f"{MAX_MESSAGE_BYTES // 2**20} MiB gRPC message limit "
                "(rlax_tpu.rpc.MAX_MESSAGE_BYTES); send fewer or shorter sequences per step",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _call_error(e, f"{what} on {self.address}") from None


def _call_error(e: grpc.RpcError, what: str) -> TrainerCallError:
    return TrainerCallError.from_rpc(e, what)
