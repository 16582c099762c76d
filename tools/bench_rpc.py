#!/usr/bin/env python3
"""What one gRPC call costs: bare gRPC against the project's authenticated channel and its
client stack, on empty calls.

    python tools/bench_rpc.py [--calls N] [--rounds R] [--json OUT]

In one run, on loopback, against server processes started for it:

* `bare`: a plain channel and server (no metadata, no interceptor), Health.GetStatus with a
  constant reply.
* `token_only`: `make_channel`'s token-carrying channel to the bare server (which ignores
  the token): what sending the token costs the client, without a server-side check.
* `interceptor`: the same call through gRPC's client and server interceptors carrying the
  token (how rlax_tpu authenticated calls before: `grpc.intercept_channel` on the client,
  a `grpc.ServerInterceptor` on the server), kept here as the reference for the change.
* `auth`: the same call through `rlax_tpu.rpc.make_channel` to a `make_server` server (the
  token as call metadata, checked by a generic handler: what every component does now).
* `client_stack`: `ParamServerClient.list_versions()` on a real parameter server process
  (`rlax-tpu serve param-server`) holding no versions: the authenticated channel plus the
  client's error mapping and retry wrapper, and the servicer's own handler.

R rounds run the modes interleaved (bare, token_only, interceptor, auth, client_stack, ...) so a
noisy host slows each alike; each round times N calls after a warm-up; every figure is the
median over rounds of the mean per call, every ratio the median of per-round ratios against
`bare`. docs/controller.md ("What a call costs") carries the figures with their host.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_param_server import start, start_param_server, stop  # noqa: E402

from rlax_tpu.hardware import host_cpu  # noqa: E402

MODES = ("bare", "token_only", "interceptor", "auth", "client_stack")
WARMUP = 200

# The servers: a bare one and an authenticated one (make_server), and the pre-change
# interceptor pair for reference; each serves Health.GetStatus with a constant status.
_SERVERS = r"""
import collections, hmac, sys
from concurrent import futures
import grpc
from rlax_tpu.rpc import make_server
from rlax_tpu.rpc.health import HealthServicer
token = sys.argv[1]
status = lambda: {"component": "bench", "instance_id": "x"}

class Interceptor(grpc.ServerInterceptor):
    def __init__(self):
        self._expected = ("Bearer " + token).encode()
    def intercept_service(self, continuation, details):
        handler = continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization")
        if sent is not None and hmac.compare_digest(str(sent).encode(), self._expected):
            return handler
        return None

addresses, servers = [], []  # the servers are kept: a collected gRPC server stops
for interceptors in ([], [Interceptor()]):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=interceptors)
    HealthServicer(status).add_to_server(server)
    addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
    server.start()
    servers.append(server)
server, port = make_server("127.0.0.1", 0, auth_token=token)
HealthServicer(status).add_to_server(server)
server.start()
addresses.append(f"127.0.0.1:{port}")
print("READY " + " ".join(addresses), flush=True)
server.wait_for_termination()
"""


def _legacy_channel(address: str, token: str):
    """The client side of the pre-change path: a `grpc.intercept_channel` whose interceptor
    adds the token to each call's metadata."""
    import collections

    import grpc

    class Details(
        collections.namedtuple(
            "Details",
            ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
        ),
        grpc.ClientCallDetails,
    ):
        pass

    class Interceptor(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, d, request):
            metadata = [*(d.metadata or ()), ("authorization", "Bearer " + token)]
            details = Details(
                d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression
            )
            return continuation(details, request)

    return grpc.intercept_channel(grpc.insecure_channel(address), Interceptor())


def measure(calls: int, rounds: int) -> dict:
    import grpc

    from rlax_tpu.api.param_server import ParamServerClient
    from rlax_tpu.rpc import make_channel
    from rlax_tpu.rpc.health import get_status
    from rlax_tpu.rpc.protos import common_pb2, common_pb2_grpc

    token = secrets.token_hex(16)
    env = {**os.environ, "RLAX_TPU_AUTH_TOKEN": token, "JAX_PLATFORMS": "cpu"}
    servers, addresses = start([sys.executable, "-c", _SERVERS, token], env)
    bare_addr, legacy_addr, auth_addr = addresses.split()
    storage = tempfile.mkdtemp(prefix="bench-rpc-")
    ps, ps_addr = start_param_server(storage, env)
    request = common_pb2.StatusRequest()
    try:
        bare = common_pb2_grpc.HealthStub(grpc.insecure_channel(bare_addr))
        token_only = common_pb2_grpc.HealthStub(make_channel(bare_addr, auth_token=token))
        legacy = common_pb2_grpc.HealthStub(_legacy_channel(legacy_addr, token))
        auth_channel = make_channel(auth_addr, auth_token=token)
        client = ParamServerClient([ps_addr], auth_token=token)
        call: dict[str, Callable[[], object]] = {
            "bare": lambda: bare.GetStatus(request, timeout=10),
            "token_only": lambda: token_only.GetStatus(request, timeout=10),
            "interceptor": lambda: legacy.GetStatus(request, timeout=10),
            "auth": lambda: get_status(auth_channel),
            "client_stack": client.list_versions,
        }
        for fn in call.values():
            for _ in range(WARMUP):
                fn()
        per_call: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(rounds):
            for mode in MODES:
                fn = call[mode]
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                per_call[mode].append((time.perf_counter() - t0) / calls)
        client.close()
        auth_channel.close()
    finally:
        stop(servers)
        stop(ps)
    return {
        "host": host_cpu(),
        "calls_per_round": calls,
        "rounds": rounds,
        "modes": {
            m: {
                "us_per_call": statistics.median(v) * 1e6,
                "us_min": min(v) * 1e6,
                "us_max": max(v) * 1e6,
                "vs_bare": statistics.median(
                    t / b for t, b in zip(v, per_call["bare"], strict=True)
                ),
            }
            for m, v in per_call.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    result = measure(args.calls, args.rounds)
    print(f"empty gRPC calls on loopback, {result['host']}, {args.rounds} rounds x {args.calls}")
    print(f"{'mode':<14}{'us/call':>10}{'min-max':>18}{'vs bare':>10}")
    for mode, r in result["modes"].items():
        span = f"{r['us_min']:.0f}-{r['us_max']:.0f}"
        print(f"{mode:<14}{r['us_per_call']:>10.0f}{span:>18}{r['vs_bare']:>9.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
