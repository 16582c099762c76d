"""The tool-use demo's parts: the multiplication task (held out by construction, a few rows
demonstrating the calculator), SFT rows built from demonstrations exactly as RL episodes
hold them, a demonstration refused where no environment can follow it, and the demo's
config run end to end by `rlax-tpu run` on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jobenv import user_env

from rlax_tpu.api.inference import Rollout
from rlax_tpu.config import EnvironmentConfig, load_config
from rlax_tpu.controller.episodes import Episodes
from rlax_tpu.controller.warm_start import sft_rows
from rlax_tpu.data.char_tokenizer import write_char_tools_tokenizer
from rlax_tpu.data.datasets import DatasetError, PromptRecord, load_dataset, scan_datasets
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.verifiers.tasks import multiplication_problems

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "417 * 38"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.load(write_char_tools_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def test_the_multiplication_task_is_held_out_by_construction_with_a_few_tool_demonstrations():
    train = multiplication_problems(0, 4000, split="train", tool_demonstrations=0.125)
    test = multiplication_problems(1, 2000, split="test")
    problems = {r["prompt"] for r in train}
    assert not problems & {r["prompt"] for r in test}  # other seeds, sizes: still disjoint
    assert len({r["prompt"] for r in test}) == 2000  # the test side: distinct problems
    shown = [r for r in train if len(r["demonstration"]) == 3]
    assert 0.10 < len(shown) / len(train) < 0.15
    for r in train[:200]:
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").rstrip("?").split(" * "))
        assert 100 <= a <= 999 and 10 <= b <= 99 and r["answer"] == str(a * b)
        *steps, answer = r["demonstration"]
        assert answer == {"role": "assistant", "content": r["answer"]}
        if steps:  # the call, then its result
            assert steps[0]["tool_calls"][0]["function"]["arguments"] == {
                "expression": f"{a} * {b}"
            }
            assert steps[1] == {"role": "tool", "name": "calculator", "content": r["answer"]}
    assert multiplication_problems(0, 50, split="train", tool_demonstrations=0.125) == train[:50]


def _records(tmp_path, rows, **fields):
    from rlax_tpu.config import DatasetConfig

    path = tmp_path / "mul.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DatasetConfig(path=str(path), verifier="arithmetic", **fields)
    return load_dataset(config)


def test_a_demonstration_trains_on_the_tokens_its_rl_episode_holds(tmp_path, tokenizer):
    """The warm start's row of a demonstration is the episode's prompt, the call turn, the
    observation the environment renders for the calculator's result, and the answer turn,
    token for token what Episodes builds from a rollout that wrote the same turns; the loss
    is on the policy's turns only."""
    rows = [
        {
            "prompt": "What is 417 * 38?",
            "answer": "15846",
            "demonstration": [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "function": {
                                "name": "calculator",
                                "arguments": {"expression": "417 * 38"},
                            }
                        }
                    ],
                },
                {"role": "tool", "name": "calculator", "content": "15846"},
                {"role": "assistant", "content": "15846"},
            ],
        },
        {"prompt": "What is 100 * 10?", "answer": "1000", "demonstration": "1000"},
    ]
    records = _records(tmp_path, rows, sft_field="demonstration")
    assert len(records[0].sft_messages) == 3 and records[1].sft_target == "1000"
    assert PromptRecord.from_json(records[0].to_json()) == records[0]
    config = load_config(str(ROOT / "configs" / "tiny_cpu_tools.py"))
    episodes = Episodes(EnvironmentConfig(name="tools"), tokenizer, max_new_tokens=80)
    tokens, targets, mask = sft_rows(config, tokenizer, records, episodes)

    # The episode RL would build from the same turns, through the environment.
    prompt = episodes.prompt_tokens(records[0])
    (end,) = episodes.stop_token_ids
    call = (*tokenizer.encode(CALL), end)
    rollout = Rollout(
        "r", "b0:d:0", 0, 0, prompt, call, (-0.5,) * len(call), "stop", loss_mask=(1,) * len(call)
    )
    turn = episodes.step(rollout, records[0], []).turn
    episode = (*prompt, *turn.partial.tokens, *tokenizer.encode("15846"), end)
    n = len(episode)
    assert tokens[0, :n].tolist() == list(episode) and not tokens[0, n:].any()
    assert tokenizer.decode(episode[len(prompt) :]) == CALL + "<|im_end|>\n=15846\n15846<|im_end|>"
    # Position t predicts token t + 1: the loss is on the two turns, not the observation.
    policy = np.zeros(n, bool)
    policy[len(prompt) : len(prompt) + len(call)] = True
    policy[len(prompt) + len(turn.partial.tokens) :] = True
    assert mask[0, : n - 1].tolist() == policy[1:].astype(np.float32).tolist()
    assert not mask[0, n - 1 :].any()
    np.testing.assert_array_equal(targets[0, : n - 1], tokens[0, 1:n])
    # A text target is one answer turn ending the episode.
    answer = (*episodes.prompt_tokens(records[1]), *tokenizer.encode("1000"), end)
    assert tokens[1, : len(answer)].tolist() == list(answer)
    assert mask[1].sum() == len("1000") + 1


def test_a_demonstration_without_an_environment_is_refused_with_the_fix(tmp_path, tokenizer):
    rows = multiplication_problems(0, 20, split="train", tool_demonstrations=1.0)
    records = _records(tmp_path, rows, sft_field="demonstration")
    config = load_config(str(ROOT / "configs" / "tiny_cpu_no_tools.py"))
    with pytest.raises(DatasetError, match="controller.environment.name.*sft_field"):
        scan_datasets({"mul": records}, tokenizer, config)
    with pytest.raises(DatasetError, match="only a run with an environment"):
        sft_rows(config, tokenizer, records)
    bad = [{**rows[0], "demonstration": [{"role": "tool", "content": "1"}]}]
    with pytest.raises(DatasetError, match="from an assistant turn to an assistant turn"):
        _records(tmp_path, bad, sft_field="demonstration")


def test_the_tool_demo_runs_with_rlax_tpu_run(tmp_path):
    """configs/tiny_cpu_tools.py on a tiny model, a few SFT and RL steps: the warm start
    trains on demonstrations, the RL steps run episodes with the calculator, and the run
    logs its tool use and held-out accuracy (measured with the tools)."""
    env = user_env()  # the config's 2 devices
    run_dir = tmp_path / "run"
    sets = [
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_layers=1",
        "model.head_dim=16",
        "trainer.warm_start.steps=3",
        "controller.num_steps=2",
        "controller.eval_every=1",
        "controller.eval_size=16",
        "inference.max_new_tokens=40",
        f"storage.run_dir={run_dir}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu", "run", "configs/tiny_cpu_tools.py"]
        + [a for s in sets for a in ("--set", s)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sft step 3/3" in done.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/tool_call_rate" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["episode/turns"] >= 1 and 0.0 <= r["episode/tool_call_rate"] <= 1.0
        assert r["episode/tool_seconds"] >= 0.0
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and evals[0]["eval_distinct"] == 16
    # The built-in task it trained on: demonstrations of the calculator in some rows, and a
    # held-out file of other problems, without demonstrations.
    train = [json.loads(x) for x in (run_dir / "data" / "multiplication_train.jsonl").open()]
    held_out = [json.loads(x) for x in (run_dir / "data" / "multiplication_heldout.jsonl").open()]
    assert any(len(r["demonstration"]) == 3 for r in train)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert all("demonstration" not in r for r in held_out)


def test_samples_shows_an_episode_turn_by_turn_with_its_masks_and_tool_messages(
    tmp_path, tokenizer
):
    """`rlax-tpu samples` cuts an episode's response where its loss mask changes: each
    policy turn's text, and each observation with the tool messages and verdicts of its
    logged step and the tokens the policy read."""
    from rlax_tpu.api.records import Judgement, RolloutKey, RolloutRecord
    from rlax_tpu.cli.samples import read_samples, render
    from rlax_tpu.controller.episodes import TurnLog
    from rlax_tpu.controller.snapshots import RolloutLog
    from rlax_tpu.run_dir import EFFECTIVE_CONFIG

    config = load_config(str(ROOT / "configs" / "tiny_cpu_tools.py"))
    directory = write_char_tools_tokenizer(str(tmp_path / "tokenizer"))
    config = config.apply_overrides((f"model.tokenizer={directory}",))
    (tmp_path / EFFECTIVE_CONFIG).write_text(json.dumps(config.to_dict()))
    episodes = Episodes(EnvironmentConfig(name="tools"), tokenizer, max_new_tokens=88)
    record = PromptRecord(dataset="m", id="7", prompt="What is 417 * 38?", reference="15846")
    prompt = episodes.prompt_tokens(record)
    (end,) = episodes.stop_token_ids
    call = (*tokenizer.encode(CALL), end)
    first = Rollout(
        "r", "b0:m:7", 0, 0, prompt, call, (-0.5,) * len(call), "stop", loss_mask=(1,) * len(call)
    )
    turn = episodes.step(first, record, []).turn
    answer = (*tokenizer.encode("15846"), end)
    tokens = (*turn.partial.tokens, *answer)
    mask = (*turn.partial.mask, *(1,) * len(answer))
    log = RolloutLog(str(tmp_path))
    log.append(
        0,
        [
            RolloutRecord(
                batch=0,
                prompt_id="b0:m:7",
                sample_index=0,
                version=0,
                prompt_tokens=prompt,
                tokens=tokens,
                logprobs=(-0.5,) * len(tokens),
                finish_reason="stop",
                loss_mask=mask,
            )
        ],
    )
    log.append_prompts(0, {"b0:m:7": record})
    log.append_verdicts(
        0, [(RolloutKey("b0:m:7", 0, 0), Judgement(1.0, "accepted", response="15846"))]
    )
    TurnLog(log.directory).append(0, turn)
    log.flush()

    (sample,) = read_samples(str(tmp_path), step=0)["prompts"][0]["samples"]
    roles = [(t["role"], t["tokens"]) for t in sample["turns"]]
    assert roles == [("policy", len(call)), ("observation", 8), ("policy", len(answer))]
    policy, given, final = sample["turns"]
    assert policy["text"] == CALL and final["text"] == "15846"
    assert given["text"] == "\n=15846\n" and given["verdicts"] == ["ok"]
    assert given["messages"] == [{"role": "tool", "name": "calculator", "content": "15846"}]
    # tools/tool_demo_errors.py reads the same: the call copied the operands, the answer
    # the tool's result; an answer that does not copy it is counted as such.
    import tool_demo_errors

    assert tool_demo_errors.classify(sample, "417", "38") == dict.fromkeys(
        ("called", "operands", "result", "rewarded"), True
    )
    wrong = {**sample, "reward": 0.0, "turns": [*sample["turns"][:2], {**final, "text": "158"}]}
    assert tool_demo_errors.classify(wrong, "417", "39") == {
        "called": True,
        "operands": False,
        "result": False,
        "rewarded": False,
    }
    rows = tool_demo_errors.quarters(str(tmp_path))
    assert sum(r["calls"] for r in rows) == sum(r["result"] for r in rows) == 1
    assert "| 0–0 | 1 | 1.00 | 1.00 | 1.00 | 0 (0) |" in tool_demo_errors.table(rows)
    text = render(read_samples(str(tmp_path), step=0))
    assert "turn 1 (policy, 66 tokens, loss mask 1)" in text
    assert "observation (8 tokens given, loss mask 0; verdicts ok)" in text
    assert "> [tool calculator] 15846" in text and "turn 2 (policy, 6 tokens" in text


def test_demonstrations_of_the_python_tool_need_no_verifier(tokenizer):
    """The in-process warm start (`rlax-tpu sft`) has no verifier: a demonstration of the
    sandboxed python tool still renders (its result is in the data), and a call that would
    run a program is an error verdict saying why, not a program run anywhere else."""
    episodes = Episodes(
        EnvironmentConfig(name="tools", tools=("python",)), tokenizer, max_new_tokens=200
    )
    call = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    record = PromptRecord(
        dataset="d",
        id="1",
        prompt="What is 6 * 7?",
        reference="42",
        sft_messages=(
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "name": "python", "content": "42"},
            {"role": "assistant", "content": "42"},
        ),
    )
    ids, mask = episodes.demonstration(record)
    text = tokenizer.decode(ids)
    assert text.startswith("tools: python\nWhat is 6 * 7?\n<tool_call>")
    assert text.endswith("<|im_end|>\n=42\n42<|im_end|>") and len(mask) == len(ids)
    prompt = episodes.prompt_tokens(record)
    (end,) = episodes.stop_token_ids
    turn = (*tokenizer.encode(tokenizer.decode(ids[len(prompt) : ids.index(end) + 1])),)
    rollout = Rollout(
        "r", "b0:d:1", 0, 0, prompt, turn, (-0.5,) * len(turn), "stop", loss_mask=(1,) * len(turn)
    )
    step = episodes.step(rollout, record, [])
    assert step.result.info["verdicts"] == ["error"]
    assert "no verifier serves them" in step.result.observation[0]["content"]


def test_an_environment_state_json_cannot_hold_stops_the_episode_naming_the_fix(
    tmp_path, tokenizer
):
    """A resumed run restores environments from their logged state(): a state JSON cannot
    hold exactly is an error at the step that logs it, not text restored as something else."""
    from rlax_tpu.controller.episodes import EpisodeError

    env_file = tmp_path / "sets.py"
    env_file.write_text(
        "from rlax_tpu.api.environments import Environment, StepResult\n"
        "class Sets(Environment):\n"
        "    def __init__(self, row, limits): self.prompt = row['prompt']\n"
        "    def reset(self): return ({'role': 'user', 'content': self.prompt},)\n"
        "    def step(self, action):\n"
        "        return StepResult(({'role': 'tool', 'content': '1'},), 0.0, False, {})\n"
        "    def state(self): return {'seen': {1, 2}}\n"
        "    def restore(self, state): pass\n"
        "def factory(row, limits): return Sets(row, limits)\n"
    )
    episodes = Episodes(EnvironmentConfig(name=f"{env_file}:factory"), tokenizer, max_new_tokens=80)
    record = PromptRecord(dataset="d", id="1", prompt="Go.", reference="1")
    prompt = episodes.prompt_tokens(record)
    (end,) = episodes.stop_token_ids
    turn = (*tokenizer.encode("hi"), end)
    rollout = Rollout(
        "r", "b0:d:1", 0, 0, prompt, turn, (-0.5,) * len(turn), "stop", loss_mask=(1,) * len(turn)
    )
    with pytest.raises(EpisodeError, match=r"state\(\) returned .*JSON cannot hold.*JSON types"):
        episodes.step(rollout, record, [])


def test_a_datasets_chat_template_arguments_reach_episode_prompts_and_demonstrations(tmp_path):
    """chat_template_kwargs (Qwen3's enable_thinking, say) render single-turn prompts; an
    episode's prompt, observations and SFT demonstration are rendered with them too."""
    from rlax_tpu.data.char_tokenizer import (
        TOOLS_ADDED,
        TOOLS_CHAT_TEMPLATE,
        TOOLS_SPECIAL,
        write_char_tokenizer,
    )

    template = "{%- if loud %}{{ 'LOUD\\n' }}{%- endif %}" + TOOLS_CHAT_TEMPLATE
    tokenizer = Tokenizer.load(
        write_char_tokenizer(
            str(tmp_path), extra_special=TOOLS_SPECIAL, added=TOOLS_ADDED, chat_template=template
        )
    )
    episodes = Episodes(EnvironmentConfig(name="tools"), tokenizer, max_new_tokens=80)
    plain = PromptRecord(dataset="d", id="1", prompt="What is 2 * 3?", reference="6")
    loud = dataclasses.replace(plain, template_kwargs={"loud": True})
    assert tokenizer.decode(episodes.prompt_tokens(plain)).startswith("tools: calculator\n")
    assert tokenizer.decode(episodes.prompt_tokens(loud)).startswith("LOUD\ntools: calculator\n")
    ids, _ = episodes.demonstration(loud)
    assert tokenizer.decode(ids).startswith("LOUD\n")


def test_no_turn_generates_past_the_episodes_token_limit(tmp_path, tokenizer):
    """controller.environment.max_total_tokens is a hard cap: every turn's request (whose
    max_new_tokens counts the episode's tokens so far) stops there."""
    from rlax_tpu.api.inference import SamplingParams
    from rlax_tpu.controller.generation import GenerationPool
    from rlax_tpu.controller.snapshots import RolloutLog
    from rlax_tpu.controller.workers import WorkerThreads

    episodes = Episodes(
        EnvironmentConfig(name="tools", max_total_tokens=20), tokenizer, max_new_tokens=64
    )
    threads = WorkerThreads([], sampling=SamplingParams(max_new_tokens=64), counters={})
    pool = GenerationPool(threads, RolloutLog(str(tmp_path)), samples=1, episodes=episodes)
    try:
        assert pool.sampling.max_new_tokens == 20
        assert set(pool.sampling.stop_token_ids) >= set(episodes.stop_token_ids)
    finally:
        pool.stop()
