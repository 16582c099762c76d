"""Rewards of your own: a reward module written into a temporary directory, named by file
path and by module name, judged through a real worker pool and a real `rlax-tpu serve
verifier` over gRPC; the service refusing to start with a function that does not load; and
`verifiers.address` honoured by the local launcher and by a whole `rlax-tpu run`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import grpc
import pytest
from jobenv import user_env
from processes import ProcessGroup

from rlax_tpu.api.records import RolloutRecord
from rlax_tpu.api.verifier import (
    RequestIdReusedError,
    Verdict,
    VerificationRequest,
    VerificationResult,
    VerifierCallError,
    VerifierClient,
    request_from_proto,
    request_to_proto,
)
from rlax_tpu.config import (
    ConfigError,
    ControllerConfig,
    DatasetConfig,
    RunConfig,
    VerifierConfig,
)
from rlax_tpu.controller.scoring import Scorer
from rlax_tpu.launch.launcher import ComponentFailed, LocalCluster
from rlax_tpu.launch.remote import ConnectError
from rlax_tpu.verifiers import functions
from rlax_tpu.verifiers.functions import (
    RewardFunctionError,
    configured_reward_functions,
    load_reward_function,
    result_from_return,
)
from rlax_tpu.verifiers.local import LocalVerifier, pool_for
from rlax_tpu.verifiers.service import VerificationService

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "reward-functions-test-token"

REWARDS = """
import json
import time

def exact(prompt, response, reference, metadata):
    return float(response.strip() == reference)

def graded(prompt, response, reference, metadata):
    return (0.5, "wrong_answer")

def detailed(prompt, response, reference, metadata):
    return {"reward": 0.25, "verdict": "no_answer", "reason": "no final line"}

def echo(prompt, response, reference, metadata):
    seen = {"prompt": prompt, "response": response, "reference": reference, "metadata": metadata}
    return {"reward": 1.0, "reason": json.dumps(seen, sort_keys=True)}

def broken(prompt, response, reference, metadata):
    raise ZeroDivisionError("the grader divided by zero")

def endless(prompt, response, reference, metadata):
    while True:
        pass

def not_a_reward(prompt, response, reference, metadata):
    return "1.0"

def greedy(prompt, response, reference, metadata):
    return len(bytearray(64 * 2**30))

def record(prompt, response, reference, metadata):
    call = {"prompt": prompt, "reference": reference, "metadata": metadata}
    with open(metadata["log"], "a") as f:
        f.write(json.dumps(call) + "\\n")
    return (float(response[:1].isdigit()), "accepted" if response[:1].isdigit() else "no_answer")

answer = 42
"""


@dataclasses.dataclass(frozen=True)
class RewardModule:
    """The reward module, as a file and as the package `package` (its directory on sys.path
    / PYTHONPATH)."""

    file: Path
    package: str

    def by_path(self, name: str) -> str:
        return f"{self.file}:{name}"

    def by_module(self, name: str) -> str:
        return f"{self.package}.rewards:{name}"


def write_reward_module(root: Path) -> RewardModule:
    package = f"my_rewards_{uuid.uuid4().hex[:8]}"  # unique: nothing cached under its name
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    file = root / package / "rewards.py"
    file.write_text(REWARDS)
    return RewardModule(file, package)


def req(spec: str, response: str = "42", **fields) -> VerificationRequest:
    fields.setdefault("reference", "42")
    return VerificationRequest(kind="function", function=spec, response=response, **fields)


# -- what a function returns ------------------------------------------------------------------
def test_a_bare_score_is_accepted_above_zero_else_a_wrong_answer():
    results = [result_from_return("m:f", v) for v in (1.0, 3, 0.0, -0.5, True)]
    assert [(r.reward, r.verdict) for r in results] == [
        (1.0, Verdict.ACCEPTED),
        (3.0, Verdict.ACCEPTED),
        (0.0, Verdict.WRONG_ANSWER),
        (-0.5, Verdict.WRONG_ANSWER),
        (1.0, Verdict.ACCEPTED),
    ]
    assert results[0].reason == "reward function 'm:f' returned 1.0"


def test_a_tuple_and_a_dict_name_their_verdict_and_reason():
    assert result_from_return("m:f", (0.5, "wrong_answer")) == VerificationResult(
        reward=0.5,
        verdict=Verdict.WRONG_ANSWER,
        reason="reward function 'm:f' returned (0.5, 'wrong_answer')",
    )
    value = {"reward": 0.0, "verdict": "no_answer", "reason": "no final line"}
    assert result_from_return("m:f", value) == VerificationResult(
        reward=0.0, verdict=Verdict.NO_ANSWER, reason="no final line"
    )
    # Without a verdict, the score decides it as for a bare score.
    assert result_from_return("m:f", {"reward": 2}).verdict == Verdict.ACCEPTED


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("1.0", "the score '1.0' is not a number"),
        (None, "the score None is not a number"),
        (math.nan, "the score nan is not finite"),
        (math.inf, "the score inf is not finite"),
        ((1.0,), "a tuple must be (score, verdict), got 1 items"),
        ((1.0, "great"), "the verdict 'great' is not one of accepted, wrong_answer"),
        ({"score": 1.0}, "unknown keys ['score']"),
        ({"verdict": "accepted"}, "no 'reward' key"),
        ({"reward": 1.0, "reason": 5}, "the reason 5 is not a string"),
    ],
)
def test_a_return_that_is_not_a_reward_is_a_verifier_error_naming_it(value, problem):
    result = result_from_return("pkg.mod:score", value)
    assert (result.reward, result.verdict) == (0.0, Verdict.VERIFIER_ERROR)
    shown = reprlib.repr(value)  # shortened: a function may return something huge
    assert result.reason.startswith(f"reward function 'pkg.mod:score' returned {shown}: ")
    assert problem in result.reason


def test_a_long_reason_is_cut():
    result = result_from_return("m:f", {"reward": 1.0, "reason": "x" * 10_000})
    assert len(result.reason) < functions.MAX_REASON_CHARS + 50
    assert result.reason.endswith(f"({10_000 - functions.MAX_REASON_CHARS} more characters)")


# -- loading ------------------------------------------------------------------------------------
@pytest.fixture
def module(tmp_path, monkeypatch):
    rewards = write_reward_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return rewards


def test_a_function_loads_by_file_path_and_by_module_name(module):
    by_path = load_reward_function(module.by_path("exact"))
    by_module = load_reward_function(module.by_module("exact"))
    for fn in (by_path, by_module):
        assert fn(prompt="", response="42", reference="42", metadata={}) == 1.0
    assert load_reward_function(module.by_path("exact")) is by_path  # the file runs once


def test_a_relative_file_path_is_read_from_the_working_directory(module, monkeypatch):
    monkeypatch.chdir(module.file.parent.parent)
    relative = f"{module.package}/rewards.py:graded"
    assert load_reward_function(relative)(prompt="", response="", reference="", metadata={})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:score", "no module named 'no_such_module_xyz'"),
        ("{module}:absent", "has no attribute 'absent' (its functions: broken, detailed, echo"),
        ("{module}:answer", "'answer' is not callable (it is an int)"),
        ("{module}:json", "'json' is not callable (it is a module)"),
        ("/nonexistent/rewards.py:score", "no file '/nonexistent/rewards.py'"),
        ("rewards", "expected 'package.module:function' or 'path/to/file.py:function'"),
        ("a b:score", "is neither a module name"),
    ],
)
def test_a_spec_that_does_not_load_names_itself_and_the_problem(module, spec, message):
    spec = spec.format(module=f"{module.package}.rewards", file=module.file)
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(spec)
    assert str(info.value).startswith(f"reward function {spec!r}: ")
    assert message in str(info.value)


def test_a_function_that_cannot_take_the_reward_arguments_is_refused(tmp_path):
    file = tmp_path / "old.py"
    file.write_text("def score(response, answer):\n    return 1.0\n")
    with pytest.raises(RewardFunctionError, match=r"score\(response, answer\) cannot take"):
        load_reward_function(f"{file}:score")
    flexible = tmp_path / "flexible.py"
    flexible.write_text("def score(**kwargs):\n    return 1.0\n")
    assert load_reward_function(f"{flexible}:score")


def test_an_import_error_inside_the_module_is_named(tmp_path):
    file = tmp_path / "bad.py"
    file.write_text("import no_such_dependency_xyz\n\ndef score(**kw):\n    return 1.0\n")
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(f"{file}:score")
    assert "raised ModuleNotFoundError: No module named 'no_such_dependency_xyz'" in str(info.value)


def test_the_config_names_the_reward_functions_of_its_datasets_and_of_data():
    dataset = types.SimpleNamespace
    config = types.SimpleNamespace(
        controller=types.SimpleNamespace(
            datasets=(dataset(reward_function="a:f"), dataset(reward_function=""), dataset())
        ),
        data=dataset(reward_function="b.py:g"),
    )
    assert configured_reward_functions(config) == ["a:f", "b.py:g"]
    config.data = None
    config.controller.datasets += (dataset(reward_function="a:f"),)
    assert configured_reward_functions(config) == ["a:f"]


# -- the request ----------------------------------------------------------------------------------
class CharTokenizer:
    def decode(self, tokens, **_):
        return "".join(chr(t) for t in tokens)


@dataclasses.dataclass(frozen=True)
class Record:  # the PromptRecord fields the scorer reads
    verifier: str = "function"
    prompt: str = ""
    messages: tuple = ()
    reference: str = "42"
    problem: str = ""
    reward_function: str = "my_rewards.gsm8k:score"
    metadata: dict = dataclasses.field(default_factory=dict)


def test_the_scorer_sends_a_reward_function_the_prompt_metadata_and_spec():
    scorer = Scorer(
        None, CharTokenizer(), (), retries=0, backoff_s=0, max_unjudged_fraction=1, counters={}
    )
    rollout = RolloutRecord(
        batch=0, prompt_id="p0", sample_index=1, version=2, prompt_tokens=(1,),
        tokens=(52, 50), logprobs=(0.0, 0.0), finish_reason="stop",
    )  # fmt: skip
    text = scorer.request(Record(prompt="What is 6*7?", metadata={"z": 1, "a": [2]}), rollout)
    assert (text.kind, text.function, text.response) == ("function", "my_rewards.gsm8k:score", "42")
    assert (text.prompt, text.chat, text.metadata) == ("What is 6*7?", False, '{"a": [2], "z": 1}')
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"})
    chat = scorer.request(Record(messages=messages), rollout)
    assert chat.chat and json.loads(chat.prompt) == list(messages)
    assert chat.metadata == "{}"
    # Other verifiers send no prompt: requests stay small.
    math_request = scorer.request(Record(verifier="math", prompt="What is 6*7?"), rollout)
    assert (math_request.prompt, math_request.metadata, math_request.function) == ("", "", "")


def test_the_new_fields_cross_the_wire():
    request = req("a.py:f", prompt='[{"role": "user", "content": "hi"}]', chat=True)
    request = dataclasses.replace(request, metadata='{"level": 3}', request_id="p/s0/v0")
    assert request_from_proto(request_to_proto(request), 0) == request
    with pytest.raises(ValueError, match=r"requests\[0\] is of kind 'function' but names no"):
        request_from_proto(request_to_proto(req("")), 0)


def test_a_request_id_reused_with_other_metadata_or_function_is_refused():
    def verify(request):
        return VerificationResult(reward=1.0, verdict=Verdict.ACCEPTED, reason="ok")

    service = VerificationService(verify, concurrency=1)
    try:
        first = req("a:f", metadata='{"level": 1}', request_id="p/s0/v0")
        assert not service.verify_batch([first])[0].cached
        assert service.verify_batch([first])[0].cached
        for other in (
            dataclasses.replace(first, metadata='{"level": 2}'),
            dataclasses.replace(first, function="a:g"),
            dataclasses.replace(first, prompt="another prompt"),
            dataclasses.replace(first, chat=True),
        ):
            with pytest.raises(RequestIdReusedError):
                service.verify_batch([other])
    finally:
        service.close()


# -- through a real worker pool ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    """A LocalVerifier on a real 2-worker pool (1 s reward deadline) and the reward module,
    its directory on sys.path before the workers start (so they can import it by name)."""
    root = tmp_path_factory.mktemp("pooled")
    rewards = write_reward_module(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        config = VerifierConfig(num_workers=2, reward_timeout_s=1.0)
        pool = pool_for(config, reward_functions=[rewards.by_path("exact")])
        verifier = LocalVerifier(config, pool)
        yield verifier, rewards
        pool.close()


def test_judged_in_the_pool_by_file_path_and_by_module_name(pooled):
    verifier, rewards = pooled
    requests = [
        req(rewards.by_path("exact"), "42"),
        req(rewards.by_path("exact"), "41"),
        req(rewards.by_module("exact"), "42"),
        req(rewards.by_module("exact"), "41"),
    ]
    results = verifier.verify_many(requests)
    assert [(r.reward, r.verdict) for r in results] == [
        (1.0, Verdict.ACCEPTED),
        (0.0, Verdict.WRONG_ANSWER),
    ] * 2
    assert results[2].reason == f"reward function {rewards.by_module('exact')!r} returned 1.0"
    assert os.getpid() not in verifier.pool.pids()  # ran in the workers, not here


def test_the_function_receives_the_prompt_chat_messages_reference_and_metadata(pooled):
    verifier, rewards = pooled
    spec = rewards.by_path("echo")
    text = verifier.verify(req(spec, "r", prompt="What?", metadata='{"level": 3}'))
    assert json.loads(text.reason) == {
        "prompt": "What?",
        "response": "r",
        "reference": "42",
        "metadata": {"level": 3},
    }
    messages = [{"role": "user", "content": "What?"}]
    chat = verifier.verify(req(spec, "r", prompt=json.dumps(messages), chat=True))
    assert json.loads(chat.reason)["prompt"] == messages
    assert json.loads(chat.reason)["metadata"] == {}


def test_tuple_and_dict_returns_through_the_pool(pooled):
    verifier, rewards = pooled
    graded, detailed = verifier.verify_many(
        [req(rewards.by_path("graded")), req(rewards.by_module("detailed"))]
    )
    assert (graded.reward, graded.verdict) == (0.5, Verdict.WRONG_ANSWER)
    assert (detailed.reward, detailed.verdict, detailed.reason) == (
        0.25,
        Verdict.NO_ANSWER,
        "no final line",
    )


def test_an_exception_is_a_verifier_error_with_its_type_and_message(pooled):
    verifier, rewards = pooled
    result = verifier.verify(req(rewards.by_path("broken")))
    assert (result.reward, result.verdict) == (0.0, Verdict.VERIFIER_ERROR)
    assert result.reason.startswith(
        f"reward function {rewards.by_path('broken')!r} raised ZeroDivisionError: the grader "
        f"divided by zero (at {rewards.file}:"
    )


def test_a_bad_return_is_a_verifier_error_naming_the_function_and_the_value(pooled):
    verifier, rewards = pooled
    result = verifier.verify(req(rewards.by_module("not_a_reward")))
    assert result.verdict == Verdict.VERIFIER_ERROR
    assert f"reward function {rewards.by_module('not_a_reward')!r} returned '1.0'" in result.reason


def test_an_endless_loop_is_a_time_limit_within_the_deadline(pooled):
    verifier, rewards = pooled
    timeouts = verifier.pool.stats()["timeouts"]
    t0 = time.monotonic()
    result = verifier.verify(req(rewards.by_path("endless")))
    elapsed = time.monotonic() - t0
    assert (result.reward, result.verdict) == (0.0, Verdict.TIME_LIMIT)
    assert result.reason == f"reward function {rewards.by_path('endless')!r} ran past 1s"
    assert 1.0 <= elapsed < 3.0
    assert verifier.pool.stats()["timeouts"] == timeouts + 1  # its worker was killed
    assert verifier.verify(req(rewards.by_path("exact"))).verdict == Verdict.ACCEPTED


def test_a_function_past_the_workers_memory_limit_is_a_memory_limit(pooled):
    verifier, rewards = pooled
    result = verifier.verify(req(rewards.by_path("greedy")))
    assert (result.reward, result.verdict) == (0.0, Verdict.MEMORY_LIMIT)
    assert f"reward function {rewards.by_path('greedy')!r} ran out of memory" in result.reason


def test_a_function_that_does_not_load_in_the_worker_is_a_verifier_error(pooled):
    verifier, rewards = pooled
    result = verifier.verify(req(f"{rewards.file}:absent"))
    assert result.verdict == Verdict.VERIFIER_ERROR
    assert "has no attribute 'absent'" in result.reason
    bad = verifier.verify(req(rewards.by_path("echo"), metadata="[1, 2]"))
    assert bad.verdict == Verdict.VERIFIER_ERROR and "not an object" in bad.reason


def test_the_configs_functions_are_imported_when_a_worker_starts(tmp_path):
    slow = tmp_path / "slow_import.py"
    slow.write_text("import time\ntime.sleep(1.5)\n\ndef score(**kw):\n    return 1.0\n")
    config = VerifierConfig(num_workers=1, reward_timeout_s=1.0)
    spec = f"{slow}:score"
    # Imported at the worker's start: the import is not counted against the deadline.
    with pool_for(config, reward_functions=[spec]) as pool:
        assert LocalVerifier(config, pool).verify(req(spec)).verdict == Verdict.ACCEPTED
    # Imported by the first request: it is.
    with pool_for(config) as pool:
        assert LocalVerifier(config, pool).verify(req(spec)).verdict == Verdict.TIME_LIMIT


# -- through a real verifier service --------------------------------------------------------------
def config_with(tmp_path: Path, *specs: str, **verifiers) -> Path:
    """A run config (JSON) whose datasets name `specs`."""
    datasets = tuple(
        DatasetConfig(path=str(tmp_path / "data.jsonl"), verifier="function", reward_function=s)
        for s in specs
    )
    config = RunConfig(
        controller=ControllerConfig(datasets=datasets),
        verifiers=VerifierConfig(num_workers=2, **verifiers),
    )
    path = tmp_path / f"config-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(config.to_dict()))
    return path


def serve_verifier(group: ProcessGroup, config: Path, root: Path, **kwargs):
    return group.start_component(
        "verifier",
        str(config),
        token=TOKEN,
        args=["--test-data-cache", str(root / "cache")],
        env={"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])},
        **kwargs,
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    rewards = write_reward_module(root)
    specs = (rewards.by_path("exact"), rewards.by_module("graded"))
    config = config_with(root, *specs, reward_timeout_s=2.0)
    group = ProcessGroup()
    process = serve_verifier(group, config, root, ready_timeout_s=60)
    client = VerifierClient(process.address, auth_token=TOKEN)
    yield process, client, rewards
    client.close()
    group.stop_all()


def test_the_service_judges_reward_functions_over_grpc(service):
    process, client, rewards = service
    assert "reward functions loaded: " in process.stderr()
    requests = [
        req(rewards.by_path("exact"), "42", request_id="a"),
        req(rewards.by_module("exact"), "41", request_id="b"),
        req(rewards.by_module("graded"), request_id="c"),
        req(rewards.by_path("detailed"), request_id="d"),
        req(rewards.by_path("echo"), "r", prompt="Q?", metadata='{"level": 3}', request_id="e"),
        req(rewards.by_path("broken"), request_id="f"),
        req(rewards.by_path("not_a_reward"), request_id="g"),
    ]
    results = client.verify(requests, deadline_s=60)
    assert [(r.reward, r.verdict) for r in results] == [
        (1.0, Verdict.ACCEPTED),
        (0.0, Verdict.WRONG_ANSWER),
        (0.5, Verdict.WRONG_ANSWER),
        (0.25, Verdict.NO_ANSWER),
        (1.0, Verdict.ACCEPTED),
        (0.0, Verdict.VERIFIER_ERROR),
        (0.0, Verdict.VERIFIER_ERROR),
    ]
    assert json.loads(results[4].reason) == {
        "prompt": "Q?",
        "response": "r",
        "reference": "42",
        "metadata": {"level": 3},
    }
    assert "raised ZeroDivisionError: the grader divided by zero" in results[5].reason
    assert "returned '1.0': the score '1.0' is not a number" in results[6].reason
    # Idempotent by request id, the metadata included in what an id stands for.
    again = client.verify_detailed([requests[4]], deadline_s=60)
    assert again[0][1] is True
    other = dataclasses.replace(requests[4], metadata='{"level": 4}')
    with pytest.raises(VerifierCallError) as info:
        client.verify([other], deadline_s=60)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_service_answers_an_endless_function_with_a_time_limit(service):
    process, client, rewards = service
    t0 = time.monotonic()
    [result] = client.verify([req(rewards.by_path("endless"))], deadline_s=60)
    assert (result.reward, result.verdict) == (0.0, Verdict.TIME_LIMIT)
    assert result.reason == f"reward function {rewards.by_path('endless')!r} ran past 2s"
    assert time.monotonic() - t0 < 2.0 + 3.0  # verifiers.reward_timeout_s + the call
    assert client.metrics()["pool"]["timeouts"] >= 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:score", "no module named 'no_such_module_xyz'"),
        ("{file}:absent", "has no attribute 'absent'"),
        ("{file}:answer", "'answer' is not callable"),
    ],
)
def test_the_service_refuses_to_start_with_a_reward_function_that_does_not_load(
    tmp_path, spec, message
):
    rewards = write_reward_module(tmp_path)
    spec = spec.format(file=rewards.file)
    config = config_with(tmp_path, rewards.by_path("exact"), spec)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RLAX_TPU_AUTH_TOKEN": TOKEN}
    command = ["serve", "verifier", str(config), "--port", "0"]
    command += ["--test-data-cache", str(tmp_path / "cache")]
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "READY" not in done.stdout
    assert f"reward function {spec!r}: " in done.stderr
    assert message in done.stderr


# -- verifiers.address -------------------------------------------------------------------------
@pytest.fixture
def external_verifier(tmp_path):
    group = ProcessGroup()
    process = group.start_component(
        "verifier", None, token=TOKEN, args=["--test-data-cache", str(tmp_path / "cache")]
    )
    yield process
    group.stop_all()


def stub_starts(monkeypatch) -> list[str]:
    """LocalCluster._spawn records the component names and starts nothing; _ready gives
    each a made-up address."""
    started: list[str] = []

    def fake_spawn(self, name, args, ready_timeout_s):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started.append(name)
        return types.SimpleNamespace(name=name, address=f"127.0.0.1:{10_000 + len(started)}")

    def fake_ready(self, child):
        self.addresses.setdefault(child.name.rsplit("-", 1)[0], []).append(child.address)
        return child.address

    monkeypatch.setattr(LocalCluster, "_spawn", fake_spawn)
    monkeypatch.setattr(LocalCluster, "_ready", fake_ready)
    return started


def cluster(tmp_path: Path, overrides=(), env=None) -> LocalCluster:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(RunConfig().to_dict()))
    return LocalCluster(
        str(config),
        num_workers=1,
        log_dir=tmp_path / "logs",
        param_storage=str(tmp_path / "params"),
        env=env,
        overrides=overrides,
    )


def test_verifiers_address_is_host_port_pairs():
    config = RunConfig().apply_overrides(["verifiers.address=10.0.0.1:50051, [::1]:7"])
    assert config.verifiers.addresses() == ["10.0.0.1:50051", "[::1]:7"]
    for bad in ("localhost", "host:port", ":50051", "host:0"):
        with pytest.raises(ConfigError, match="verifiers.address: must be host:port"):
            RunConfig().apply_overrides([f"verifiers.address={bad}"])


def test_the_local_cluster_uses_the_verifier_at_verifiers_address_and_starts_none(
    tmp_path, monkeypatch, external_verifier
):
    started = stub_starts(monkeypatch)
    address = external_verifier.address
    with cluster(
        tmp_path, [f"verifiers.address={address}"], env={"RLAX_TPU_AUTH_TOKEN": TOKEN}
    ) as launched:
        launched.start()
        assert launched.addresses["verifier"] == [address]
        assert launched.token == TOKEN  # the components share the verifier's token
    assert started == ["param_server-0", "inference_worker-0", "trainer-0"]


def test_the_local_cluster_starts_its_own_verifier_without_verifiers_address(tmp_path, monkeypatch):
    started = stub_starts(monkeypatch)
    with cluster(tmp_path) as launched:
        launched.start()
    assert started == ["param_server-0", "verifier-0", "inference_worker-0", "trainer-0"]


def test_verifiers_address_needs_the_token_the_verifier_was_started_with(
    tmp_path, monkeypatch, external_verifier
):
    stub_starts(monkeypatch)
    monkeypatch.delenv("RLAX_TPU_AUTH_TOKEN", raising=False)
    overrides = [f"verifiers.address={external_verifier.address}"]
    with pytest.raises(ComponentFailed, match="set RLAX_TPU_AUTH_TOKEN to the token"):
        cluster(tmp_path, overrides)
    wrong = cluster(tmp_path, overrides, env={"RLAX_TPU_AUTH_TOKEN": "another-token"})
    with wrong, pytest.raises(ConnectError, match="refused the auth token"):
        wrong.start()


def test_a_run_scores_with_a_reward_function_on_the_verifier_at_verifiers_address(
    tmp_path, external_verifier
):
    """`rlax-tpu run` with verifiers.address: its rows are judged by the user's function on
    the service started separately, which sees each row's prompt and metadata."""
    from tiny_job import tiny_job_config, write_config

    rewards = write_reward_module(tmp_path)
    log = tmp_path / "calls.jsonl"
    rows = [
        {"id": f"q{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i, "log": str(log)}
        for i in range(4)
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_job_config(
        "reward-function",
        tmp_path / "run",
        seed=1,
        controller=ControllerConfig(
            num_steps=2,
            prompts_per_batch=2,
            samples_per_prompt=4,
            datasets=(
                DatasetConfig(
                    path=str(data),
                    verifier="function",
                    reward_function=rewards.by_path("record"),
                ),
            ),
        ),
    )
    config = dataclasses.replace(
        config,
        verifiers=dataclasses.replace(config.verifiers, address=external_verifier.address),
    )
    # The job sets its own device count (cpu_devices).
    env = user_env(JAX_PLATFORMS="cpu", RLAX_TPU_AUTH_TOKEN=TOKEN)
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu", "run", str(write_config(config, tmp_path / "c.json"))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = tmp_path / "run" / "logs"
    assert not (logs / "verifier-0.log").exists()
    assert "verifier" not in " ".join(json.loads((logs / "processes.json").read_text()))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) >= 2 * 2 * 4  # steps x prompts x samples
    by_prompt = {r["prompt"]: r for r in rows}
    for call in calls:
        row = by_prompt[call["prompt"]]
        assert call["reference"] == row["answer"]
        assert call["metadata"] == {"level": row["level"], "log": str(log)}
    client = VerifierClient(external_verifier.address, auth_token=TOKEN)
    assert client.metrics()["judged"] == len(calls)
    client.close()
