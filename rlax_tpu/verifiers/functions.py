"""Rewards of your own: a reward function in the user's module, named `module:function`.

The verifier service runs it in its worker pool (the math checks' pool: the same deadline
handling, recycling and memory limit), never in the controller. `load_reward_function`
imports one and checks it can be called as a reward; `judge` (run in a worker) calls it and
turns what it returns into a VerificationResult; `preload` imports a config's functions
when a worker starts, so no request's deadline is spent importing them.

A spec is `package.module:function` (imported by name: installed, or on PYTHONPATH) or
`path/to/file.py:function` (a file, relative to the working directory of the process that
loads it). The function is called with keyword arguments:

    prompt:    str (the prompt text), or for chat prompts the messages as a list of
               {"role": ..., "content": ...} dicts
    response:  str, the model's response
    reference: str, the row's reference answer ("" if it has none)
    metadata:  dict, the row's other fields

and, when its signature names it (or takes **kwargs),

    response_tokens: list[int], the response's token ids as the model generated them (the
               stop token included when it emitted one)

and returns a score (a finite number: verdict "accepted" if > 0, else "wrong_answer"), a
(score, verdict) tuple, or a dict {"reward": score, "verdict": ..., "reason": ...,
"token_rewards": [...]} (verdict, reason and token_rewards optional). A verdict is a
Verdict value ("accepted", "wrong_answer", "no_answer", ...). token_rewards are dense
per-token rewards, one finite number per token of response_tokens (whether or not the
function took them), added by the trainer to the sequence's reward (which arrives at its
last token) where the objective reads dense rewards.
"""

from __future__ import annotations

import inspect
import math
import numbers
import reprlib
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rlax_tpu.api.verifier import Verdict, VerificationResult
from rlax_tpu.user_modules import describe_exception, import_user_module

# The keyword arguments every reward function is called with ...
ARGUMENTS = ("prompt", "response", "reference", "metadata")
# ... and the one it gets when its signature names it (or takes **kwargs).
TOKENS_ARGUMENT = "response_tokens"
# A reason longer than this is cut (it goes into the rollout log with every sample).
MAX_REASON_CHARS = 2000
_RESULT_KEYS = ("reward", "verdict", "reason", "token_rewards")
_VERDICTS = tuple(v.value for v in Verdict)

# This process's loaded functions by spec (in a pool worker: for the worker's lifetime),
# or the RewardFunctionError that loading one raised.
_loaded: dict[str, Callable[..., Any] | RewardFunctionError] = {}


class RewardFunctionError(ValueError):
    """A reward function spec that cannot be used: malformed, its module does not import,
    no such attribute, not callable, or a signature that does not take the reward's
    keyword arguments. The message names the spec and what to fix."""


def parse_spec(spec: str) -> tuple[str, str]:
    """(module or file path, function name) of `spec`; RewardFunctionError if malformed."""
    module, sep, name = spec.rpartition(":")
    if not (sep and module and name.isidentifier()):
        raise RewardFunctionError(
            f"reward function {spec!r}: expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    return module, name


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names, imported into this process (a file is executed once per
    process; a module through the import system). Raises RewardFunctionError naming the
    spec when the module does not import, has no such attribute, the attribute is not
    callable, or its signature cannot take the keyword arguments prompt, response,
    reference and metadata (and response_tokens, when it names them)."""
    module_name, name = parse_spec(spec)
    module = import_user_module(module_name, f"reward function {spec!r}", RewardFunctionError)
    if not hasattr(module, name):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardFunctionError(
            f"reward function {spec!r}: {module_name!r} has no attribute {name!r}"
            + (f" (its functions: {', '.join(public[:10])})" if public else "")
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardFunctionError(
            f"reward function {spec!r}: {name!r} is not callable (it is "
            f"{_article(type(fn).__name__)} {type(fn).__name__})"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: calls will tell
        return fn
    arguments = (*ARGUMENTS, TOKENS_ARGUMENT) if takes_response_tokens(fn) else ARGUMENTS
    try:
        signature.bind(**{a: None for a in arguments})
    except TypeError as exc:
        raise RewardFunctionError(
            f"reward function {spec!r}: its signature {name}{signature} cannot take the "
            f"keyword arguments {', '.join(ARGUMENTS)} ({exc}); define it as "
            f"`def {name}(prompt, response, reference, metadata)` (or with **kwargs)"
        ) from None
    return fn


def check_reward_functions(specs: Iterable[str]) -> None:
    """Loads every spec in this process; one RewardFunctionError naming each that fails."""
    errors = []
    for spec in dict.fromkeys(specs):
        try:
            load_reward_function(spec)
        except RewardFunctionError as exc:
            errors.append(str(exc))
    if errors:
        raise RewardFunctionError("; ".join(errors))


def configured_reward_functions(config: Any) -> list[str]:
    """The reward function specs a run config names (its datasets' `reward_function`, in
    order, each once): `controller.datasets` and, where the config has one, `data`."""
    datasets = list(config.controller.datasets)
    data = getattr(config, "data", None)
    if data is not None:
        datasets.append(data)
    specs = (getattr(d, "reward_function", "") for d in datasets)
    return list(dict.fromkeys(s for s in specs if s))


# -- in a pool worker ---------------------------------------------------------------------------
def _cached(spec: str) -> Callable[..., Any]:
    entry = _loaded.get(spec)
    if entry is None:
        try:
            entry = load_reward_function(spec)
        except RewardFunctionError as exc:
            entry = exc
        except MemoryError:
            entry = RewardFunctionError(
                f"reward function {spec!r}: importing it ran out of the worker's memory "
                "(verifiers.math_memory_limit_bytes)"
            )
        _loaded[spec] = entry
    if isinstance(entry, RewardFunctionError):
        raise entry
    return entry


def preload(specs: Sequence[str]) -> None:
    """Loads `specs` into this worker (the pool's initializer). A spec that fails is
    remembered: its requests get the error as their reason, others are served."""
    loading_errors(specs)


def loading_errors(specs: Sequence[str]) -> list[str]:
    """The messages of the specs that do not load in this worker (the service's check at
    start)."""
    errors = []
    for spec in specs:
        try:
            _cached(spec)
        except RewardFunctionError as exc:
            errors.append(str(exc))
    return errors


def takes_response_tokens(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is called with `response_tokens`: its signature names that keyword (or
    takes **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins): the four arguments only
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(
        p.kind == inspect.Parameter.VAR_KEYWORD or (p.name == TOKENS_ARGUMENT and p.kind in keyword)
        for p in parameters
    )


def judge(
    spec: str,
    prompt: str | list[Any],
    response: str,
    reference: str,
    metadata: dict[str, Any],
    response_tokens: Sequence[int] | None = None,
) -> VerificationResult:
    """Calls the function `spec` names and checks what it returns (runs in a pool worker,
    under the pool's deadline). `response_tokens` (None: the request carries none) go to a
    function that takes them, and size its token rewards. A function that does not load,
    raises or returns something that is not a reward gives VERIFIER_ERROR with the reason;
    MemoryError goes to the pool (MEMORY_LIMIT)."""
    try:
        fn = _cached(spec)
    except RewardFunctionError as exc:
        return _error(str(exc))
    kwargs = {"prompt": prompt, "response": response, "reference": reference, "metadata": metadata}
    if response_tokens is not None and takes_response_tokens(fn):
        kwargs[TOKENS_ARGUMENT] = [int(t) for t in response_tokens]
    try:
        value = fn(**kwargs)
    except MemoryError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's bug is this request's verdict
        return _error(f"reward function {spec!r} raised {describe_exception(exc)}{_where(exc)}")
    num_tokens = None if response_tokens is None else len(response_tokens)
    return result_from_return(spec, value, num_tokens=num_tokens)


def result_from_return(
    spec: str, value: Any, *, num_tokens: int | None = None
) -> VerificationResult:
    """The VerificationResult of what the function `spec` returned (VERIFIER_ERROR naming
    the function and the value when it is not a reward). `num_tokens`: the response's
    token count, which token rewards must match (None: the request carried no tokens, so
    token rewards cannot be placed and are refused)."""
    shown = reprlib.repr(value)
    token_rewards = None
    if isinstance(value, tuple):
        if len(value) != 2:
            return _bad_return(
                spec, shown, f"a tuple must be (score, verdict), got {len(value)} items"
            )
        score, verdict = value
        reason = None
    elif isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in _RESULT_KEYS)
        if unknown or "reward" not in value:
            what = f"unknown keys {unknown}" if unknown else "no 'reward' key"
            return _bad_return(
                spec, shown, f"a dict takes 'reward', 'verdict', 'reason', 'token_rewards': {what}"
            )
        score, verdict, reason = value["reward"], value.get("verdict"), value.get("reason")
        token_rewards = value.get("token_rewards")
    else:
        score, verdict, reason = value, None, None
    if token_rewards is not None:
        token_rewards, problem = _token_rewards(token_rewards, num_tokens)
        if problem:
            return _bad_return(spec, shown, problem)
    if not isinstance(score, numbers.Real):  # int, float, bool, numpy scalars
        return _bad_return(spec, shown, f"the score {reprlib.repr(score)} is not a number")
    score = float(score)
    if not math.isfinite(score):
        return _bad_return(spec, shown, f"the score {score} is not finite")
    if verdict is None:
        verdict = Verdict.ACCEPTED if score > 0 else Verdict.WRONG_ANSWER
    elif not isinstance(verdict, str) or verdict not in _VERDICTS:
        return _bad_return(
            spec,
            shown,
            f"the verdict {reprlib.repr(verdict)} is not one of {', '.join(_VERDICTS)}",
        )
    if reason is None:
        reason = f"reward function {spec!r} returned {shown}"
    elif not isinstance(reason, str):
        return _bad_return(spec, shown, f"the reason {reprlib.repr(reason)} is not a string")
    if len(reason) > MAX_REASON_CHARS:
        reason = (
            reason[:MAX_REASON_CHARS] + f"... ({len(reason) - MAX_REASON_CHARS} more characters)"
        )
    return VerificationResult(
        reward=score, verdict=Verdict(verdict), reason=reason, token_rewards=token_rewards
    )


def _token_rewards(value: Any, num_tokens: int | None) -> tuple[tuple[float, ...] | None, str]:
    """(the token rewards as floats, "") or (None, what is wrong with `value`)."""
    if num_tokens is None:
        return None, (
            "token_rewards need the response's tokens, and this request carries none (the "
            "controller sends them with every 'function' request)"
        )
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        return None, f"token_rewards must be a list of numbers, got {type(value).__name__}"
    values = list(value)
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            return None, f"token_rewards[{i}] = {reprlib.repr(v)} is not a finite number"
    if len(values) != num_tokens:
        return None, (
            f"token_rewards has {len(values)} entries for a response of {num_tokens} tokens "
            "(one per token of response_tokens, the stop token included)"
        )
    return tuple(float(v) for v in values), ""


def _bad_return(spec: str, shown: str, problem: str) -> VerificationResult:
    return _error(
        f"reward function {spec!r} returned {shown}: {problem}; return a finite score, a "
        "(score, verdict) tuple or a dict {'reward': ..., 'verdict': ..., 'reason': ..., "
        "'token_rewards': [...]}"
    )


def _error(reason: str) -> VerificationResult:
    return VerificationResult(reward=0.0, verdict=Verdict.VERIFIER_ERROR, reason=reason)


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _where(exc: BaseException) -> str:
    """Where `exc` was raised: " (at FILE:LINE in FUNCTION)" of its innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name})"
