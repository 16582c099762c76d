"""The controller's pure parts, without threads or servers: the schedule (what to generate,
which version an evaluation measures), group selection and batch assembly, and scoring with
retries against a real VerificationService whose check fails on chosen requests."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlax_tpu.api.records import Group, RolloutRecord, ScoredRollout
from rlax_tpu.api.verifier import Verdict
from rlax_tpu.config import StalenessConfig, load_config
from rlax_tpu.controller.assembly import assemble_batch, group_has_signal, select_groups
from rlax_tpu.controller.errors import ControllerError, UnjudgedError
from rlax_tpu.controller.schedule import Schedule
from rlax_tpu.controller.scoring import Scorer, ServiceVerifier
from rlax_tpu.staleness import StalenessPolicy
from rlax_tpu.verifiers.service import VerificationService
from rlax_tpu.verifiers.tasks import score_arithmetic

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("on_policy", "one_step_off_policy", "off_policy")


# -- schedule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_every_evaluation_of_the_shipped_demo_measures_a_version_workers_load(preset):
    """`rlax-tpu run configs/tiny_cpu.py --set staleness=PRESET` with the shipped eval_every:
    each evaluation (step 0, every eval_every steps) asks for a loadable version at or
    before its step; off-policy (η = 16) measures version 16 at step 20. The last one
    measures the final weights whatever η is (workers load them for that alone)."""
    config = load_config(str(ROOT / "configs" / "tiny_cpu.py"), [f"staleness={preset}"])
    schedule = Schedule(config)
    ctl = config.controller
    steps = [0, *(s for s in range(1, ctl.num_steps + 1) if schedule.eval_due(s))]
    assert steps[1] == ctl.eval_every == 20
    policy = StalenessPolicy.from_config(config.staleness)
    for step in steps:
        version = schedule.eval_version(step)
        assert policy.is_loadable(version) and 0 <= step - version < policy.reload_every
    assert schedule.eval_version(ctl.num_steps) == ctl.num_steps
    if preset == "off_policy":
        assert [schedule.eval_version(s) for s in steps[:3]] == [0, 16, 32]
        assert not policy.is_loadable(ctl.num_steps)  # 120 = 7 × 16 + 8


@st.composite
def configs(draw):
    eta = draw(st.integers(1, 8))
    n = draw(st.integers(eta - 1, eta + 8))
    steps = draw(st.integers(1, 40))
    base = load_config(str(ROOT / "configs" / "tiny_cpu.py"), [])
    controller = dataclasses.replace(base.controller, num_steps=steps)
    return dataclasses.replace(
        base,
        staleness=StalenessConfig(reload_every=eta, max_staleness=n),
        controller=controller,
        param_server=dataclasses.replace(base.param_server, hot_versions=None),
    )


@given(config=configs())
def test_the_schedule_launches_each_batch_once_with_a_published_acceptable_version(config):
    schedule, policy = Schedule(config), StalenessPolicy.from_config(config.staleness)
    launched: dict[int, int] = {}
    for step in range(config.controller.num_steps):  # the trainer at version `step`
        for batch, version in schedule.to_launch(step, launched):
            assert batch not in launched and batch >= step
            assert version <= step  # published
            assert policy.is_loadable(version) and policy.is_acceptable(batch, version)
            launched[batch] = version
        assert step in launched  # the batch the trainer needs now is under way
    assert sorted(launched) == list(range(config.controller.num_steps))


# -- selection and assembly ------------------------------------------------------------------
def test_groups_with_an_unjudged_sample_are_never_selected():
    groups = [("a", True, False), ("b", False, False), ("c", True, True), ("d", True, False)]
    plain = select_groups(groups, 2, dynamic=False)
    assert (plain.keys, plain.flat, plain.dropped) == (["a", "c"], 2, 1)
    dynamic = select_groups(groups, 2, dynamic=True)  # signal first, then flat, draw order
    assert dynamic.keys == ["a", "c"]
    assert select_groups(groups, 1, dynamic=True).keys == ["c"]
    assert select_groups(groups, 4, dynamic=True).keys == ["a", "c", "d"]  # never "b"


def test_group_has_signal_is_dapos_predicate():
    assert group_has_signal([0.0, 1.0]) and not group_has_signal([1.0, 1.0, 1.0])


def rollout(prompt, sample, version, prompt_tokens, tokens):
    return RolloutRecord(
        batch=0,
        prompt_id=prompt,
        sample_index=sample,
        version=version,
        prompt_tokens=tuple(prompt_tokens),
        tokens=tuple(tokens),
        logprobs=tuple(-0.5 - i for i in range(len(tokens))),
        finish_reason="stop",
    )


def group(*samples):
    """A group of (rollout, reward) pairs."""
    return Group(samples[0][0].prompt_id, tuple(ScoredRollout(r, w) for r, w in samples))


def test_assemble_batch_aligns_responses_with_the_positions_that_score_them():
    groups = [
        group(
            (rollout("p", 0, 3, [5, 6, 7], [8, 9]), 1.0), (rollout("p", 1, 3, [5, 6, 7], [4]), 0.0)
        ),
        group((rollout("q", 0, 2, [1, 2], [3, 4, 5]), 0.5), (rollout("q", 1, 2, [1, 2], []), 0.0)),
    ]
    policy = StalenessPolicy(reload_every=1, max_staleness=1)
    out = assemble_batch(3, groups, policy=policy, max_seq_len=64)
    batch = out.batch
    assert batch.tokens.shape[0] == 4 and batch.tokens.shape[1] >= 5
    np.testing.assert_array_equal(batch.tokens[0, :5], [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(np.flatnonzero(batch.response_mask[0]), [2, 3])
    np.testing.assert_array_equal(np.flatnonzero(batch.response_mask[2]), [1, 2, 3])
    assert not batch.response_mask[3].any()
    np.testing.assert_array_equal(batch.behaviour_logprobs[0, 2:4], [-0.5, -1.5])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(batch.versions, [3, 3, 2, 2])
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.5, 0.0])
    assert out.keys[2] == ("q", 0, 2) and out.staleness_mean == 0.5
    assert out.response_tokens == 6


def test_assemble_batch_refuses_a_rollout_staler_than_n():
    groups = [group((rollout("p", 0, 1, [1, 2], [3]), 1.0))]
    with pytest.raises(ControllerError, match="tokens of version 1, not acceptable for batch 3"):
        assemble_batch(3, groups, policy=StalenessPolicy(1, 1), max_seq_len=64)


# -- scoring ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:  # the fields of a PromptRecord the scorer reads
    verifier: str = "arithmetic"
    reference: str = "5"
    problem: str = ""


class CharTokenizer:
    def decode(self, tokens, **_):
        return "".join(chr(t) for t in tokens)


class FaultyService:
    """A real VerificationService whose arithmetic check raises for `always` request ids and
    for the first attempt of `once` ones; `calls` records each batch it was sent."""

    def __init__(self, always=(), once=()):
        self.always, self.once, self.seen, self.calls = set(always), set(once), set(), []
        self.service = VerificationService(self._check, concurrency=1)

    def _check(self, request):
        first = request.request_id not in self.seen
        self.seen.add(request.request_id)
        if request.request_id in self.always or (first and request.request_id in self.once):
            raise RuntimeError(f"injected fault for {request.request_id}")
        return score_arithmetic(request.response, request.reference)

    def verify_many(self, requests):
        self.calls.append([r.request_id for r in requests])
        return [o.result for o in self.service.verify_batch(requests)]


def items(n):
    answers = ["5", "4", "5", "7"]
    return [
        (Row(), rollout(f"b0:d:{i}", 0, 0, [1], [ord(c) for c in answers[i % 4]])) for i in range(n)
    ]


def scorer(verifier, counters, **kw):
    kw.setdefault("max_unjudged_fraction", 0.5)
    return Scorer(verifier, CharTokenizer(), (), retries=2, backoff_s=0.0, counters=counters, **kw)


def test_scoring_retries_errors_and_leaves_the_persistent_ones_unjudged():
    service = FaultyService(always={"b0:d:1/s0/v0"}, once={"b0:d:2/s0/v0"})
    counters = {}
    judgements = scorer(service, counters).judge(items(4), what="batch 0")
    assert [j.reward for j in judgements] == [1.0, None, 1.0, 0.0]
    assert judgements[1].verdict == Verdict.VERIFIER_ERROR and "injected" in judgements[1].reason
    # Retries send only what failed: twice the persistent fault, once the transient one.
    assert service.calls[1:] == [["b0:d:1/s0/v0", "b0:d:2/s0/v0"], ["b0:d:1/s0/v0"]]
    assert counters == {"verify_errors": 4, "verify_retries": 3, "verify_unjudged": 1}
    service.service.close()


def test_too_many_unjudged_samples_stop_with_the_verifiers_reasons():
    service = FaultyService(always={f"b0:d:{i}/s0/v0" for i in range(3)})
    with pytest.raises(UnjudgedError) as info:
        scorer(service, {}).judge(items(4), what="batch 0")
    assert "batch 0: 3 of 4 samples are unjudged after 2 retries" in str(info.value)
    assert "injected fault for b0:d:0/s0/v0" in str(info.value)
    service.service.close()


def test_a_failed_call_is_retried_like_an_error_result():
    class Flaky:
        def __init__(self):
            self.calls = 0

        def verify_many(self, requests):
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("verifier restarting")
            return [score_arithmetic("5", "5") for _ in requests]

    counters = {}
    judgements = scorer(Flaky(), counters).judge(items(2), what="batch 0")
    assert [j.reward for j in judgements] == [1.0, 1.0]
    assert counters["verify_errors"] == 2 and counters["verify_unjudged"] == 0


def test_verification_is_spread_over_the_verifier_services_in_order():
    class Service:
        def __init__(self):
            self.chunks = []

        def verify(self, requests):
            self.chunks.append(list(requests))
            return [f"r{r}" for r in requests]

    services = [Service(), Service()]
    results = ServiceVerifier(services).verify_many(list(range(600)))
    assert results == [f"r{i}" for i in range(600)]
    # Chunk i (CHUNK = 256 requests) goes to service i mod n; results come back in order.
    assert [len(c) for c in services[0].chunks] == [256, 88]
    assert services[1].chunks == [list(range(256, 512))]


# -- no JAX in the controller's process -----------------------------------------------------
def test_the_controller_and_the_clients_it_uses_import_no_jax():
    modules = [
        "rlax_tpu.controller",
        "rlax_tpu.controller.controller",
        "rlax_tpu.launch.job",
        "rlax_tpu.launch.prefilter",
        "rlax_tpu.api.param_server",
        "rlax_tpu.verifiers.service",
        "rlax_tpu.api.trainer",
        "rlax_tpu.api.inference",
        "rlax_tpu.data.tokenizer",
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('jax', 'jaxlib', 'flax', 'optax', 'orbax', 'tensorstore')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_runs_sharing_a_verifier_send_request_ids_in_their_own_namespace():
    """Two runs (another run directory or another config) never reuse each other's request
    ids on a shared verifier service; a resumed run keeps its own."""
    from rlax_tpu.controller.scoring import request_id, run_prefix

    rollout = RolloutRecord(
        batch=0, prompt_id="b0:gsm8k:7", sample_index=1, version=0, prompt_tokens=(),
        tokens=(), logprobs=(), finish_reason="stop",
    )  # fmt: skip
    a = run_prefix("d" * 64, "gs://bucket/runs/a")
    assert a == run_prefix("d" * 64, "gs://bucket/runs/a")  # the same run, resumed
    assert a != run_prefix("d" * 64, "gs://bucket/runs/b")
    assert a != run_prefix("e" * 64, "gs://bucket/runs/a")
    assert request_id(rollout, a) == f"{a}b0:gsm8k:7/s1/v0"
    assert request_id(rollout) == "b0:gsm8k:7/s1/v0"


# -- elastic workers ------------------------------------------------------------------------------
def one_sample_pool(workers, tmp_path, **kwargs):
    """A started GenerationPool of `workers` (clients, or stand-ins answering as clients do),
    one sample per prompt, logging under `tmp_path`."""
    from rlax_tpu.api.inference import SamplingParams
    from rlax_tpu.controller.generation import GenerationPool
    from rlax_tpu.controller.snapshots import RolloutLog
    from rlax_tpu.controller.workers import WorkerThreads

    progress = {k: kwargs.pop(k) for k in ("progress_every_s",) if k in kwargs}
    threads = WorkerThreads(workers, sampling=SamplingParams(), counters={}, **kwargs)
    pool = GenerationPool(threads, RolloutLog(str(tmp_path)), samples=1, **progress)
    pool.start()
    return pool


def finished_rollouts(requests, version):
    """What a worker's Generate yields for `requests`: each finished ("stop")."""
    from rlax_tpu.api.inference import Rollout

    for r in requests:
        yield Rollout(
            r.request_id, r.prompt_id, r.sample_index, version, (1,), (2,), (0.0,), "stop"
        )


def test_with_every_worker_silent_the_pool_waits_its_bound_then_stops_naming_the_fix(tmp_path):
    """A real worker client at an address where nothing listens: the job is kept (not lost)
    while the pool waits for a worker, then the run stops with a message naming the wait."""
    import socket

    from rlax_tpu.api.inference import GenerationRequest, InferenceWorkerClient

    with socket.socket() as s:  # a free port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    heard: list[str] = []
    client = InferenceWorkerClient(address, auth_token="t")
    pool = one_sample_pool([client], tmp_path, wait_s=1.0, report=heard.append)
    request = GenerationRequest(
        request_id="p/s0/v0", prompt_id="p", sample_index=0, prompt_tokens=(1, 2)
    )
    try:
        with pytest.raises(ControllerError, match=r"no inference worker has answered for 1s"):
            pool.generate([request], version=0)
    finally:
        pool.stop()
        client.close()
    assert pool.lost == 1 and "its requests go to the other workers" in heard[0]
    assert "component_wait_s" in pool.failure


def test_a_version_the_parameter_server_lost_is_published_again_once_and_loaded(tmp_path):
    """A worker's load finds the version missing (NOT_FOUND: the parameter server restarted
    before it was on storage): the trainer publishes it again, once, and the job is loaded
    and generated; a version still missing after that stops the run."""
    import grpc

    from rlax_tpu.api.inference import GenerationRequest, InferenceCallError, LoadResult

    class Worker:  # the worker's answers, as its client returns them
        def __init__(self, held):
            self.held, self.address = held, "worker"

        def load(self, version, *, evaluation=False):
            if version not in self.held:
                raise InferenceCallError(
                    f"version {version} is not held", grpc.StatusCode.NOT_FOUND
                )
            return LoadResult(version=version, already_loaded=False, aborted=())

        def generate(self, requests, version):
            return finished_rollouts(requests, version)

    held, asked = set(), []

    def republish(version):
        asked.append(version)
        if version == 3:  # the trainer holds version 3 only
            held.add(version)

    pool = one_sample_pool([Worker(held)], tmp_path, republish=republish, report=lambda line: None)
    request = GenerationRequest(
        request_id="p/s0/v3", prompt_id="p", sample_index=0, prompt_tokens=(1,)
    )
    try:
        assert list(pool.generate([request], version=3)) == ["p/s0/v3"]
        with pytest.raises(ControllerError, match="version 2 is not held"):
            pool.generate([dataclasses.replace(request, request_id="p/s0/v2")], version=2)
    finally:
        pool.stop()
    assert asked == [3, 2]


def test_a_worker_restarted_between_two_jobs_loads_its_version_again(tmp_path):
    """The pool believes worker 0 holds version 2 (it loaded it for the last job), but the
    worker was restarted meanwhile, unseen (no call failed): its Generate is refused
    (FAILED_PRECONDITION, no weights). The pool loads the version again and generates; it
    does not stop the run. A worker that refuses again after the reload does."""
    import grpc

    from rlax_tpu.api.inference import GenerationRequest, InferenceCallError, LoadResult

    class Worker:  # the worker's answers, as its client returns them
        address = "worker"

        def __init__(self):
            self.held, self.loads, self.forgets = -1, [], False

        def load(self, version, *, evaluation=False):
            self.loads.append(version)
            self.held = version
            return LoadResult(version=version, already_loaded=False, aborted=())

        def generate(self, requests, version):
            if self.forgets:
                self.held = -1
            if self.held != version:
                raise InferenceCallError(
                    "the worker holds no weights yet: Load a version before Generate",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            yield from finished_rollouts(requests, version)

    worker, heard = Worker(), []
    pool = one_sample_pool([worker], tmp_path, report=heard.append)

    def request(n: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"p{n}/s0/v2", prompt_id=f"p{n}", sample_index=0, prompt_tokens=(1,)
        )

    try:
        assert list(pool.generate([request(0)], version=2)) == ["p0/s0/v2"]
        worker.held = -1  # restarted: a fresh process holds nothing
        assert list(pool.generate([request(1)], version=2)) == ["p1/s0/v2"]
        assert worker.loads == [2, 2] and "lost its weights" in heard[-1]
        worker.forgets = True  # refuses whatever was loaded: a real fault
        with pytest.raises(ControllerError, match="holds no weights"):
            pool.generate([request(2)], version=2)
    finally:
        pool.stop()


def test_a_long_generation_reports_progress_and_a_stop_ends_the_wait(tmp_path):
    """While a batch is generated, the pool says every `progress_every_s` how many rollouts
    are in and what each worker does, from its status (compiling for how long, or tokens
    and live sequences); a stopped run ends the wait for a batch and an evaluation's
    generation at once."""
    import threading

    from rlax_tpu.api.inference import GenerationRequest, LoadResult
    from rlax_tpu.controller.generation import BatchState, Prompt, Stopped
    from rlax_tpu.data.datasets import PromptRecord

    release = threading.Event()

    class Worker:  # compiles, then decodes, until released
        address = "worker"

        def __init__(self):
            self.asked = 0

        def load(self, version, *, evaluation=False):
            return LoadResult(version=version, already_loaded=False, aborted=())

        def generate(self, requests, version):
            release.wait(30)
            yield from finished_rollouts(requests, version)

        def status_details(self, timeout_s):
            self.asked += 1
            if self.asked == 1:
                return {"compiling_s": "12.4", "tokens_generated": "0", "active_slots": "0"}
            return {"compiling_s": "0.0", "tokens_generated": "1234", "active_slots": "3"}

    heard: list[str] = []
    pool = one_sample_pool([Worker()], tmp_path, report=heard.append, progress_every_s=0.3)
    batch = BatchState(index=0, version=0, samples=1)
    try:
        records = [
            PromptRecord(dataset="d", id=f"d:{i}", prompt=f"q{i}", reference="1") for i in range(2)
        ]
        pool.submit(batch, [Prompt(f"b0:d:{i}", (1, 2), r) for i, r in enumerate(records)])
        stop = threading.Event()
        threading.Timer(1.5, stop.set).start()
        assert pool.wait(batch, stop) is False  # stopped, not finished
        lines = [line for line in heard if line.startswith("batch 0:")]
        assert len(lines) >= 2, heard
        assert lines[0].startswith("batch 0: 0 of 2 rollouts in after ")
        assert lines[0].endswith("worker 0 compiling for 12s")
        assert lines[1].endswith("worker 0: 1,234 tokens generated, 3 sequences live")
        request = GenerationRequest(
            request_id="e/v0", prompt_id="e", sample_index=0, prompt_tokens=(1,)
        )
        t0 = time.monotonic()
        with pytest.raises(Stopped):
            pool.generate([request], version=0, stop=stop)
        assert time.monotonic() - t0 < 2
    finally:
        release.set()
        pool.stop()


def test_ended_episodes_go_to_their_worker_with_its_next_generate_call(tmp_path):
    """An episode that ended on worker 1 is named in worker 1's next Generate call (its
    parked pages can go), once; worker 0 never hears of it."""
    import queue

    from rlax_tpu.api.inference import GenerationRequest, LoadResult
    from rlax_tpu.controller.workers import Job

    class Worker:  # the worker's answers, as its client returns them
        def __init__(self, name):
            self.address, self.ended = name, []

        def load(self, version, *, evaluation=False):
            return LoadResult(version=version, already_loaded=False, aborted=())

        def generate(self, requests, version, ended=()):
            self.ended.append(list(ended))
            return finished_rollouts(requests, version)

    workers = [Worker("w0"), Worker("w1")]
    pool = one_sample_pool(workers, tmp_path)
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    try:
        pool.threads.ended(1, ("b0:d:7", 0, 0))
        for n in range(2):  # jobs pinned to worker 1, as an episode's next turns are
            request = GenerationRequest(f"p{n}/s0/v0", f"p{n}", 0, (1,))
            pool.threads.put(Job((0, n), 0, [request], delivered.put, print, worker=1))
            assert [r.request_id for r in delivered.get(timeout=30)] == [request.request_id]
    finally:
        pool.stop()
    assert workers[1].ended == [[("b0:d:7", 0, 0)], []]
    assert workers[0].ended == []


def test_an_episode_turns_id_leads_back_to_its_first_request_whatever_the_dataset_ids():
    """Turn n > 1 of an episode is requested as "<first id>/turn<n>"; a dataset id holding
    "/turn" itself must not be cut (evaluation waited forever when two episodes' results
    fell under one cut id)."""
    from rlax_tpu.controller.generation import episode_root

    assert episode_root("eval:d:7/v3/turn2") == "eval:d:7/v3"
    assert episode_root("eval:d:a/turn1/v3") == "eval:d:a/turn1/v3"  # the first turn itself
    assert episode_root("eval:d:a/turn1/v3/turn4") == "eval:d:a/turn1/v3"
    assert episode_root("b0:d:x/turnstile/s0/v0") == "b0:d:x/turnstile/s0/v0"


def test_a_resumed_batch_keeps_the_verdicts_an_earlier_process_logged(tmp_path):
    """A batch whose rollouts an earlier process logged with their verdicts (a run resumed
    after it) is judged by those verdicts, not again (a judge need not answer the same
    twice); only the rollouts it had not judged go to the verifier."""
    import threading

    from rlax_tpu.api.inference import LoadResult, Rollout
    from rlax_tpu.api.records import Judgement
    from rlax_tpu.config import RunConfig
    from rlax_tpu.controller.batches import BatchBuilder
    from rlax_tpu.controller.generation import BatchState, Prompt
    from rlax_tpu.controller.snapshots import RolloutLog
    from rlax_tpu.data.datasets import PromptRecord

    class Worker:  # answers "5" to every request
        address = "worker"

        def load(self, version, *, evaluation=False):
            return LoadResult(version=version, already_loaded=False, aborted=())

        def generate(self, requests, version):
            for r in requests:
                yield Rollout(
                    r.request_id, r.prompt_id, r.sample_index, version, (1,), (53,), (0.0,), "stop"
                )

    earlier = RolloutLog(str(tmp_path))  # the process before the resume: judged b0:d:0 only
    logged = rollout("b0:d:0", 0, 0, [1], [53])
    earlier.append(0, [logged])
    earlier.append_verdicts(0, [(logged.key, Judgement(0.25, "graded", "the earlier judge"))])
    earlier.close()
    pool = one_sample_pool([Worker()], tmp_path)
    service = FaultyService()
    builder = BatchBuilder(
        RunConfig(),
        pool=pool,
        scorer=scorer(service, {}),
        log=pool.log,
        refill=None,
        replay=None,
        policy=StalenessPolicy(1, 0),
        encode=lambda record: (1,),
        counters={},
    )
    try:
        batch = BatchState(0, 0, samples=1)
        records = [
            PromptRecord(dataset="d", id=str(i), prompt="2+3", reference="5", verifier="arithmetic")
            for i in range(2)
        ]
        pool.submit(batch, [Prompt(f"b0:d:{i}", (1,), r) for i, r in enumerate(records)])
        assert pool.wait(batch, threading.Event())
        builder.judge(batch)
    finally:
        pool.stop()
        service.service.close()
    judged = {p: (j.reward, j.verdict) for (p, _), j in batch.judgements.items()}
    assert judged == {"b0:d:0": (0.25, "graded"), "b0:d:1": (1.0, "accepted")}
    assert service.calls == [["b0:d:1/s0/v0"]]
