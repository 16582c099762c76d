"""A verifier service that fails on purpose, for the controller's tests: the real
VerificationService and gRPC servicer over the arithmetic check, except that the check
raises for requests whose id matches --fail-always (every attempt) or --fail-once (the first
attempt of each id: a transient fault). The service reports a raised check as
VERIFIER_ERROR and keeps no error in its cache, as in `rlax-tpu serve verifier`.

    python faulty_verifier.py --fail-always REGEX --fail-once REGEX

Serves Verifier and Health on 127.0.0.1 (token from $RLAX_TPU_AUTH_TOKEN) and prints
`READY host:port` like `rlax-tpu serve`; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import threading

from rlax_tpu.rpc import HealthServicer, format_address
from rlax_tpu.rpc.channels import make_server
from rlax_tpu.rpc.process import announce_ready, stop_on_signals, wait_for
from rlax_tpu.verifiers.service import VerificationService, VerifierServicer, verifier_status
from rlax_tpu.verifiers.tasks import score_arithmetic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-always", default="(?!)")  # (?!) matches nothing
    parser.add_argument("--fail-once", default="(?!)")
    args = parser.parse_args()
    always, once = re.compile(args.fail_always), re.compile(args.fail_once)
    seen: set[str] = set()
    lock = threading.Lock()

    def verify(request):
        with lock:
            first = request.request_id not in seen
            seen.add(request.request_id)
        if always.search(request.request_id) or (first and once.search(request.request_id)):
            raise RuntimeError(f"injected fault for {request.request_id}")
        return score_arithmetic(request.response, request.reference)

    stop = stop_on_signals()
    server, port = make_server("127.0.0.1", 0, auth_token=os.environ["RLAX_TPU_AUTH_TOKEN"])
    service = VerificationService(verify, concurrency=2)
    VerifierServicer(service).add_to_server(server)
    HealthServicer(
        lambda: verifier_status(service, instance_id="faulty", config_digest="")
    ).add_to_server(server)
    server.start()
    address = format_address("127.0.0.1", port)
    announce_ready(address, f"faulty verifier on {address}")
    wait_for(stop)
    server.stop(2.0).wait()
    service.close()


if __name__ == "__main__":
    main()
