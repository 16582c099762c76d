"""The verifier service: its core (bounded queue, idempotency by request id, batch deadline,
metrics) with a scripted verifier, then `rlax-tpu serve verifier` as a real process on
loopback judging math, arithmetic and sandboxed code against the test-data repository."""

import os
import threading
import time

import grpc
import pytest
from processes import ProcessGroup

from rlax_tpu.api import verifier as types
from rlax_tpu.api.verifier import (
    QueueFullError,
    RequestIdReusedError,
    ServiceClosedError,
    Verdict,
    VerificationRequest,
    VerificationResult,
    VerifierCallError,
    VerifierClient,
    metrics_from_proto,
    metrics_to_proto,
    request_from_proto,
    request_to_proto,
    result_from_proto,
    result_to_proto,
)
from rlax_tpu.cli import build_parser
from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import RunConfig
from rlax_tpu.rpc import make_channel
from rlax_tpu.rpc.protos import verifier_pb2 as pb
from rlax_tpu.rpc.protos import verifier_pb2_grpc as pb_grpc
from rlax_tpu.verifiers.problems import write_problem
from rlax_tpu.verifiers.repository import TestDataRepository
from rlax_tpu.verifiers.server import options_from_args
from rlax_tpu.verifiers.service import VerificationService


# -- the core, with a scripted verifier --------------------------------------------------------
class ScriptedVerifier:
    """Accepts "ok", rejects anything else; "block" waits for `release`; "boom" raises;
    "flaky" is a VERIFIER_ERROR. Counts the runs of each response."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.runs: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: VerificationRequest) -> VerificationResult:
        with self.lock:
            self.runs.append(request.response)
        self.started.release()
        if request.response == "block":
            assert self.release.wait(30)
        if request.response == "boom":
            raise RuntimeError("checker exploded")
        if request.response == "flaky":
            return VerificationResult(reward=0.0, verdict=Verdict.VERIFIER_ERROR, reason="flaky")
        ok = request.response in ("ok", "block")
        return VerificationResult(
            reward=float(ok),
            verdict=Verdict.ACCEPTED if ok else Verdict.WRONG_ANSWER,
            reason="scripted",
        )


def req(response: str, request_id: str = "", kind: str = "math") -> VerificationRequest:
    return VerificationRequest(kind=kind, response=response, reference="1", request_id=request_id)


@pytest.fixture
def scripted():
    verifier = ScriptedVerifier()
    services = []

    def make(**kwargs):
        kwargs.setdefault("concurrency", 2)
        service = VerificationService(verifier, **kwargs)
        services.append(service)
        return service

    yield verifier, make
    verifier.release.set()
    for service in services:
        service.close()


def verdicts(outcomes):
    return [o.result.verdict for o in outcomes]


def test_batch_results_come_back_in_request_order(scripted):
    verifier, make = scripted
    service = make()
    outcomes = service.verify_batch([req("ok"), req("no"), req("ok", "a"), req("boom")])
    assert verdicts(outcomes) == [
        Verdict.ACCEPTED,
        Verdict.WRONG_ANSWER,
        Verdict.ACCEPTED,
        Verdict.VERIFIER_ERROR,
    ]
    assert "RuntimeError: checker exploded" in outcomes[3].result.reason
    assert not any(o.cached for o in outcomes)


def test_a_retried_request_id_returns_its_result_without_running_again(scripted):
    verifier, make = scripted
    service = make()
    first = service.verify_batch([req("ok", "id-1"), req("no", "id-2")])
    again = service.verify_batch([req("no", "id-2"), req("ok", "id-1"), req("ok")])
    assert [o.result for o in again[:2]] == [first[1].result, first[0].result]
    assert [o.cached for o in again] == [True, True, False]
    assert sorted(verifier.runs) == ["no", "ok", "ok"]
    metrics = service.metrics()
    assert (metrics["judged"], metrics["cache_hits"]) == (3, 2)


def test_a_request_id_in_flight_is_waited_for_not_run_twice(scripted):
    verifier, make = scripted
    service = make()
    results = []
    first = threading.Thread(
        target=lambda: results.append(service.verify_batch([req("block", "x")]))
    )
    first.start()
    assert verifier.started.acquire(timeout=10)
    second = threading.Thread(
        target=lambda: results.append(service.verify_batch([req("block", "x")]))
    )
    second.start()
    time.sleep(0.2)
    assert service.metrics()["joined"] == 1
    verifier.release.set()
    first.join(10)
    second.join(10)
    assert verifier.runs == ["block"]
    assert [r[0].result.verdict for r in results] == [Verdict.ACCEPTED] * 2


def test_a_duplicate_id_within_one_batch_runs_once(scripted):
    verifier, make = scripted
    outcomes = make().verify_batch([req("ok", "d"), req("ok", "d")])
    assert verdicts(outcomes) == [Verdict.ACCEPTED] * 2 and verifier.runs == ["ok"]


def test_a_request_id_reused_for_another_request_is_refused(scripted):
    _, make = scripted
    service = make()
    service.verify_batch([req("ok", "same")])
    with pytest.raises(RequestIdReusedError, match="'same' was already used"):
        service.verify_batch([req("no", "same")])


def test_verifier_errors_are_not_kept_so_a_retry_judges_again(scripted):
    verifier, make = scripted
    service = make()
    service.verify_batch([req("flaky", "f")])
    outcome = service.verify_batch([req("flaky", "f")])[0]
    assert not outcome.cached and verifier.runs == ["flaky", "flaky"]


def test_finished_results_are_kept_in_a_bounded_lru(scripted):
    verifier, make = scripted
    service = make(results_cache_size=2)
    service.verify_batch([req("ok", "a"), req("ok", "b")])
    service.verify_batch([req("ok", "a")])  # a is now the most recent
    service.verify_batch([req("ok", "c")])  # evicts b
    assert [o.cached for o in service.verify_batch([req("ok", "a"), req("ok", "b")])] == [
        True,
        False,
    ]


def test_a_batch_over_the_queue_capacity_is_refused_whole(scripted):
    verifier, make = scripted
    service = make(concurrency=1, queue_capacity=2)
    blocked = threading.Thread(target=service.verify_batch, args=([req("block"), req("ok")],))
    blocked.start()
    assert verifier.started.acquire(timeout=10)
    with pytest.raises(QueueFullError, match="2 of 2 requests admitted"):
        service.verify_batch([req("ok", "late")])
    verifier.release.set()
    blocked.join(10)
    with pytest.raises(QueueFullError, match="smaller batches"):
        service.verify_batch([req("ok")] * 3)
    assert service.verify_batch([req("ok", "late")])[0].result.verdict == Verdict.ACCEPTED
    assert service.metrics()["rejected"] == 2


def test_the_batch_deadline_answers_what_finished_and_the_rest_is_picked_up_later(scripted):
    verifier, make = scripted
    service = make(concurrency=1)
    start = time.monotonic()
    outcomes = service.verify_batch([req("ok", "fast"), req("block", "slow")], deadline_s=0.5)
    assert 0.5 <= time.monotonic() - start < 5
    assert verdicts(outcomes) == [Verdict.ACCEPTED, Verdict.VERIFIER_ERROR]
    assert "deadline of 0.5 s" in outcomes[1].result.reason
    assert service.metrics()["deadline_expired"] == 1
    verifier.release.set()
    retry = service.verify_batch([req("block", "slow")], deadline_s=10)[0]
    assert retry.result.verdict == Verdict.ACCEPTED
    assert verifier.runs == ["ok", "block"]  # the retry waited for the run, not a new one


def test_requests_whose_deadline_passed_in_the_queue_are_not_run(scripted):
    verifier, make = scripted
    service = make(concurrency=1)
    outcomes = service.verify_batch([req("block"), req("ok", "queued")], deadline_s=0.3)
    assert verdicts(outcomes) == [Verdict.VERIFIER_ERROR] * 2
    verifier.release.set()
    assert service.verify_batch([req("ok", "other")])[0].result.verdict == Verdict.ACCEPTED
    assert verifier.runs == ["block", "ok"]  # "queued" was dropped, "other" ran
    assert not service.verify_batch([req("ok", "queued")])[0].cached


def test_metrics_count_verdicts_and_latency(scripted):
    _, make = scripted
    service = make(
        pool_stats=lambda: {"recycled": 3},
        input_stats=lambda: {"responses_truncated": 2},
        sandbox={"sandbox": "bwrap", "uid": "65534"},
    )
    service.verify_batch([req("ok"), req("ok"), req("no")])
    metrics = service.metrics()
    assert metrics["inputs"] == {"responses_truncated": 2}
    assert metrics["sandbox"] == {"sandbox": "bwrap", "uid": "65534"}
    assert metrics["verdicts"] == {"accepted": 2, "wrong_answer": 1}
    assert metrics["judged"] == 3 and metrics["queue_depth"] == metrics["running"] == 0
    assert 0 < metrics["latency_p50_s"] <= metrics["latency_p95_s"] < 5
    assert metrics["pool"] == {"recycled": 3}
    assert metrics_from_proto(metrics_to_proto(metrics)) == metrics


def test_closing_answers_queued_requests_and_refuses_new_batches(scripted):
    verifier, make = scripted
    service = make(concurrency=1)
    results = []
    caller = threading.Thread(
        target=lambda: results.extend(service.verify_batch([req("block"), req("ok")]))
    )
    caller.start()
    assert verifier.started.acquire(timeout=10)
    threading.Timer(0.3, verifier.release.set).start()
    service.close()
    caller.join(10)
    assert verdicts(results) == [Verdict.ACCEPTED, Verdict.VERIFIER_ERROR]
    assert "stopped" in results[1].result.reason
    with pytest.raises(ServiceClosedError):
        service.verify_batch([req("ok")])


def test_requests_and_results_survive_the_proto_round_trip():
    request = VerificationRequest(
        kind="code",
        response="```python\nprint(1)\n```",
        problem="gs://b/problems/p",
        language="python",
        request_id="s1/p2/0",
    )
    assert request_from_proto(request_to_proto(request), 0) == request
    result = VerificationResult(
        reward=0.5,
        verdict=Verdict.WRONG_ANSWER,
        reason="1 of 2 tests failed",
        tests=(
            types.TestCaseResult(name="1", verdict=Verdict.ACCEPTED, time_s=0.25),
            types.TestCaseResult(name="2", verdict=Verdict.TIME_LIMIT, time_s=2.0, reason="slow"),
        ),
    )
    message = result_to_proto(result, "s1/p2/0", cached=True)
    assert (message.request_id, message.cached) == ("s1/p2/0", True)
    assert result_from_proto(message) == result
    bad = request_to_proto(request)
    bad.kind = "poetry"
    with pytest.raises(ValueError, match=r"requests\[3\].kind is 'poetry'"):
        request_from_proto(bad, 3)


# -- `rlax-tpu serve verifier` as a real process -----------------------------------------------
TOKEN = "verifier-test-token"
GOOD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
SLOW = "```python\nwhile True:\n    pass\n```"  # past the 1 s CPU limit on every test


@pytest.fixture(scope="module")
def test_data(tmp_path_factory):
    """A repository holding `sum` (a + b, 10 tests); (link, cache directory)."""
    tmp = tmp_path_factory.mktemp("test-data")
    tests = [(f"{i} {2 * i}\n", f"{3 * i}\n") for i in range(10)]
    problem = write_problem(tmp / "sum", name="sum", tests=tests)
    link = TestDataRepository(str(tmp / "repo"), tmp / "upload-cache").upload(problem, "sum")
    return link, str(tmp / "cache")


def start(group, cache, *args):
    return group.start_verifier(
        token=TOKEN,
        test_data_cache=cache,
        overrides=["verifiers.code_time_limit_s=1"],
        args=list(args),
    )


@pytest.fixture(scope="module")
def server(test_data):
    """2 workers, each recycled after 2 tasks."""
    group = ProcessGroup()
    process = start(group, test_data[1], "--num-workers=2", "--max-tasks-per-worker=2")
    client = VerifierClient(process.address, auth_token=TOKEN)
    yield process, client
    client.close()
    group.stop_all()


def code(response, link, request_id=""):
    return VerificationRequest(kind="code", response=response, problem=link, request_id=request_id)


def math(response, reference, request_id=""):
    return VerificationRequest(
        kind="math", response=response, reference=reference, request_id=request_id
    )


def arithmetic(response, reference, request_id=""):
    return VerificationRequest(
        kind="arithmetic", response=response, reference=reference, request_id=request_id
    )


def wait_until(condition, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def test_served_math_arithmetic_and_code_requests_are_judged_in_order(server, test_data):
    _, client = server
    link, _ = test_data
    missing = link.rsplit("/", 1)[0] + "/never-uploaded"
    results = client.verify(
        [
            math("so \\boxed{\\frac{1}{2}}", "0.5"),
            math("the answer is 3", "4"),
            arithmetic("7 * 6 = 42", "42"),
            code(GOOD, link),
            code(WRONG, link),
            code(SLOW, link),
            code(GOOD, missing),
        ],
        deadline_s=60,
    )
    assert [r.verdict for r in results] == [
        Verdict.ACCEPTED,
        Verdict.WRONG_ANSWER,
        Verdict.ACCEPTED,
        Verdict.ACCEPTED,
        Verdict.WRONG_ANSWER,
        Verdict.TIME_LIMIT,
        Verdict.VERIFIER_ERROR,
    ]
    assert results[3].reward == 1.0 and len(results[3].tests) == 10
    assert "never uploaded" in results[6].reason


def test_a_retried_request_id_is_answered_without_judging_again(server, test_data):
    _, client = server
    link, _ = test_data
    batch = [code(GOOD, link, "retry/0"), math("\\boxed{2}", "2", "retry/1")]
    first = client.verify_detailed(batch)
    judged = client.metrics()["judged"]
    again = client.verify_detailed(batch)
    assert [r for r, _ in again] == [r for r, _ in first]
    assert [cached for _, cached in first] == [False, False]
    assert [cached for _, cached in again] == [True, True]
    metrics = client.metrics()
    assert metrics["judged"] == judged and metrics["cache_hits"] >= 2
    with pytest.raises(VerifierCallError, match="already used") as error:
        client.verify([code(WRONG, link, "retry/0")])
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_id_in_flight_is_waited_for(server, test_data):
    _, client = server
    link, _ = test_data
    before = client.metrics()
    results = []
    first = threading.Thread(target=lambda: results.append(client.verify([code(SLOW, link, "f")])))
    first.start()
    wait_until(lambda: client.metrics()["running"] == 1)
    second = client.verify([code(SLOW, link, "f")])
    first.join(30)
    after = client.metrics()
    assert second[0].verdict == results[0][0].verdict == Verdict.TIME_LIMIT
    assert after["judged"] - before["judged"] == 1
    assert after["joined"] - before["joined"] == 1


def test_the_deadline_answers_what_finished_and_the_server_keeps_serving(server, test_data):
    _, client = server
    link, _ = test_data
    start_s = time.monotonic()
    fast, slow = client.verify(
        [arithmetic("= 5", "5", "d/fast"), code(SLOW, link, "d/slow")], deadline_s=0.5
    )
    assert time.monotonic() - start_s < 3
    assert fast.verdict == Verdict.ACCEPTED
    assert slow.verdict == Verdict.VERIFIER_ERROR and "deadline" in slow.reason
    assert client.verify([arithmetic("= 6", "6")])[0].verdict == Verdict.ACCEPTED
    # The slow one kept running; a retry of its id gets its verdict.
    assert client.verify([code(SLOW, link, "d/slow")])[0].verdict == Verdict.TIME_LIMIT
    assert client.metrics()["deadline_expired"] >= 1


def test_metrics_count_verdicts_in_get_metrics_and_health(server, test_data):
    _, client = server
    link, _ = test_data
    before = client.metrics()
    client.verify([code(GOOD, link), code(WRONG, link), arithmetic("1", "2")])
    after = client.metrics()
    grown = {
        k: after["verdicts"].get(k, 0) - before["verdicts"].get(k, 0) for k in after["verdicts"]
    }
    assert {k: v for k, v in grown.items() if v} == {"accepted": 1, "wrong_answer": 2}
    assert after["queue_depth"] == after["running"] == 0
    assert 0 < after["latency_p50_s"] <= after["latency_p95_s"]
    status = client.status()
    assert (status.component, status.instance_id) == ("verifier", "verifier-0")
    assert int(status.details["judged"]) == after["judged"]
    assert "wrong_answer=" in status.details["verdicts"]
    assert float(status.details["latency_p95_s"]) > 0
    # How code runs, and the inputs' counters, in both.
    assert after["sandbox"]["sandbox"] == "bwrap" and after["sandbox"]["uid"].isdigit()
    assert status.details["sandbox.uid"] == after["sandbox"]["uid"]
    assert after["inputs"] == {"responses_truncated": 0}
    assert status.details["inputs"] == "responses_truncated=0"


def test_workers_recycled_after_their_task_limit_keep_serving(server):
    _, client = server
    batch = [math(f"\\boxed{{{i}}}", str(i)) for i in range(8)]
    assert [r.verdict for r in client.verify(batch)] == [Verdict.ACCEPTED] * 8
    pool = client.metrics()["pool"]
    assert pool["recycled"] >= 3 and pool["workers"] == 2
    assert client.verify([math("\\boxed{9}", "9")])[0].verdict == Verdict.ACCEPTED


def test_calls_without_the_token_are_refused(server):
    process, _ = server
    with VerifierClient(process.address, auth_token="wrong-token") as stranger:
        for call in (lambda: stranger.verify([arithmetic("1", "1")]), stranger.metrics):
            with pytest.raises(VerifierCallError) as error:
                call()
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_an_unknown_kind_is_an_invalid_argument(server):
    process, _ = server
    channel = make_channel(process.address, auth_token=TOKEN)
    stub = pb_grpc.VerifierStub(channel)
    request = pb.VerifyRequest(requests=[pb.VerificationRequestMessage(kind="poetry")])
    with pytest.raises(grpc.RpcError) as error:
        stub.Verify(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests[0].kind" in error.value.details()
    channel.close()


def children(pid):
    """Process ids whose parent is `pid` (the pool's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_a_full_queue_refuses_batches_and_sigterm_stops_cleanly(test_data):
    link, cache = test_data
    group = ProcessGroup()
    try:
        process = start(group, cache, "--num-workers=1", "--queue-size=2")
        client = VerifierClient(process.address, auth_token=TOKEN)
        with pytest.raises(VerifierCallError, match="smaller batches") as error:
            client.verify([arithmetic("1", "1")] * 3)
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        busy = threading.Thread(target=client.verify, args=([code(SLOW, link)] * 2,))
        busy.start()
        wait_until(lambda: client.metrics()["running"] + client.metrics()["queue_depth"] == 2)
        with pytest.raises(VerifierCallError, match="queue is full") as error:
            client.verify([arithmetic("1", "1")])
        assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        busy.join(30)
        assert client.verify([arithmetic("1", "1")])[0].verdict == Verdict.ACCEPTED
        assert client.metrics()["rejected"] == 2
        client.close()
        wait_until(lambda: len(children(process.pid)) >= 1)
        workers = children(process.pid)  # the pool's workers and multiprocessing's tracker
        assert process.stop() == 0
        assert "stopped" in process.stderr()
        wait_until(lambda: not [pid for pid in workers if os.path.exists(f"/proc/{pid}")], 10)
    finally:
        group.stop_all()


def test_serve_verifier_needs_the_token(monkeypatch, tmp_path):
    monkeypatch.delenv("RLAX_TPU_AUTH_TOKEN", raising=False)
    assert cli_main(["serve", "verifier", "--test-data-cache", str(tmp_path)]) == 2


def test_serve_verifier_flags_override_the_config_and_are_checked(tmp_path):
    config = RunConfig().apply_overrides(["verifiers.num_workers=3"])
    parse = build_parser().parse_args
    options = options_from_args(parse(["serve", "verifier"]), config)
    assert (options.num_workers, options.queue_size, options.instance_id) == (3, 1024, "verifier-0")
    options = options_from_args(
        parse(["serve", "verifier", "--num-workers=1", f"--test-data-cache={tmp_path}"]), config
    )
    assert (options.num_workers, options.test_data_cache) == (1, tmp_path)
    for bad in ("--num-workers=0", "--queue-size=0", "--deadline-s=0", "--results-cache=-1"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            options_from_args(parse(["serve", "verifier", bad]), config)
