"""Multi-turn episodes (controller.environment, docs/agents.md): between a policy's turns, the
controller parses the turn's tool calls, steps the episode's environment (which runs them)
and renders the observation once into tokens, appended to the response as given tokens
(loss mask 0); the next turn continues on the worker's parked KV pages.

An episode's response is never re-tokenised: its tokens are the turns' sampled ids and the
observations' rendered ids, in order. Each step is logged (the next turn's partial, the
observation, the environment's `state()`) before the next turn is queued, so a resumed run
restores the environment and carries the episode on from its last logged step: a logged
step's tool calls are never run again, and the episode's tokens are those of the
uninterrupted run. (A step whose calls ran but whose log write had not finished when the run
was killed is stepped again: make tools with side effects idempotent.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tpu import storage
from rlax_tpu.api.environments import Action, Environment, EpisodeLimits, StepResult
from rlax_tpu.api.inference import Partial, Rollout
from rlax_tpu.config import EnvironmentConfig
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.data.datasets import PromptRecord
from rlax_tpu.data.tool_format import FORMATS, TurnRenderer, detect_format
from rlax_tpu.environments import ToolContext, resolve_environment, resolve_tool

TURNS_PREFIX = "turns-"


class EpisodeError(ControllerError):
    """An episode cannot go on: its environment failed, or the config names what cannot run."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """One environment step of an episode, as logged: after `turn` policy turns, the
    observation (`messages`, rendered to `observation` token ids), the step's info and the
    environment's state after it, and the next turn's partial response (the tokens so far
    and the observation's)."""

    prompt_id: str
    sample_index: int
    version: int
    turn: int
    observation: tuple[int, ...]
    messages: tuple[Mapping[str, Any], ...]
    info: Mapping[str, Any]
    state: Mapping[str, Any]
    partial: Partial

    def to_json(self) -> dict[str, Any]:
        p = self.partial
        return {
            "prompt_id": self.prompt_id,
            "sample_index": self.sample_index,
            "version": self.version,
            "turn": self.turn,
            "observation": list(self.observation),
            "messages": [dict(m) for m in self.messages],
            "info": dict(self.info),
            "state": dict(self.state),
            "partial": {
                "version": p.version,
                "tokens": list(p.tokens),
                "logprobs": list(p.logprobs),
                "token_versions": list(p.token_versions),
                "loss_mask": list(p.mask),
            },
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Turn:
        p = d["partial"]
        partial = Partial(
            int(p["version"]),
            tuple(p["tokens"]),
            tuple(p["logprobs"]),
            tuple(p["token_versions"]),
            tuple(p["loss_mask"]),
        )
        return cls(
            prompt_id=str(d["prompt_id"]),
            sample_index=int(d["sample_index"]),
            version=int(d["version"]),
            turn=int(d["turn"]),
            observation=tuple(int(t) for t in d["observation"]),
            messages=tuple(d["messages"]),
            info=dict(d["info"]),
            state=dict(d["state"]),
            partial=partial,
        )


class TurnLog:
    """The steps of a run's episodes under the rollout log's batch directories
    (turns-*.jsonl: one file per step, named by its episode and turn, so writing it again
    replaces it)."""

    def __init__(self, rollouts_dir: str) -> None:
        self.directory = rollouts_dir

    def append(self, batch: int, turn: Turn) -> None:
        line = json.dumps(turn.to_json(), sort_keys=True) + "\n"
        name = f"{TURNS_PREFIX}{_episode_name(turn.prompt_id, turn.sample_index, turn.version)}"
        path = storage.join(self._batch_dir(batch), f"{name}-t{turn.turn:04d}.jsonl")
        storage.write_text(path, line)

    def turns(self, batch: int) -> dict[tuple[str, int, int], list[Turn]]:
        """`batch`'s logged steps by episode (prompt id, sample index, version), in turn
        order."""
        directory = self._batch_dir(batch)
        if not storage.exists(directory):
            return {}
        out: dict[tuple[str, int, int], list[Turn]] = {}
        for name in sorted(storage.listdir(directory)):
            if not (name.startswith(TURNS_PREFIX) and name.endswith(".jsonl")):
                continue
            turn = Turn.from_json(json.loads(storage.read_text(storage.join(directory, name))))
            out.setdefault((turn.prompt_id, turn.sample_index, turn.version), []).append(turn)
        for steps in out.values():
            steps.sort(key=lambda t: t.turn)
        return out

    def _batch_dir(self, batch: int) -> str:
        return storage.join(self.directory, f"batch_{batch:09d}")


def _episode_name(prompt_id: str, sample_index: int, version: int) -> str:
    safe = hashlib.sha256(prompt_id.encode()).hexdigest()[:16]
    return f"p{safe}-s{sample_index}-v{version}"


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What an episode's turn led to: `turn` (logged) and the next turn's partial when the
    episode goes on; `result` the environment's step (None: the turn ended the episode
    without a step, e.g. at the response's token limit)."""

    result: StepResult | None
    turn: Turn | None

    @property
    def done(self) -> bool:
        return self.turn is None


class Episodes:
    """A run's episodes: their environment, the chat template's turn rendering and the tool
    format, and each live episode's environment, by (prompt id, sample index, version).

    `verifier`: what the "python" tool runs programs through (the run's verifiers); None
    where no program is run (the SFT warm start in this process renders demonstrations,
    whose tool results are in the data): calling such a tool then fails, saying so."""

    def __init__(
        self,
        config: EnvironmentConfig,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        verifier: Any = None,
    ) -> None:
        if not config.enabled:
            raise ValueError("Episodes needs controller.environment.name")
        self.config, self.tokenizer = config, tokenizer
        self.limits = EpisodeLimits(
            max_turns=config.max_turns,
            max_total_tokens=config.max_total_tokens or max_new_tokens,
            tool_timeout_s=config.tool_timeout_s,
        )
        context = ToolContext(verifier=verifier if verifier is not None else _NoVerifier())
        if config.name == "tools":
            tools = tuple(resolve_tool(spec, context) for spec in config.tools)
            self.factory = resolve_environment(
                "tools", tools=tools, on_tool_error=config.on_tool_error
            )
        else:
            self.factory = resolve_environment(config.name)
        fmt = (
            detect_format(tokenizer)
            if config.tool_format == "auto"
            else FORMATS[config.tool_format]()
        )
        self.tool_format = fmt
        # The tokens that end a turn (and the final answer): the tool format's.
        self.stop_token_ids: tuple[int, ...] = fmt.turn_end_ids(tokenizer)
        self._renderers: dict[tuple[str, ...], TurnRenderer] = {}
        self._envs: dict[tuple[str, int, int], Environment] = {}
        self._lock = threading.Lock()

    # -- rendering ----------------------------------------------------------------------------
    def renderer(self, env: Environment, record: PromptRecord) -> TurnRenderer:
        """The turn renderer for `env`'s tools and `record`'s chat template arguments (its
        dataset's chat_template_kwargs, as single-turn prompts get them): one per tool set and
        arguments, checked at first use."""
        schemas = [tool.schema() for tool in env.tools]
        kwargs = dict(record.template_kwargs)
        key = (
            *(json.dumps(s, sort_keys=True) for s in schemas),
            json.dumps(kwargs, sort_keys=True),
        )
        with self._lock:
            renderer = self._renderers.get(key)
        if renderer is None:
            renderer = TurnRenderer(self.tokenizer, schemas, tool_format=self.tool_format, **kwargs)
            if self.config.require_prefix_preserving:
                renderer.check_prefix_preserving()
            with self._lock:
                self._renderers.setdefault(key, renderer)
        return renderer

    def prompt_tokens(self, record: PromptRecord) -> tuple[int, ...]:
        """An episode's prompt: the environment's first observation, rendered with its
        tools and the generation prompt."""
        env = self._make(record)
        return tuple(self.renderer(env, record).prompt_ids(env.reset()))

    def demonstration(self, record: PromptRecord) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of `record`'s SFT demonstration built as its episode would be:
        the episode's prompt, then the record's sft_messages (assistant turns, mask 1, and
        the tool results between them rendered as observations, mask 0), or one assistant
        turn answering with its `sft_text`."""
        env = self._make(record)
        turns = record.sft_messages or ({"role": "assistant", "content": record.sft_text},)
        return self.renderer(env, record).episode_ids([*env.reset(), *turns])

    # -- steps --------------------------------------------------------------------------------
    def step(self, rollout: Rollout, record: PromptRecord, turns: Sequence[Turn]) -> StepOutcome:
        """The environment's answer to the turn `rollout` ended with (its last tokens after
        the last given ones), for the episode of `record` whose earlier steps were `turns`
        (restored from their log when this process has not stepped it)."""
        key = (rollout.prompt_id, rollout.sample_index, rollout.version)
        env = self._env(key, record, turns)
        if rollout.finish_reason != "stop":  # the response's limit: no turn left to read
            self._forget(key)
            return StepOutcome(None, None)
        mask = rollout.loss_mask or (1,) * len(rollout.tokens)
        start = next((i + 1 for i in range(len(mask) - 1, -1, -1) if not mask[i]), 0)
        ids = list(rollout.tokens[start:])
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        parsed = self.tool_format.parse(text)
        action = Action(
            text,
            tool_calls=parsed.tool_calls,
            parse_error=parsed.error,
            tokens_used=len(rollout.tokens),
        )
        try:
            result = env.step(action)
        except Exception as e:  # an environment's bug fails its episode, loudly
            raise EpisodeError(
                f"environment {self.config.name!r} raised in step {len(turns) + 1} of episode "
                f"{rollout.prompt_id!r} sample {rollout.sample_index}: "
                f"{type(e).__name__}: {e}"
            ) from e
        if result.done:
            self._forget(key)
            return StepOutcome(result, None)
        renderer = self.renderer(env, record)
        observation = tuple(renderer.observation_ids(result.observation))
        partial = Partial.of(rollout).extended(observation, rollout_version(rollout))
        if len(partial.tokens) >= self.limits.max_total_tokens:
            # No room left for a turn after the observation: the episode ends here, its
            # response the turns so far (the policy never saw this observation).
            self._forget(key)
            info = {**_plain(result.info), "end": "max_total_tokens"}
            return StepOutcome(dataclasses.replace(result, done=True, info=info), None)
        turn = Turn(
            rollout.prompt_id,
            rollout.sample_index,
            rollout.version,
            len(turns) + 1,
            observation,
            tuple(dict(m) for m in result.observation),
            _plain(result.info),
            _state(env, self.config.name),
            partial,
        )
        return StepOutcome(result, turn)

    def _make(self, record: PromptRecord) -> Environment:
        return self.factory(record.to_json(), self.limits)

    def _env(
        self, key: tuple[str, int, int], record: PromptRecord, turns: Sequence[Turn]
    ) -> Environment:
        with self._lock:
            env = self._envs.get(key)
        if env is None:
            env = self._make(record)
            env.reset()
            if turns:
                env.restore(turns[-1].state)
            with self._lock:
                self._envs[key] = env
        return env

    def _forget(self, key: tuple[str, int, int]) -> None:
        with self._lock:
            self._envs.pop(key, None)


class _NoVerifier:
    """The program executor of Episodes made without a verifier."""

    def execute(self, requests: Sequence[Any], *, deadline_s: float | None = None) -> list[Any]:
        raise EpisodeError(
            "a tool that runs programs was called where no verifier serves them (the SFT "
            "warm start in this process): give demonstrations their tool results"
        )


def rollout_version(rollout: Rollout) -> int:
    """The version that sampled a rollout's last token (the next turn starts under it)."""
    versions = rollout.token_versions
    return versions[-1] if versions else rollout.version


def _plain(value: Any) -> Any:
    """`value` as JSON has it (tuples as lists, keys as text): what a logged step holds.
    What JSON cannot hold is logged as its text (info is for reading)."""
    return json.loads(json.dumps(value, default=str))


def _state(env: Environment, name: str) -> Any:
    """`env.state()` as logged: JSON exactly, since a resumed run restores from it (text in
    place of a value would restore something else)."""
    state = env.state()
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise EpisodeError(
            f"environment {name!r}: state() returned {state!r:.120}, which JSON cannot hold "
            f"({e}); a resumed run restores the environment from it, so return JSON types "
            "(dicts, lists, text, numbers, booleans, None)"
        ) from None


def episode_metrics(
    records: Sequence[Any], turns: Mapping[tuple[str, int, int], Sequence[Turn]]
) -> dict[str, float]:
    """A batch's episode metrics, from its trained rollouts (`RolloutRecord`s) and their
    logged steps: turns per episode, tool calls per episode, the share of episodes that
    called a tool, the share of calls that failed (any verdict but "ok"), the seconds spent
    in tool calls per episode (the environments' own count, info["tool_seconds"]) and the
    share of the responses' tokens that were given (observations)."""
    if not records:
        return {}
    steps = [turns.get((r.prompt_id, r.sample_index, r.version), ()) for r in records]
    verdicts = [[v for t in ts for v in t.info.get("verdicts", ())] for ts in steps]
    calls = sum(len(v) for v in verdicts)
    given = sum(len(r.tokens) - sum(r.loss_mask or ()) if r.loss_mask else 0 for r in records)
    return {
        "episode/turns": sum(len(ts) + 1 for ts in steps) / len(records),
        "episode/tool_calls": calls / len(records),
        "episode/tool_call_rate": sum(bool(v) for v in verdicts) / len(records),
        "episode/tool_error_rate": (
            sum(x != "ok" for v in verdicts for x in v) / calls if calls else 0.0
        ),
        "episode/tool_seconds": sum(
            max((float(t.info.get("tool_seconds", 0.0)) for t in ts), default=0.0) for ts in steps
        )
        / len(records),
        "episode/given_fraction": given / max(1, sum(len(r.tokens) for r in records)),
    }
