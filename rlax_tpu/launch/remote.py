"""Components that run elsewhere (GKE pods, XManager jobs): where they are, waiting until
they serve, and watching them while the controller drives them (`rlax-tpu run --connect`).

The local launcher learns addresses from READY lines and watches its children's pids; for
remote components the addresses come from flags or environment variables and liveness
from their Health service. A trainer that stops answering stops the run, which then exits
non-zero so the cluster restarts it and the controller resumes from its snapshot; any other
component is waited for while the cluster replaces its pod.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from rlax_tpu.rpc import make_channel
from rlax_tpu.rpc.health import get_status

# Flag -> environment variable read when the flag is not given (comma-separated lists).
ADDRESS_ENV = {
    "param_server": "RLAX_TPU_PARAM_SERVER",
    "trainer": "RLAX_TPU_TRAINER",
    "inference": "RLAX_TPU_INFERENCE",
    "verifier": "RLAX_TPU_VERIFIER",
}


class ConnectError(RuntimeError):
    """The components to connect to are not named, not reachable, or stopped answering."""


@dataclasses.dataclass(frozen=True)
class ComponentAddresses:
    """host:port of every component: parameter-server replicas in replica order, the
    trainer (its process 0 on a multi-host slice), the inference workers and verifiers."""

    param_server: tuple[str, ...]
    trainer: str
    inference: tuple[str, ...]
    verifier: tuple[str, ...]

    @classmethod
    def resolve(
        cls,
        *,
        param_server: Sequence[str] = (),
        trainer: str | None = None,
        inference: Sequence[str] = (),
        verifier: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
        fallback: Mapping[str, Sequence[str]] | None = None,
    ) -> ComponentAddresses:
        """The flags' addresses, else the environment's, else `fallback`'s (the config's
        verifiers.address); ConnectError names what is missing."""
        env = os.environ if environ is None else environ
        given = {
            "param_server": list(param_server),
            "trainer": [trainer] if trainer else [],
            "inference": list(inference),
            "verifier": list(verifier),
        }
        found: dict[str, list[str]] = {}
        missing = []
        for key, values in given.items():
            if not values:
                values = [a.strip() for a in env.get(ADDRESS_ENV[key], "").split(",")]
                values = [a for a in values if a] or list((fallback or {}).get(key, ()))
            if not values:
                flag = "--" + key.replace("_", "-")
                missing.append(f"{flag} (or {ADDRESS_ENV[key]})")
            found[key] = values
        if missing:
            raise ConnectError(
                f"--connect needs the address of every component: {', '.join(missing)}"
            )
        if len(found["trainer"]) != 1:
            raise ConnectError(f"one trainer address, got {found['trainer']}")
        return cls(
            param_server=tuple(found["param_server"]),
            trainer=found["trainer"][0],
            inference=tuple(found["inference"]),
            verifier=tuple(found["verifier"]),
        )

    def named(self) -> dict[str, str]:
        """Instance name -> address, e.g. {"param_server-0": ..., "trainer": ...}."""
        out = {f"param_server-{i}": a for i, a in enumerate(self.param_server)}
        out["trainer"] = self.trainer
        out.update({f"inference_worker-{i}": a for i, a in enumerate(self.inference)})
        out.update({f"verifier-{i}": a for i, a in enumerate(self.verifier)})
        return out


class HealthProbe:
    """One authenticated channel per component; `failures()` asks each for its status."""

    def __init__(self, named: Mapping[str, str], *, auth_token: str, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._channels = {n: make_channel(a, auth_token=auth_token) for n, a in named.items()}
        self.addresses = dict(named)

    def failures(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Name -> why it did not answer, for those of `names` (default all) that did not."""
        out = {}
        for name in names if names is not None else list(self._channels):
            try:
                get_status(self._channels[name], timeout_s=self.timeout_s)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise ConnectError(
                        f"{name} at {self.addresses[name]} refused the auth token: every "
                        "component must get the same secret"
                    ) from None
                details = e.details() if hasattr(e, "details") else str(e)
                out[name] = f"{code.name if code else 'ERROR'}: {details}"
        return out

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def wait_until_serving(
    probe: HealthProbe,
    *,
    timeout_s: float,
    stop: threading.Event,
    report: Callable[[str], None] = print,
    poll_s: float = 5.0,
    report_every_s: float = 60.0,
) -> bool:
    """Block until every component answers Health (True), or `stop` is set (False).

    Pods come up in any order and TPU slices take minutes to schedule, so this waits up to
    `timeout_s`, then raises ConnectError naming the components that never answered."""
    t0 = last_report = time.monotonic()
    waiting = list(probe.addresses)
    while True:
        waiting = list(probe.failures(waiting))
        if not waiting:
            return True
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise ConnectError(
                f"after {timeout_s:.0f}s these components still do not answer: "
                + ", ".join(f"{n} ({probe.addresses[n]})" for n in waiting)
            )
        if now - last_report >= report_every_s:
            report(f"waiting for {len(waiting)} components: {', '.join(waiting)}")
            last_report = now
        if stop.wait(poll_s):
            return False


class Watchdog:
    """Polls every component's Health. The trainer missing `misses` polls in a row sets
    `failed` (and `failure` says why), which stops the controller like a dead local child:
    only a restart of the run restores a lost trainer. Any other component that stops
    answering is reported, and reported again when it answers: the run waits for it where it
    needs it (controller.component_wait_s; docs/controller.md, "Elastic recovery"), while
    its pod is replaced."""

    def __init__(
        self,
        probe: HealthProbe,
        *,
        interval_s: float = 20.0,
        misses: int = 3,
        essential: Sequence[str] = ("trainer",),
        report: Callable[[str], None] = print,
    ) -> None:
        self.probe, self.interval_s, self.misses = probe, interval_s, misses
        self.essential, self.report = tuple(essential), report
        self.failed = threading.Event()
        self.failure: str | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="component-watch", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def _watch(self) -> None:
        missed: dict[str, int] = {}
        while not self._closing.wait(self.interval_s):
            try:
                failures = self.probe.failures()
            except ConnectError as e:
                failures = {"auth": str(e)}
            for name in sorted(set(missed) - set(failures)):
                if missed[name] >= self.misses:
                    self.report(f"{name} answers again")
            missed = {name: missed.get(name, 0) + 1 for name in failures}
            for name, count in missed.items():
                if count != self.misses:
                    continue
                address = self.probe.addresses.get(name, "")
                why = f"{name} ({address}) stopped answering: {failures[name]} "
                why += f"({count} health checks in a row)"
                if name in self.essential or name == "auth":
                    self.failure = why
                    self.failed.set()
                    return
                self.report(f"{why}; the run goes on without it and waits for it where needed")

    def close(self) -> None:
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.probe.timeout_s + 1)
