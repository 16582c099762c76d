"""Multi-turn episodes through the controller's generation pool, on a real engine: each turn
ends at the template's end-of-turn token, the environment's observation is rendered once and
appended (loss mask 0), the next turn continues on the worker's parked pages; every step is
logged, and a resumed run restores the environments and carries the episodes on to the same
rollouts, stepping no environment twice for a logged step."""

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest
from flax import nnx
from test_engine import INFERENCE, LLAMA

from rlax_tpu.api.inference import GenerationRequest, SamplingParams
from rlax_tpu.config import EnvironmentConfig, load_config
from rlax_tpu.controller.episodes import Episodes, TurnLog, episode_metrics
from rlax_tpu.controller.generation import BatchState, GenerationPool, Prompt
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.controller.workers import WorkerThreads
from rlax_tpu.data.char_tokenizer import write_char_tokenizer
from rlax_tpu.data.datasets import PromptRecord
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.models import Transformer

# A 16-token vocabulary: a random model ends a turn (<|im_end|>) about one token in 16.
ALPHABET = "0123456789=\n"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<|im_end|>")
# Hermes-like: an assistant turn ends with <|im_end|>; a tool's result is "\n=<result>\n".
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ m.content }}{{ '<|im_end|>' }}"
    "{%- elif m.role == 'tool' %}{{ '\\n=' }}{{ m.content }}{{ '\\n' }}"
    "{%- else %}{{ m.content }}{{ '\\n' }}{%- endif %}"
    "{%- endfor %}"
)
MODEL = dataclasses.replace(LLAMA, vocab_size=len(SPECIALS) + len(ALPHABET))
TURNS = 3  # observations before the episode's last turn
EVAL_SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)  # turns end by chance

# An environment of the user's, from a file outside the package: it answers each turn with
# the turn's number and the episode's count of steps taken (its state), for TURNS turns,
# and records every step it takes in a file (a tool's side effect).
ENVIRONMENT = f"""
from rlax_tpu.api.environments import Environment, StepResult

class Counting(Environment):
    def __init__(self, row, limits):
        self.prompt, self.steps = row["prompt"], 0

    def reset(self):
        return ({{"role": "user", "content": self.prompt}},)

    def step(self, action):
        self.steps += 1
        with open(__file__ + ".steps", "a") as f:
            f.write(f"{{self.prompt}} {{self.steps}}\\n")
        done = self.steps > {TURNS}
        observation = () if done else ({{"role": "tool", "content": str(self.steps * 11)}},)
        return StepResult(observation, 0.0, done, {{"steps": self.steps}})

    def state(self):
        return {{"steps": self.steps}}

    def restore(self, state):
        self.steps = state["steps"]

def factory(row, limits):
    return Counting(row, limits)
"""


class LocalClient:
    """An in-process InferenceWorker (a real engine) answering as its gRPC client does."""

    def __init__(self, worker: InferenceWorker, params: dict) -> None:
        self.worker, self.params = worker, params

    def load(self, version, evaluation=False):
        return self.worker.load(version, self.params)

    def generate(self, requests, version=None, ended=()):
        return self.worker.generate(requests, version=version, ended=ended)

    def status_details(self, timeout_s=None):
        return self.worker.stats()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    directory = write_char_tokenizer(
        str(root / "tokenizer"), ALPHABET, extra_special=SPECIALS, chat_template=TEMPLATE
    )
    env_file = root / "counting.py"
    env_file.write_text(ENVIRONMENT)
    model = Transformer(MODEL, rngs=nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return root, Tokenizer.load(directory), env_file, params


def run_batch(
    setup, run_dir: Path, prompts: list[str], *, evaluate: bool = False
) -> tuple[BatchState, dict]:
    root, tokenizer, env_file, params = setup
    config = load_config("configs/tiny_cpu.py").apply_overrides(("trainer.max_seq_len=96",))
    environment = EnvironmentConfig(
        name=f"{env_file}:factory", tool_format="hermes", require_prefix_preserving=False
    )
    episodes = Episodes(environment, tokenizer, max_new_tokens=64)
    inference = dataclasses.replace(
        INFERENCE, max_new_tokens=64, max_prompt_len=32, kv_cache_bytes=4 * INFERENCE.kv_cache_bytes
    )
    config = dataclasses.replace(config, model=MODEL, inference=inference)
    engine = Engine(MODEL, inference, seed=0)
    worker = InferenceWorker(config, param_server=None, consumer_id="w", engine=engine)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    threads = WorkerThreads(
        [LocalClient(worker, params)], sampling=sampling, counters={}, merge_jobs=True
    )
    log = RolloutLog(str(run_dir))
    pool = GenerationPool(threads, log, samples=2, episodes=episodes)
    batch = BatchState(0, 0, 2)
    records = [
        PromptRecord(dataset="d", id=str(i), prompt=p, reference="0") for i, p in enumerate(prompts)
    ]
    pool.start()
    try:
        if evaluate:  # held-out: one episode per prompt, its steps not logged
            keyed = {f"eval:d:{r.id}": r for r in records}
            requests = [
                GenerationRequest(f"{key}/v0", key, 0, episodes.prompt_tokens(r), EVAL_SAMPLING)
                for key, r in keyed.items()
            ]
            got = pool.generate(requests, 0, records=keyed)
            return got, {"engine": engine.stats(), "counters": threads.counters}
        pool.submit(batch, [Prompt(f"b0:d:{r.id}", episodes.prompt_tokens(r), r) for r in records])
        assert pool.wait(batch, threading.Event())
    finally:
        pool.stop()
        log.close()  # its writes on storage, as a controller's stop leaves them
        worker.close()
    return batch, {"engine": engine.stats(), "counters": threads.counters}


def steps_taken(setup) -> list[str]:
    path = Path(str(setup[2]) + ".steps")
    return path.read_text().splitlines() if path.exists() else []


def test_episodes_take_turns_on_their_pages_and_resume_without_stepping_twice(setup, tmp_path):
    tokenizer = setup[1]
    prompts = ["12=", "3=", "45="]
    taken = len(steps_taken(setup))  # the module's other tests step the same environment
    batch, stats = run_batch(setup, tmp_path / "whole", prompts)
    rollouts = batch.rollouts
    assert len(rollouts) == 2 * len(prompts)
    observed = 0
    for rollout in rollouts.values():
        mask = rollout.loss_mask or (1,) * len(rollout.tokens)
        given = [t for t, m in zip(rollout.tokens, mask, strict=True) if not m]
        # The given tokens are exactly the observations' renderings, in order, each once.
        n = len(TurnLog(str(tmp_path / "whole" / "rollouts")).turns(0).get(rollout.key, []))
        text = "".join(f"\n={11 * k}\n" for k in range(1, n + 1))
        assert tokenizer.decode(given) == text
        observed += n
        if rollout.finish_reason == "stop":  # ended by the environment after TURNS steps,
            # or by the next observation leaving no room for a turn (64 tokens)
            following = len(f"\n={11 * (n + 1)}\n")
            assert n == TURNS or len(rollout.tokens) + following >= 64
    assert observed > 0
    metrics = episode_metrics(
        list(rollouts.values()), TurnLog(str(tmp_path / "whole" / "rollouts")).turns(0)
    )
    assert metrics["episode/turns"] == (observed + len(rollouts)) / len(rollouts)
    assert metrics["episode/tool_calls"] == 0.0  # this environment calls no tool itself
    given = sum(m == 0 for r in rollouts.values() for m in (r.loss_mask or ()))
    assert metrics["episode/given_fraction"] == given / sum(
        len(r.tokens) for r in rollouts.values()
    )
    engine = stats["engine"]
    # Every turn after the first fed only its observation over the parked pages.
    assert engine["extends"] == observed and engine["kv_rebuilt"] == 0
    # Each episode's last turn parked its pages; those that ended before a later Generate
    # call to the worker were released by it (which calls: timing), the rest are still
    # parked; none was evicted, none released twice or left behind.
    finals = sum(r.finish_reason == "stop" for r in rollouts.values())
    assert engine["parked"] + engine["parked_released"] == finals
    assert engine["parked_evictions"] == 0
    assert engine["prefills"] == len(rollouts)
    assert stats["counters"]["episode_turns"] == observed + len(rollouts)
    assert len(steps_taken(setup)) - taken == observed + sum(
        r.finish_reason == "stop" for r in rollouts.values()
    )

    # A run that stopped after logging the steps but before any episode ended: the resumed
    # pool restores each environment and goes on from its last logged step.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed_dir)
    batch_dir = resumed_dir / "rollouts" / "batch_000000000"
    for path in batch_dir.glob("rollouts-*.jsonl"):
        path.unlink()
    before = len(steps_taken(setup))
    again, stats = run_batch(setup, resumed_dir, prompts)
    assert again.rollouts == rollouts
    finals = sum(r.finish_reason == "stop" for r in rollouts.values())
    assert len(steps_taken(setup)) - before == finals  # only each episode's last turn
    # Each episode with a logged step went on from it, its lost pages replayed as made
    # (bitwise: the same rollouts above); one without started afresh.
    stepped = len(TurnLog(str(resumed_dir / "rollouts")).turns(0))
    engine = stats["engine"]
    assert (engine["kv_replayed"], engine["replay_mismatches"]) == (stepped, 0)
    assert engine["prefills"] == len(rollouts) - stepped and engine["kv_rebuilt"] == 0


def test_a_turn_that_calls_the_calculator_gets_its_result_as_given_tokens(tmp_path):
    """The built-in "tools" environment on the tool-use demo's tokenizer: a turn's
    <tool_call> is parsed, run, and its result appended as the template renders it; a turn
    without calls is the answer; a call the policy botched is told to it."""
    from rlax_tpu.api.inference import Rollout
    from rlax_tpu.data.char_tokenizer import write_char_tools_tokenizer

    tokenizer = Tokenizer.load(write_char_tools_tokenizer(str(tmp_path)))
    episodes = Episodes(EnvironmentConfig(name="tools"), tokenizer, max_new_tokens=200)
    record = PromptRecord(dataset="d", id="7", prompt="What is 123*45?", reference="5535")
    prompt = episodes.prompt_tokens(record)  # the prefix check passed: it is checked here
    assert tokenizer.decode(prompt) == "tools: calculator\nWhat is 123*45?\n"
    (end,) = episodes.stop_token_ids

    def turn(text: str, partial: Rollout | None = None) -> Rollout:
        tokens = (*(partial.tokens if partial else ()), *tokenizer.encode(text), end)
        mask = (*(partial.loss_mask or (1,) * len(partial.tokens) if partial else ()),)
        mask = (*mask, *(1,) * (len(tokens) - len(mask)))
        return Rollout(
            "r", "b0:d:7", 0, 0, prompt, tokens, (-0.5,) * len(tokens), "stop", loss_mask=mask
        )

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
    first = turn(call)
    outcome = episodes.step(first, record, [])
    assert not outcome.done and outcome.result.info["verdicts"] == ["ok"]
    partial = outcome.turn.partial
    assert tokenizer.decode(partial.tokens[len(first.tokens) :]) == "\n=5535\n"
    assert partial.mask == (1,) * len(first.tokens) + (0,) * len("\n=5535\n")
    # The answer ends the episode.
    second = dataclasses.replace(turn("5535"), tokens=(*partial.tokens, *turn("5535").tokens))
    second = dataclasses.replace(
        second,
        logprobs=(-0.5,) * len(second.tokens),
        loss_mask=(*partial.mask, *(1,) * (len(second.tokens) - len(partial.tokens))),
    )
    done = episodes.step(second, record, [outcome.turn])
    assert done.done and done.result.info["end"] == "answer"
    # A call that does not parse: the policy reads why.
    botched = episodes.step(turn("<tool_call>{oops</tool_call>"), record, [])
    assert botched.result.info["verdicts"] == ["parse_error"]
    text = tokenizer.decode(botched.turn.observation)
    assert text.startswith("\n=Error: the tool call could not be parsed")


def test_prompts_too_long_with_the_tools_stop_the_run_at_start(tmp_path):
    """The datasets scan measures prompts without the environment's tools; the controller
    measures them again as episodes render them, before any batch, naming the fix."""
    import types

    from rlax_tpu.controller.controller import Controller
    from rlax_tpu.controller.errors import ControllerError
    from rlax_tpu.data.char_tokenizer import write_char_tools_tokenizer
    from rlax_tpu.data.datasets import PromptMixture

    tokenizer = Tokenizer.load(write_char_tools_tokenizer(str(tmp_path)))
    episodes = Episodes(EnvironmentConfig(name="tools"), tokenizer, max_new_tokens=64)
    rows = [PromptRecord(dataset="d", id=str(n), prompt="1" * n, reference="1") for n in (5, 9)]
    mixture = PromptMixture.from_records({"d": rows}, {"d": 1.0}, 0)
    header = len("tools: calculator\n") + 1  # the tools' line, and the prompt's newline

    def check(limit: int, eval_prompts=(), sft_steps=0, max_seq_len=64):
        inference = types.SimpleNamespace(max_prompt_len=limit)
        trainer = types.SimpleNamespace(
            warm_start=types.SimpleNamespace(steps=sft_steps), max_seq_len=max_seq_len
        )
        config = types.SimpleNamespace(inference=inference, trainer=trainer)
        controller = types.SimpleNamespace(config=config, mixture=mixture, episodes=episodes)
        Controller._check_episode_prompts(controller, eval_prompts)

    check(9 + header)  # every prompt fits
    with pytest.raises(
        ControllerError, match=rf"1 prompts .* prompt '9' .*max_prompt_len={9 + header}"
    ):
        check(8 + header)
    held_out = [PromptRecord(dataset="e", id="x", prompt="1" * 12, reference="1")]
    with pytest.raises(ControllerError, match="prompt 'x' of dataset 'e'"):
        check(9 + header, held_out)
    # With an SFT warm start, each row's demonstration (here: the answer turn, "1" and the
    # end of the turn) is measured as its episode against the trainer's sequence.
    check(9 + header, sft_steps=5, max_seq_len=9 + header + 2)
    with pytest.raises(ControllerError, match=r"row '9' .* trainer.max_seq_len=32"):
        check(9 + header, sft_steps=5, max_seq_len=9 + header + 1)


def test_held_out_evaluation_runs_episodes_and_logs_no_step(setup, tmp_path):
    tokenizer = setup[1]
    got, stats = run_batch(setup, tmp_path / "eval", ["12=", "3="], evaluate=True)
    assert sorted(got) == ["eval:d:0/v0", "eval:d:1/v0"]  # under the first request's id
    turns = stats["counters"]["episode_turns"]
    # Every turn after an episode's first fed its observation by one extend call.
    assert stats["engine"]["extends"] == turns - len(got) > 0
    for rollout in got.values():  # the episode's last turn: its observations given
        given = [t for t, m in zip(rollout.tokens, rollout.loss_mask or (), strict=False) if not m]
        steps = (
            int(rollout.request_id.rsplit("/turn", 1)[1]) - 1
            if "/turn" in rollout.request_id
            else 0
        )
        assert tokenizer.decode(given) == "".join(f"\n={11 * k}\n" for k in range(1, steps + 1))
    assert not list((tmp_path / "eval").glob("rollouts/*/turns-*"))  # measured, not logged
