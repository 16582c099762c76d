"""`rlax-tpu samples RUN_DIR`: one batch of a run's rollout log as a person reads it — each
prompt's text, then its samples' response text, reward, verdict and the verifier's reason.
A multi-turn episode (controller.environment) is shown turn by turn: each policy turn's text
(loss mask 1), and each observation the environment gave between them (mask 0: the tool
messages, their verdicts and the tokens as the policy read them), from the rollout's mask
and the episode's logged steps.

It reads only the run directory (local or gs://, through rlax_tpu.storage): the rollout
log's rollouts, verdicts and prompt records (controller/snapshots.py, RolloutLog) and what
the trainer consumed. For batches logged before the log kept prompt records and response
text, the prompt comes from the run's dataset files and the response is decoded with the
run's tokenizer (effective_config.json names both).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING, Any

from rlax_tpu import storage
from rlax_tpu.controller.snapshots import CONSUMED_DIR, RolloutLog
from rlax_tpu.run_dir import EFFECTIVE_CONFIG

if TYPE_CHECKING:
    from rlax_tpu.controller.episodes import Turn


class SamplesError(ValueError):
    """The run directory holds no such batch (or no rollout log); the message says what
    there is."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (local path or gs://)")
    parser.add_argument(
        "--step",
        type=int,
        metavar="S",
        help="the batch to show (the rollouts train step S trains on; default: the newest "
        "batch with verdicts)",
    )
    parser.add_argument(
        "--limit", type=int, metavar="N", help="show at most N prompts (default: all)"
    )
    parser.add_argument(
        "--prompt-id",
        metavar="ID",
        help="only this prompt: its id in the log (b7:gsm8k:12), or its dataset row "
        "(gsm8k:12, or just 12)",
    )
    parser.add_argument("--json", action="store_true", help="print the batch as one JSON object")


def main(args: argparse.Namespace) -> int:
    try:
        batch = read_samples(
            args.run_dir, step=args.step, limit=args.limit, prompt_id=args.prompt_id
        )
    except SamplesError as e:
        print(f"rlax-tpu samples: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(batch, indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(render(batch))
    return 0


# -- reading ------------------------------------------------------------------------------
def read_samples(
    run_dir: str, *, step: int | None = None, limit: int | None = None, prompt_id: str | None = None
) -> dict[str, Any]:
    """Batch `step` (default: the newest with verdicts) of the run at `run_dir`: its prompts
    in draw order, each with its record and samples (response, reward, verdict, reason)."""
    log = RolloutLog(run_dir)
    batches = log.batches()
    if not batches:
        raise SamplesError(f"{run_dir} holds no rollout log (no {log.directory}/batch_*)")
    if step is None:
        step = next((b for b in reversed(batches) if log.has_verdicts(b)), batches[-1])
    rollouts = log.read_batch(step)
    if not rollouts:
        raise SamplesError(
            f"the rollout log of {run_dir} has no rollouts of batch {step}; it holds batches "
            f"{_ranges(batches)}"
        )
    verdicts = log.read_verdicts(step)
    records = log.read_prompts(step)
    # The episodes' module reaches the gRPC clients: imported only here, so the CLI (and
    # `deploy --dry-run`, which must not load gRPC) starts without it.
    from rlax_tpu.controller.episodes import TurnLog

    steps = TurnLog(log.directory).turns(step)
    consumed = _consumed(run_dir, step)
    fallback = _Fallback(run_dir)
    by_prompt: dict[str, list[tuple[tuple[str, int, int], dict[str, Any]]]] = {}
    for key, rollout in rollouts.items():
        by_prompt.setdefault(key[0], []).append((key, rollout))
    keys = sorted(by_prompt, key=_draw_order)
    if prompt_id:
        keys = [k for k in keys if k == prompt_id or k.endswith(f":{prompt_id}")]
        if not keys:
            raise SamplesError(
                f"batch {step} has no prompt {prompt_id!r}; its prompts: "
                + ", ".join(sorted(by_prompt, key=_draw_order)[:10])
                + (" ..." if len(by_prompt) > 10 else "")
            )
    shown = keys[:limit] if limit is not None and limit >= 0 else keys
    prompts = []
    for key in shown:
        samples = []
        for rollout_key, rollout in sorted(by_prompt[key], key=lambda kr: kr[0][1:]):
            verdict = verdicts.get(rollout_key)
            response = verdict.get("response") if verdict else None
            if response is None:
                response = fallback.response(rollout.get("tokens", []))
            samples.append(
                {
                    "sample_index": rollout_key[1],
                    "version": rollout_key[2],
                    "response": response,
                    "response_tokens": len(rollout.get("tokens", [])),
                    "finish_reason": rollout.get("finish_reason"),
                    "judged": verdict is not None,
                    "reward": verdict.get("reward") if verdict else None,
                    "verdict": verdict.get("verdict") if verdict else None,
                    "reason": verdict.get("reason", "") if verdict else "",
                    "trained": rollout_key in consumed,
                }
            )
            mask = rollout.get("loss_mask") or []
            if 0 in mask:  # an episode: its turns
                samples[-1]["turns"] = _turns(
                    rollout["tokens"], mask, steps.get(rollout_key, []), fallback
                )
        record = records.get(key) or fallback.record(key)
        prompts.append({"prompt_id": key, "record": record, "samples": samples})
    versions = sorted({k[2] for k in rollouts})
    return {
        "run_dir": run_dir,
        "batch": step,
        "versions": versions,
        "prompts_in_batch": len(keys) if prompt_id else len(by_prompt),
        "prompts": prompts,
    }


def _turns(
    tokens: list[int], mask: list[int], steps: list[Turn], fallback: _Fallback
) -> list[dict[str, Any]]:
    """An episode's response cut where its loss mask changes: policy turns (mask 1) and
    the observations between them (mask 0), each with its token count and text; an
    observation also with the tool messages and verdicts of its logged step."""
    out: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(tokens) + 1):
        if end < len(tokens) and mask[end] == mask[start]:
            continue
        piece = tokens[start:end]
        if mask[start]:
            out.append({"role": "policy", "tokens": len(piece), "text": fallback.response(piece)})
        else:
            index = sum(t["role"] == "observation" for t in out)
            step = steps[index] if index < len(steps) else None
            given: dict[str, Any] = {
                "role": "observation",
                "tokens": len(piece),
                "text": fallback.text(piece),
            }
            if step is not None and list(step.observation) == piece:
                given["messages"] = [dict(m) for m in step.messages]
                given["verdicts"] = list(step.info.get("verdicts", ()))
            out.append(given)
        start = end
    return out


def _consumed(run_dir: str, step: int) -> set[tuple[str, int, int]]:
    """The rows train step `step` consumed (prompt id, sample index, version); empty while
    it has not trained."""
    url = storage.join(run_dir, CONSUMED_DIR, f"batch_{step:09d}.json")
    if not storage.exists(url):
        return set()
    return {(p, int(s), int(v)) for p, s, v in json.loads(storage.read_text(url))}


def _draw_order(prompt_id: str) -> list[Any]:
    """Prompt ids in the order they were drawn: the batch's own ("b7:"), then the refill
    rounds ("b7r1:", ...), rows by number where they are numbers."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", prompt_id)]


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return ", ".join(out)


class _Fallback:
    """What older rollout logs did not keep, from the run's inputs: a prompt's dataset
    record (from the dataset files) and a response's text (decoded with the tokenizer).
    Loaded on first need; None where the inputs are gone."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._config: Any = False
        self._tokenizer: Any = False
        self._datasets: dict[str, dict[str, dict[str, Any]]] | None = None

    def config(self) -> Any:
        if self._config is False:
            self._config = None
            url = storage.join(self.run_dir, EFFECTIVE_CONFIG)
            if storage.exists(url):
                from rlax_tpu.config import load_config

                try:
                    self._config = load_config(url, [])
                except Exception:  # noqa: BLE001 - a config of another version: no fallback
                    self._config = None
        return self._config

    def text(self, tokens: list[int]) -> str | None:
        """Tokens as the policy read them: every token's text, special ones included."""
        if self.response([]) is None:  # loads the tokenizer, if it is there
            return None
        tokenizer, _ = self._tokenizer
        return tokenizer.decode(tokens, skip_special_tokens=False)

    def response(self, tokens: list[int]) -> str | None:
        if self._tokenizer is False:
            self._tokenizer = None
            config = self.config()
            if config is not None:
                from rlax_tpu.data.datasets import stop_tokens
                from rlax_tpu.data.tokenizer import Tokenizer
                from rlax_tpu.launch.job import tokenizer_path

                try:
                    tokenizer = Tokenizer.load(tokenizer_path(config))
                    stops = stop_tokens(config.inference.stop_token_ids, tokenizer)
                    self._tokenizer = (tokenizer, stops)
                except Exception:  # noqa: BLE001 - the tokenizer is gone: no text
                    self._tokenizer = None
        if self._tokenizer is None:
            return None
        from rlax_tpu.data.datasets import decode_response

        tokenizer, stops = self._tokenizer
        return decode_response(tokenizer, tokens, stops)

    def record(self, prompt_id: str) -> dict[str, Any] | None:
        """The dataset record of a prompt id "<draw>:<dataset>:<row id>"."""
        parts = prompt_id.split(":", 2)
        if len(parts) != 3:
            return None
        if self._datasets is None:
            self._datasets = {}
            config = self.config()
            if config is not None:
                from rlax_tpu.data.datasets import load_dataset

                for dataset in config.training_datasets:
                    try:
                        rows = load_dataset(dataset)
                    except Exception:  # noqa: BLE001 - the file is gone: no record
                        continue
                    for r in rows:
                        self._datasets.setdefault(r.dataset, {})[r.id] = r.to_json()
        return self._datasets.get(parts[1], {}).get(parts[2])


# -- printing -----------------------------------------------------------------------------
def render(batch: dict[str, Any]) -> str:
    """The batch as text: a header, then per prompt its text and each sample's response,
    reward, verdict and reason."""
    prompts = batch["prompts"]
    samples = [s for p in prompts for s in p["samples"]]
    rewards = [s["reward"] for s in samples if s["reward"] is not None]
    versions = ", ".join(str(v) for v in batch["versions"])
    lines = [
        f"batch {batch['batch']} of {batch['run_dir']} (version {versions}): "
        f"{len(prompts)} of {batch['prompts_in_batch']} prompts, {len(samples)} samples"
        + (f", reward mean {sum(rewards) / len(rewards):.3f}" if rewards else ""),
    ]
    for prompt in prompts:
        record = prompt["record"] or {}
        lines.append("")
        about = [f"verifier {record['verifier']}"] if record.get("verifier") else []
        if record.get("reference"):
            about.append(f"reference {record['reference']!r}")
        lines.append(
            f"== prompt {prompt['prompt_id']}" + (f" ({', '.join(about)})" if about else "")
        )
        lines.extend(_indent(_prompt_text(record), "   "))
        for s in prompt["samples"]:
            if s["judged"]:
                reward = "unjudged" if s["reward"] is None else f"{s['reward']:.3f}"
                verdict = f"reward {reward}  verdict {s['verdict']}"
                if s["reason"]:
                    verdict += f"  reason: {s['reason']}"
            else:
                verdict = "no verdict logged"
            trained = ", trained" if s["trained"] else ""
            lines.append(
                f"  -- sample {s['sample_index']} (version {s['version']}, "
                f"{s['response_tokens']} tokens, {s['finish_reason']}{trained}): {verdict}"
            )
            if s.get("turns"):
                lines.extend(_episode_lines(s["turns"]))
                continue
            text = s["response"] if s["response"] is not None else "(response text not logged)"
            lines.extend(_indent(text, "     | "))
    return "\n".join(lines) + "\n"


def _episode_lines(turns: list[dict[str, Any]]) -> list[str]:
    lines, number = [], 0
    for t in turns:
        text = t["text"] if t["text"] is not None else "(the run's tokenizer is gone)"
        if t["role"] == "policy":
            number += 1
            lines.append(f"     turn {number} (policy, {t['tokens']} tokens, loss mask 1):")
            lines.extend(_indent(text, "     | "))
            continue
        verdicts = f"; verdicts {', '.join(t['verdicts'])}" if t.get("verdicts") else ""
        lines.append(f"     observation ({t['tokens']} tokens given, loss mask 0{verdicts}):")
        for m in t.get("messages", ()):
            name = f" {m['name']}" if m.get("name") else ""
            lines.extend(_indent(f"[{m.get('role', '?')}{name}] {m.get('content', '')}", "     > "))
        lines.append(f"     > as tokens: {text!r}")
    return lines


def _prompt_text(record: dict[str, Any]) -> str:
    if not record:
        return "(prompt text not logged, and not found in the run's datasets)"
    parts = [f"[system] {record['system_prompt']}"] if record.get("system_prompt") else []
    if record.get("messages"):
        parts += [f"[{m.get('role', '?')}] {m.get('content', '')}" for m in record["messages"]]
    else:
        parts.append(str(record.get("prompt", "")))
    return "\n".join(parts)


def _indent(text: str, prefix: str) -> list[str]:
    return [prefix + line for line in (text.splitlines() or [""])]
