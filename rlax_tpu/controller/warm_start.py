"""The SFT warm start (`trainer.warm_start.steps` = S): S supervised steps on the training
datasets' reference answers (or their sft_field's solutions) before RL, after which the
trainer publishes version 0.

The controller drives it like RL steps, through the trainer's `SftStep` (the same service,
local or on a pod, so `--connect` warm-starts too; no JAX in the controller). Batches come
from the prompt mixture's own named stream (seed + SFT_STREAM), so the warm start never
shifts the RL prompt order; a warm start the trainer resumed from its checkpoint continues
at the trainer's next step, the stream fast-forwarded to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlax_tpu.config import RunConfig
from rlax_tpu.data.datasets import DatasetError, PromptMixture, PromptRecord, prompt_tokens

SFT_STREAM = 7919  # the warm start's prompt stream: seed + SFT_STREAM


def sft_rows(
    config: RunConfig, tokenizer: Any, records: list[PromptRecord], episodes: Any = None
) -> tuple:
    """(tokens, targets, loss_mask) of prompt + SFT target + eos, the loss on the target
    part: int32[rows, seq], int32[rows, seq], float32[rows, seq] (seq a multiple of 16).
    The SFT target is the record's `sft_text`: the reference answer, or the dataset's
    sft_field (a worked solution) where it names one.

    The prompt is rendered exactly as RL sends it (datasets.prompt_tokens: the chat template
    for chat rows and, where the tokenizer has one, for text rows), so the warm start
    teaches the answer in the format the policy is later asked in. With `episodes` (the
    run's Episodes: controller.environment) a row is the record's demonstration built as its
    episode is (`Episodes.demonstration`), the loss on the assistant turns only. A row
    longer than trainer.max_seq_len is refused (the datasets scan finds them all before the
    run)."""
    eos = tokenizer.eos_token_id
    seqs, masks = [], []
    for r in records:
        if episodes is not None:
            seq, mask = episodes.demonstration(r)
        elif r.sft_messages:
            raise DatasetError(
                f"SFT row {r.id!r} of dataset {r.dataset!r} is a demonstration (its sft_field "
                "holds messages) and only a run with an environment can follow it: set "
                "controller.environment.name, or point the dataset's sft_field at a text "
                "target ('' = the reference answer)"
            )
        else:
            prompt = list(prompt_tokens(tokenizer, r))
            answer = tokenizer.encode(r.sft_text, add_special_tokens=False)
            answer += [eos] if eos is not None else []
            seq, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        seqs.append(seq)
        masks.append(mask)
        if len(seqs[-1]) > config.trainer.max_seq_len:
            raise DatasetError(
                f"SFT row {r.id!r} of dataset {r.dataset!r} has {len(seqs[-1])} tokens, more "
                f"than trainer.max_seq_len={config.trainer.max_seq_len}"
            )
    seq = min(config.trainer.max_seq_len, 16 * -(-max(len(s) for s in seqs) // 16))
    tokens = np.zeros((len(seqs), seq), np.int32)
    mask = np.zeros((len(seqs), seq), np.float32)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        tokens[i, : len(s)] = s
        mask[i, : len(s) - 1] = m[1:]  # position t predicts tokens[t + 1]
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    return tokens, targets, mask


def run_warm_start(
    config: RunConfig,
    trainer: Any,
    tokenizer: Any,
    mixture: PromptMixture,
    *,
    next_step: int,
    report: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    episodes: Any = None,
) -> None:
    """SFT steps [next_step, trainer.warm_start.steps) on `trainer` (a TrainerClient, or a
    Trainer in this process); `mixture` is the run's prompt mixture, whose sibling stream
    they draw from; `episodes` the run's Episodes where it has an environment (`sft_rows`).
    Returns early once `stop` is set (the trainer is then at a step boundary). `report`
    gets a line after the first step, every ~10% of the steps and after the last."""
    ctl = config.controller
    stream = mixture.sibling(config.seed + SFT_STREAM)
    stream.draw(next_step * ctl.global_batch_size)  # the steps the trainer has done
    t0 = time.perf_counter()
    steps = config.trainer.warm_start.steps
    every = max(1, steps // 10)  # a line per ~10% of the warm start
    for step in range(next_step, steps):
        if stop is not None and stop.is_set():
            return
        records = stream.draw(ctl.global_batch_size)
        result = trainer.sft_step(step, *sft_rows(config, tokenizer, records, episodes))
        # The first step says the trainer compiled and runs; then every ~10% and the last.
        if step == next_step or (step + 1) % every == 0 or step == steps - 1:
            report(
                f"sft step {step + 1}/{steps}: loss {result.metrics.get('loss', 0):.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
