"""The prompt mixture (DESIGN §8): datasets of prompts, weighted and drawn reproducibly.

Datasets are JSONL or Parquet files (local, file:// or gs://). A draw picks a dataset by weight
from a seeded RNG stream and takes that dataset's next prompt in a per-epoch shuffled order, so
the whole sequence is a function of (seed, datasets) and resumes exactly from `state()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlax_tpu import storage
from rlax_tpu.config.run import DatasetConfig

# What a row may name as its verifier: the kinds of rlax_tpu.api.verifier.VerifierKind
# ("function": the dataset's reward function), and "none" for prompts generated but not scored.
VERIFIERS = ("math", "code", "arithmetic", "reasoning_gym", "function", "none")
# Row fields with a meaning of their own besides the configured ones; others are metadata.
_KNOWN_FIELDS = ("reference", "problem", "tests", "verifier")
# Verifiers that judge against a reference answer, and those that need a problem (tests) link.
_NEEDS_REFERENCE = ("math", "arithmetic", "reasoning_gym")
_NEEDS_PROBLEM = ("code",)
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_STATE_FORMAT = 1


class DatasetError(ValueError):
    """A dataset file cannot be read, or one of its rows is unusable; the message says where."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt of a dataset, with what its verifier needs.

    Exactly one of `prompt` (plain text) and `messages` (chat: {"role", "content", ...} dicts)
    is set. `reference` is the reference answer (math, arithmetic; a task entry as JSON for
    reasoning_gym), `problem` the link to a code problem's tests. How the prompt is rendered
    comes from its dataset's config: `system_prompt`, `apply_chat_template` (a text prompt
    goes through the tokenizer's chat template when it has one) and `template_kwargs`.
    `reward_function` and `metadata` (the row's other fields) are for a reward function.
    `sft_target` is what the SFT warm start trains on when it is not the reference (the
    dataset's sft_field: a worked solution); `sft_text` is the one it trains on.
    `sft_messages` is a demonstration instead (an sft_field holding a list of messages): the
    turns after the prompt, assistant turns (tool calls among them) and the tool results
    between them, for runs with an environment (controller.environment), whose warm start
    trains on the assistant turns' tokens only.
    """

    dataset: str
    id: str
    prompt: str = ""
    messages: tuple[dict[str, Any], ...] = ()
    reference: str = ""
    problem: str = ""
    verifier: str = "math"
    reward_function: str = ""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    system_prompt: str = ""
    apply_chat_template: bool = True
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sft_target: str = ""
    sft_messages: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if bool(self.prompt) == bool(self.messages):
            which = "both" if self.prompt else "neither"
            raise DatasetError(
                f"prompt {self.id!r} has {which} of 'prompt' and 'messages'; give exactly one "
                "(plain text, or chat messages [{'role': ..., 'content': ...}, ...])"
            )
        if self.verifier not in VERIFIERS:
            raise DatasetError(
                f"prompt {self.id!r}: verifier {self.verifier!r} is unknown; use one of "
                f"{', '.join(VERIFIERS)}"
            )
        if self.verifier in _NEEDS_REFERENCE and not self.reference:
            raise DatasetError(
                f"prompt {self.id!r}: the {self.verifier} verifier needs a reference answer "
                "(field 'answer' or 'reference')"
            )
        if self.verifier == "function" and not self.reward_function:
            raise DatasetError(
                f"prompt {self.id!r}: verifier 'function' needs the dataset's reward_function"
            )
        if self.verifier in _NEEDS_PROBLEM and not self.problem:
            raise DatasetError(
                f"prompt {self.id!r}: the code verifier needs a link to the problem's tests "
                "(field 'problem' or 'tests')"
            )

    @property
    def sft_text(self) -> str:
        """The SFT warm start's target: `sft_target`, else the reference answer."""
        return self.sft_target or self.reference

    def to_json(self) -> dict[str, Any]:
        """This record as a JSON object (a dict of JSON types), for the rollout log."""
        out: dict[str, Any] = {"dataset": self.dataset, "id": self.id}
        if self.prompt:
            out["prompt"] = self.prompt
        else:
            out["messages"] = [dict(m) for m in self.messages]
        out.update(reference=self.reference, problem=self.problem, verifier=self.verifier)
        for name in _OPTIONAL_FIELDS:  # only where not the default: older records unchanged
            value = getattr(self, name)
            if value != _DEFAULTS[name]:
                if isinstance(value, Mapping):
                    value = dict(value)
                elif isinstance(value, tuple):
                    value = [dict(m) for m in value]
                out[name] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PromptRecord:
        """The record `to_json` wrote."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise DatasetError(f"prompt record has unknown fields {sorted(unknown)}: {data!r}")
        fields = dict(data)
        for key in ("messages", "sft_messages"):
            if key in fields:
                fields[key] = tuple(dict(m) for m in fields[key])
        try:
            return cls(**fields)
        except TypeError as e:  # a required field is missing
            raise DatasetError(f"prompt record {data!r} is incomplete: {e}") from None


# Fields a record's JSON holds only where they are not the default.
_OPTIONAL_FIELDS = (
    "reward_function",
    "metadata",
    "system_prompt",
    "apply_chat_template",
    "template_kwargs",
    "sft_target",
    "sft_messages",
)


_DEFAULTS = {
    f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(PromptRecord)
    if f.name in _OPTIONAL_FIELDS
}


def chat_messages(tokenizer: Any, record: PromptRecord) -> list[dict[str, Any]] | None:
    """The messages `record` is rendered from with the chat template, or None for a plain
    text prompt: chat rows (with the system prompt first unless they bring their own), and
    text prompts of a dataset with apply_chat_template when the tokenizer has a template."""
    system = [{"role": "system", "content": record.system_prompt}] if record.system_prompt else []
    if record.messages:
        messages = [dict(m) for m in record.messages]
        if messages[0].get("role") == "system":
            return messages
        return system + messages
    if record.apply_chat_template and getattr(tokenizer, "chat_template", None):
        return [*system, {"role": "user", "content": record.prompt}]
    return None


def prompt_tokens(tokenizer: Any, record: PromptRecord) -> tuple[int, ...]:
    """A record's prompt tokens, as training, evaluation and the SFT warm start all send
    them: the chat template with the generation prompt (`chat_messages`, with the dataset's
    chat_template_kwargs), else the text (after the system prompt and a blank line)."""
    messages = chat_messages(tokenizer, record)
    if messages is not None:
        ids = tokenizer.encode_chat(
            messages, add_generation_prompt=True, **dict(record.template_kwargs)
        )
    else:
        text = record.prompt
        if record.system_prompt:
            text = f"{record.system_prompt}\n\n{text}"
        ids = tokenizer.encode(text)
    return tuple(int(t) for t in ids)


def encode_prompt(tokenizer: Any, record: PromptRecord, max_prompt_len: int) -> tuple[int, ...]:
    """`prompt_tokens`, refusing a prompt longer than `max_prompt_len` (a DatasetError: never
    truncated silently; `scan_prompts` finds them all before a run starts)."""
    ids = prompt_tokens(tokenizer, record)
    if len(ids) > max_prompt_len:
        raise DatasetError(
            f"prompt {record.id!r} of dataset {record.dataset!r} has {len(ids)} tokens, more "
            f"than inference.max_prompt_len={max_prompt_len}: raise the limit or drop the row"
        )
    return ids


def stop_tokens(stop_token_ids: Sequence[int], tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a response: inference.stop_token_ids, else every EOS token of the
    tokenizer (tokenizer_config's and generation_config.json's, e.g. Qwen's <|im_end|> and
    <|endoftext|>)."""
    if stop_token_ids:
        return tuple(stop_token_ids)
    eos = getattr(tokenizer, "eos_token_ids", None)
    if eos is None:
        eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return tuple(int(t) for t in eos)


def decode_response(tokenizer: Any, tokens: Sequence[int], stops: Sequence[int]) -> str:
    """A response's text for the verifiers: stop tokens removed, special tokens skipped."""
    stop_set = set(stops)
    return tokenizer.decode([t for t in tokens if t not in stop_set], skip_special_tokens=True)


def dataset_name(config: DatasetConfig) -> str:
    """The name a dataset goes by in records, counters and snapshots: its file's stem
    ("gs://bucket/data/gsm8k.jsonl" -> "gsm8k")."""
    base = posixpath.basename(config.path.rstrip("/"))
    for suffix in (*JSONL_SUFFIXES, *PARQUET_SUFFIXES):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def load_dataset(config: DatasetConfig) -> list[PromptRecord]:
    """Every prompt of the dataset at `config.path` (.jsonl / .json: one JSON object per line,
    or one JSON array; .parquet), in file order.

    Row fields (their names from the config's field mapping, defaults shown): `prompt`
    (text) or `messages` (chat), `answer` (or `reference`), `problem` or `tests`, optional
    `id` (default "<dataset>:<row>") and `verifier` (default: the config's), and with
    sft_field set that field (the SFT target); any other field is the row's metadata
    (docs/datasets.md).
    """
    path, name = config.path, dataset_name(config)
    if path.endswith(JSONL_SUFFIXES):
        rows = _read_json_rows(path)
    elif path.endswith(PARQUET_SUFFIXES):
        rows = _read_parquet_rows(path)
    else:
        raise DatasetError(
            f"{path}: unknown dataset format; name the file *.jsonl, *.json or *.parquet"
        )
    if not rows:
        raise DatasetError(f"{path}: the dataset is empty (a dataset needs at least one prompt)")
    records, seen = [], {}
    for index, (where, row) in enumerate(rows):
        try:
            record = _record(row, name, index, config)
        except DatasetError as e:
            raise DatasetError(f"{path}, {where}: {e}") from None
        if record.id in seen:
            raise DatasetError(
                f"{path}, {where}: id {record.id!r} already names {seen[record.id]}; "
                "ids must be unique within a dataset"
            )
        seen[record.id] = where
        records.append(record)
    return records


@dataclasses.dataclass(frozen=True)
class DatasetScan:
    """What `scan_datasets` found in one dataset: its prompt lengths (tokens, under the
    tokenizer and chat template) and the rows over the limits, by id."""

    name: str
    rows: int
    longest_prompt: int
    median_prompt: float
    overlong: tuple[tuple[str, int], ...]  # (id, tokens) of prompts over max_prompt_len
    overlong_sft: tuple[tuple[str, int], ...] = ()  # (id, tokens) of SFT rows over max_seq_len
    dropped: int = 0

    def to_json(self) -> dict[str, Any]:
        """This scan as JSON types (dataset_scan.json in the run directory)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}


def scan_datasets(
    records: Mapping[str, Sequence[PromptRecord]],
    tokenizer: Any,
    config: Any,
    *,
    sft: bool = True,
) -> tuple[dict[str, list[PromptRecord]], dict[str, DatasetScan]]:
    """Every prompt of every dataset measured once, before anything runs: (the records the
    run uses, a scan per dataset). A prompt over inference.max_prompt_len (and, with `sft`
    and the SFT warm start, prompt + SFT target + EOS over trainer.max_seq_len) is an error
    naming the rows and the --set that fits them, or, with controller.overlong_prompts=drop,
    left out (and counted). Nothing is ever truncated. Demonstrations (sft_messages) are
    measured by the controller, as their episodes render them (Controller's episode check);
    in a run without an environment they are an error here."""
    limit, seq = config.inference.max_prompt_len, config.trainer.max_seq_len
    with_sft = sft and config.trainer.warm_start.steps > 0
    kept, scans = {}, {}
    for name, rows in records.items():
        demonstration = next((r for r in rows if r.sft_messages), None)
        if with_sft and demonstration and not config.controller.environment.enabled:
            raise DatasetError(
                f"dataset {name!r}: row {demonstration.id!r} has a demonstration for the SFT "
                "warm start (its sft_field holds messages), which only a run with an "
                "environment can follow: set controller.environment.name, or point the "
                "dataset's sft_field at a text target ('' = the reference answer)"
            )
        lengths = [len(prompt_tokens(tokenizer, r)) for r in rows]
        sft_lengths = [
            n + len(tokenizer.encode(r.sft_text, add_special_tokens=False)) + 1
            if with_sft and not r.sft_messages
            else 0
            for r, n in zip(rows, lengths, strict=True)
        ]
        over = tuple((r.id, n) for r, n in zip(rows, lengths, strict=True) if n > limit)
        over_sft = tuple((r.id, n) for r, n in zip(rows, sft_lengths, strict=True) if n > seq)
        bad = {i for i, _ in over} | {i for i, _ in over_sft}
        keep = [r for r in rows if r.id not in bad]
        if config.controller.overlong_prompts == "drop" and bad and not keep:
            raise DatasetError(
                f"dataset {name!r}: every one of its {len(rows)} prompts is over the limits "
                f"(inference.max_prompt_len={limit}); nothing would be left"
            )
        scans[name] = DatasetScan(
            name=name,
            rows=len(rows),
            longest_prompt=max(lengths),
            median_prompt=float(np.median(lengths)),
            overlong=over,
            overlong_sft=over_sft,
            dropped=len(rows) - len(keep),
        )
        kept[name] = keep if config.controller.overlong_prompts == "drop" else list(rows)
    problems = [_overlong_message(scan, config) for scan in scans.values() if scan.dropped]
    if problems and config.controller.overlong_prompts == "error":
        raise DatasetError(
            " ".join(problems) + " Nothing is truncated: fit them with the --set above, or "
            "leave them out with --set controller.overlong_prompts=drop (counted in the "
            "metrics as dataset/overlong_dropped)"
        )
    return kept, scans


def _overlong_message(scan: DatasetScan, config: Any) -> str:
    inference, trainer = config.inference, config.trainer
    parts = []
    if scan.overlong:
        worst = sorted(scan.overlong, key=lambda x: -x[1])
        named = ", ".join(f"{i} ({n})" for i, n in worst[:5])
        more = f" and {len(worst) - 5} more" if len(worst) > 5 else ""
        need = max(n for _, n in worst)
        prompt_len = 16 * -(-need // 16)
        sets = []
        seq = max(trainer.max_seq_len, prompt_len + inference.max_new_tokens)
        if seq > trainer.max_seq_len:
            sets.append(f"trainer.max_seq_len={seq}")
        if prompt_len > inference.prefill_buckets[-1]:
            buckets = (*inference.prefill_buckets, prompt_len)
            sets.append(f"inference.prefill_buckets={','.join(map(str, buckets))}")
        sets.append(f"inference.max_prompt_len={prompt_len}")
        parts.append(
            f"dataset {scan.name!r}: {len(worst)} of {scan.rows} prompts are longer than "
            f"inference.max_prompt_len={inference.max_prompt_len} tokens under the tokenizer "
            f"and chat template: {named}{more}. Fit them: "
            + " ".join(f"--set {x}" for x in sets)
            + "."
        )
    if scan.overlong_sft:
        worst = sorted(scan.overlong_sft, key=lambda x: -x[1])
        named = ", ".join(f"{i} ({n})" for i, n in worst[:5])
        more = f" and {len(worst) - 5} more" if len(worst) > 5 else ""
        need = 16 * -(-max(n for _, n in worst) // 16)
        parts.append(
            f"dataset {scan.name!r}: {len(worst)} of {scan.rows} rows are longer than "
            f"trainer.max_seq_len={trainer.max_seq_len} as SFT warm-start sequences (prompt, "
            f"SFT target, EOS): {named}{more}. Fit them: --set trainer.max_seq_len={need}."
        )
    return " ".join(parts)


def load_prompts(
    config: Any, tokenizer: Any
) -> tuple[dict[str, list[PromptRecord]], dict[str, float], dict[str, DatasetScan]]:
    """The training datasets of `config` (RunConfig.training_datasets), read and scanned
    (`scan_datasets`): (records by name, weights by name, scans by name)."""
    datasets = config.training_datasets
    if not datasets:
        raise DatasetError(
            "the run has no training data: set data.path (a JSONL or Parquet file, "
            "docs/datasets.md) or controller.datasets"
        )
    names = [dataset_name(d) for d in datasets]
    _check_unique_names(names, [d.path for d in datasets])
    records = {name: load_dataset(d) for name, d in zip(names, datasets, strict=True)}
    kept, scans = scan_datasets(records, tokenizer, config)
    weights = {name: d.weight for name, d in zip(names, datasets, strict=True)}
    return kept, weights, scans


def load_eval_prompts(config: Any, tokenizer: Any) -> list[PromptRecord]:
    """The held-out prompts: the first controller.eval_size rows of controller.eval_dataset
    (read with the first training dataset's field mapping and template, but no SFT target:
    nothing is trained on them), scanned like the training data. [] without an eval
    dataset."""
    ctl = config.controller
    if not ctl.eval_dataset:
        return []
    datasets = config.training_datasets
    if datasets:
        base = dataclasses.replace(datasets[0], path=ctl.eval_dataset, weight=1.0, sft_field="")
    else:
        base = DatasetConfig(path=ctl.eval_dataset)
    records = load_dataset(base)
    name = dataset_name(base)
    kept, _ = scan_datasets({name: records}, tokenizer, config, sft=False)
    return kept[name][: ctl.eval_size]


# -- held out means held out ---------------------------------------------------------------------
def problem_text(record: PromptRecord) -> str:
    """What a prompt asks, as a reader sees it: its text, or its chat messages' contents in
    order (the dataset's system prompt and the template's markup left out)."""
    if record.prompt:
        return record.prompt
    return "\n".join(str(m.get("content", "")) for m in record.messages)


def normalised_problem(record: PromptRecord) -> str:
    """`problem_text` without whitespace and case folded (digits and punctuation kept): two
    prompts that differ only in spacing or case ask the same problem."""
    return "".join(problem_text(record).split()).casefold()


@dataclasses.dataclass(frozen=True)
class EvalOverlap:
    """How many held-out prompts are also training prompts: `exact` ones render to the same
    prompt tokens (tokenizer and chat template), `normalised` ones ask the same problem after
    `normalised_problem` (the exact ones among them)."""

    eval_dataset: str
    training_datasets: tuple[str, ...]
    prompts: int  # held-out prompts checked
    distinct: int  # distinct problems among them (normalised)
    exact: int
    normalised: int
    examples: tuple[str, ...]  # ids of up to 5 held-out prompts that are training prompts

    @property
    def fraction(self) -> float:
        return self.normalised / self.prompts if self.prompts else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fraction": self.fraction}

    def describe(self) -> str:
        trained = ", ".join(self.training_datasets)
        return (
            f"held-out set {self.eval_dataset}: {self.prompts} prompts, {self.distinct} distinct "
            f"problems; {self.normalised} ({self.fraction:.1%}) also in the training data "
            f"({trained}; {self.exact} with the same prompt tokens)"
        )


def eval_overlap(
    eval_name: str,
    eval_records: Sequence[PromptRecord],
    training: Mapping[str, Sequence[PromptRecord]],
    tokenizer: Any,
) -> EvalOverlap:
    """The overlap of the held-out prompts with every training dataset's prompts."""
    rendered = {prompt_tokens(tokenizer, r) for rows in training.values() for r in rows}
    asked = {normalised_problem(r) for rows in training.values() for r in rows}
    exact = normalised = 0
    examples = []
    for record in eval_records:
        same = normalised_problem(record) in asked
        exact += prompt_tokens(tokenizer, record) in rendered
        normalised += same
        if same and len(examples) < 5:
            examples.append(record.id)
    return EvalOverlap(
        eval_dataset=eval_name,
        training_datasets=tuple(training),
        prompts=len(eval_records),
        distinct=len({normalised_problem(r) for r in eval_records}),
        exact=exact,
        normalised=normalised,
        examples=tuple(examples),
    )


def check_eval_overlap(overlap: EvalOverlap, max_fraction: float) -> None:
    """DatasetError naming the datasets and the knob when more than `max_fraction` of the
    held-out prompts are training prompts: their accuracy would measure memorisation."""
    if overlap.fraction <= max_fraction:
        return
    needed = math.ceil(overlap.fraction * 1000) / 1000
    raise DatasetError(
        f"the held-out set {overlap.eval_dataset!r} is not held out: {overlap.normalised} of "
        f"its {overlap.prompts} prompts ({overlap.fraction:.1%}) are also training prompts of "
        f"{', '.join(repr(n) for n in overlap.training_datasets)} ({overlap.exact} with the "
        f"same prompt tokens, the rest after normalising whitespace and case; e.g. "
        f"{', '.join(overlap.examples)}), so its accuracy would measure memorisation. "
        "Evaluate on a file disjoint from the training data (for GSM8K its test split, "
        "docs/datasets.md), or accept the overlap with --set "
        f"controller.max_eval_overlap={needed:g} (now {max_fraction:g})"
    )


def held_out_overlap(
    config: Any,
    training: Mapping[str, Sequence[PromptRecord]],
    eval_records: Sequence[PromptRecord],
    tokenizer: Any,
) -> EvalOverlap | None:
    """The overlap of the config's held-out set with `training`, checked against
    controller.max_eval_overlap (DatasetError over it); None without a held-out set."""
    if not config.controller.eval_dataset:
        return None
    name = dataset_name(DatasetConfig(path=config.controller.eval_dataset))
    overlap = eval_overlap(name, eval_records, training, tokenizer)
    check_eval_overlap(overlap, config.controller.max_eval_overlap)
    return overlap


class PromptMixture:
    """Prompts drawn from weighted datasets, reproducibly.

    Each draw picks a dataset with probability weight / sum(weights), from an RNG stream
    seeded by (seed, "prompt_mixture"), and takes that dataset's next prompt: with c prompts
    of the dataset consumed so far and n in it, prompt perm[c % n] of a permutation seeded by
    (seed, dataset name, c // n), so every epoch visits each prompt once.
    """

    def __init__(self, datasets: Sequence[DatasetConfig], seed: int) -> None:
        if not datasets:
            raise DatasetError(
                "the prompt mixture needs at least one dataset (controller.datasets)"
            )
        names = [dataset_name(d) for d in datasets]
        _check_unique_names(names, [d.path for d in datasets])
        records = {name: load_dataset(d) for name, d in zip(names, datasets, strict=True)}
        weights = {name: d.weight for name, d in zip(names, datasets, strict=True)}
        self._setup(records, weights, seed)

    @classmethod
    def from_records(
        cls,
        records: Mapping[str, Sequence[PromptRecord]],
        weights: Mapping[str, float],
        seed: int,
        *,
        dropped: Mapping[str, int] | None = None,
    ) -> PromptMixture:
        """A mixture of datasets already in memory (name -> records), e.g. generated or
        scanned ones (`dropped`: rows the scan left out, by dataset, for the metrics)."""
        if not records:
            raise DatasetError("the prompt mixture needs at least one dataset")
        if set(weights) != set(records):
            raise DatasetError(
                f"weights name datasets {sorted(weights)} but records name {sorted(records)}"
            )
        for name, rows in records.items():
            if not rows:
                raise DatasetError(f"dataset {name!r} is empty")
        mixture = cls.__new__(cls)
        mixture._setup({n: list(r) for n, r in records.items()}, dict(weights), seed)
        mixture.dropped = dict(dropped or {})
        return mixture

    def _setup(
        self, records: dict[str, list[PromptRecord]], weights: dict[str, float], seed: int
    ) -> None:
        for name, weight in weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise DatasetError(f"dataset {name!r}: weight must be > 0, got {weight}")
        self._seed = int(seed)
        self.dropped: dict[str, int] = {}  # rows left out by the scan, per dataset
        self._names = list(records)
        self._records = records
        self._weights = weights
        total = sum(weights[n] for n in self._names)
        self._cdf = np.cumsum([weights[n] / total for n in self._names])
        self._rng = np.random.Generator(
            np.random.PCG64(_seed_sequence(self._seed, "prompt_mixture"))
        )
        self._counters = dict.fromkeys(self._names, 0)
        self._permutations: dict[str, tuple[int, np.ndarray]] = {}  # name -> (epoch, perm)

    def sibling(self, seed: int) -> PromptMixture:
        """Another named stream over the same datasets (shared in memory, not reloaded): the
        SFT warm start's and the refill stream's draws never shift this one's."""
        mixture = PromptMixture.__new__(PromptMixture)
        mixture._setup(self._records, self._weights, seed)
        mixture.dropped = dict(self.dropped)
        return mixture

    @property
    def names(self) -> list[str]:
        """The dataset names, in config order."""
        return list(self._names)

    @property
    def sizes(self) -> dict[str, int]:
        return {name: len(self._records[name]) for name in self._names}

    def records(self, name: str) -> tuple[PromptRecord, ...]:
        """Dataset `name`'s records, in file order (as scanned: overlong ones dropped)."""
        return tuple(self._records[name])

    @property
    def counters(self) -> dict[str, int]:
        """Prompts consumed so far, per dataset name."""
        return dict(self._counters)

    def draw(self, count: int) -> list[PromptRecord]:
        """The next `count` prompts. Draws are one at a time, so draw(a) then draw(b) equals
        draw(a + b). The controller asks each prompt for G samples (samples_per_prompt)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        out = []
        for _ in range(count):
            u = self._rng.random()
            index = min(int(np.searchsorted(self._cdf, u, side="right")), len(self._names) - 1)
            out.append(self._next(self._names[index]))
        return out

    def _next(self, name: str) -> PromptRecord:
        records, consumed = self._records[name], self._counters[name]
        epoch, position = divmod(consumed, len(records))
        cached = self._permutations.get(name)
        if cached is None or cached[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(_seed_sequence(self._seed, name, epoch)))
            cached = (epoch, rng.permutation(len(records)))
            self._permutations[name] = cached
        self._counters[name] = consumed + 1
        return records[int(cached[1][position])]

    def state(self) -> dict[str, Any]:
        """Where the mixture stands, as JSON types: the dataset-choice RNG and the counters
        (and dataset sizes, so a resume against changed files is caught)."""
        return {
            "format": _STATE_FORMAT,
            "rng": self._rng.bit_generator.state,
            "counters": dict(self._counters),
            "sizes": self.sizes,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from `state()`; the draws that follow equal those after that state was taken.

        Raises DatasetError, changing nothing, if the state is malformed or belongs to a
        mixture of other datasets.
        """
        if not isinstance(state, Mapping):
            raise DatasetError(f"prompt mixture state must be a dict, got {type(state).__name__}")
        missing = {"rng", "counters"} - set(state)
        if missing:
            raise DatasetError(f"prompt mixture state lacks {sorted(missing)}: {state!r}")
        if state.get("format", _STATE_FORMAT) != _STATE_FORMAT:
            raise DatasetError(
                f"prompt mixture state has format {state['format']!r}; this version reads "
                f"format {_STATE_FORMAT}"
            )
        counters = state["counters"]
        if not isinstance(counters, Mapping):
            raise DatasetError(f"prompt mixture state: counters must be a dict, got {counters!r}")
        unknown = sorted(set(counters) - set(self._names))
        absent = sorted(set(self._names) - set(counters))
        if unknown or absent:
            problems = [f"it names {unknown}, which this mixture lacks"] if unknown else []
            problems += [f"it lacks {absent}, which this mixture has"] if absent else []
            raise DatasetError(
                f"prompt mixture state is for other datasets: {'; '.join(problems)} "
                f"(this mixture: {self._names})"
            )
        for name, value in counters.items():
            if type(value) is not int or value < 0:
                raise DatasetError(
                    f"prompt mixture state: counter of {name!r} must be an int >= 0, got {value!r}"
                )
        sizes = state.get("sizes", self.sizes)
        if not isinstance(sizes, Mapping):
            raise DatasetError(f"prompt mixture state: sizes must be a dict, got {sizes!r}")
        changed = {n: (sizes.get(n), len(self._records[n])) for n in self._names}
        changed = {n: s for n, s in changed.items() if s[0] is not None and s[0] != s[1]}
        if changed:
            detail = ", ".join(f"{n}: {old} then, {new} now" for n, (old, new) in changed.items())
            raise DatasetError(
                f"prompt mixture state was taken with datasets of other sizes ({detail}); the "
                "dataset files changed since, so the run cannot continue reproducibly"
            )
        rng = np.random.PCG64()
        try:
            rng.state = dict(state["rng"])
        except (TypeError, ValueError, KeyError) as e:
            raise DatasetError(f"prompt mixture state: bad RNG state {state['rng']!r}: {e}") from e
        self._rng = np.random.Generator(rng)
        self._counters = {name: int(counters[name]) for name in self._names}


# -- helpers ----------------------------------------------------------------------------------


def _seed_sequence(seed: int, *parts: str | int) -> np.random.SeedSequence:
    """A SeedSequence named by (seed, *parts): a stable hash, so names make independent streams
    (and negative or huge seeds work)."""
    key = json.dumps([int(seed), *parts]).encode()
    return np.random.SeedSequence(int.from_bytes(hashlib.sha256(key).digest(), "little"))


def _check_unique_names(names: list[str], paths: list[str]) -> None:
    for i, name in enumerate(names):
        if name in names[:i]:
            first = paths[names.index(name)]
            raise DatasetError(
                f"datasets {first} and {paths[i]} both go by the name {name!r} (their file "
                "stem); rename one of the files"
            )


def _read_json_rows(path: str) -> list[tuple[str, Any]]:
    """(where, row) for each record of a JSON-lines file (or a file holding one JSON array)."""
    text = _read(path).decode("utf-8-sig")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from None
        return [(f"row {i}", row) for i, row in enumerate(rows)]
    out = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path}, row {len(out)} (line {line_no}): not valid JSON: {e}"
            ) from None
        out.append((f"row {len(out)} (line {line_no})", row))
    return out


def _read_parquet_rows(path: str) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(_read(path)))
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable Parquet file: {e}") from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read(path: str) -> bytes:
    try:
        return storage.read_bytes(path)
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such dataset file") from None


def _record(row: Any, dataset: str, index: int, config: DatasetConfig) -> PromptRecord:
    if not isinstance(row, Mapping):
        raise DatasetError(f"expected a JSON object, got {type(row).__name__}: {row!r:.80}")
    row = {k: v for k, v in row.items() if v is not None}  # Parquet fills absent fields with null
    prompt_field, messages_field = config.prompt_field, config.messages_field
    prompt = row.get(prompt_field, "")
    if not isinstance(prompt, str):
        raise DatasetError(f"{prompt_field!r} must be text, got {type(prompt).__name__}")
    messages = _messages(row.get(messages_field, ()), messages_field)
    if bool(prompt) == bool(messages):
        which = "both" if prompt else "neither"
        fields = ", ".join(sorted(row)) or "none"
        raise DatasetError(
            f"has {which} of {prompt_field!r} and {messages_field!r}; give exactly one (plain "
            "text, or chat messages [{'role': ..., 'content': ...}, ...]). The row's fields "
            f"are: {fields}; name yours with the dataset's prompt_field / messages_field "
            "(e.g. --set data.prompt_field=question)"
        )
    answer_field = config.answer_field
    if answer_field == "answer":
        reference = _either(row, "answer", "reference")
    else:
        reference = _text(row, answer_field)
    sft_target, sft_messages = "", ()
    if config.sft_field:
        value = row.get(config.sft_field)
        if isinstance(value, list):  # a demonstration: the turns after the prompt
            sft_messages = _demonstration(value, config.sft_field)
        else:
            sft_target = _text(row, config.sft_field)
        if not (sft_target or sft_messages):
            raise DatasetError(
                f"has no {config.sft_field!r} (the dataset's sft_field: the SFT warm start's "
                f"target); the row's fields are: {', '.join(sorted(row)) or 'none'}"
            )
    mapped = {prompt_field, messages_field, answer_field, config.sft_field} - {""}
    used = {*mapped, config.id_field, *_KNOWN_FIELDS}
    used |= {"answer", "reference"} if answer_field == "answer" else set()
    return PromptRecord(
        dataset=dataset,
        id=_text(row, config.id_field) or f"{dataset}:{index}",
        prompt=prompt,
        messages=messages,
        reference=reference,
        problem=_problem_link(row, mapped),
        verifier=_text(row, "verifier") or config.verifier,
        reward_function=config.reward_function,
        metadata={k: v for k, v in row.items() if k not in used},
        system_prompt=config.system_prompt,
        apply_chat_template=config.apply_chat_template,
        template_kwargs=config.template_kwargs(),
        sft_target=sft_target,
        sft_messages=sft_messages,
    )


# The roles a demonstration's turns may have: the policy's, and what is given between them.
_DEMONSTRATION_ROLES = ("assistant", "tool", "user")


def _demonstration(value: list[Any], field: str) -> tuple[dict[str, Any], ...]:
    messages = _messages(value, field)
    roles = [m["role"] for m in messages]
    unknown = sorted(set(roles) - set(_DEMONSTRATION_ROLES))
    if unknown or not roles or roles[0] != "assistant" or roles[-1] != "assistant":
        raise DatasetError(
            f"{field!r} is a demonstration (a list of messages) and must run from an assistant "
            f"turn to an assistant turn with only {', '.join(_DEMONSTRATION_ROLES)} messages "
            f"between (the turns after the prompt), got roles {roles}"
        )
    return messages


def _problem_link(row: Mapping[str, Any], mapped: set[str]) -> str:
    """The code problem's link (`problem` or `tests`), unless the mapping reads that field
    as something else (MATH's `problem` is the prompt)."""
    unmapped = {k: v for k, v in row.items() if k in ("problem", "tests") and k not in mapped}
    return _either(unmapped, "problem", "tests")


def _messages(value: Any, field: str = "messages") -> tuple[dict[str, Any], ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise DatasetError(f"{field!r} must be a list of messages, got {value!r:.80}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise DatasetError(f"messages[{i}] must be an object, got {message!r:.80}")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DatasetError(f"messages[{i}] needs a text {key!r}, got {message!r:.80}")
        out.append(message)
    return tuple(out)


def _either(row: Mapping[str, Any], first: str, second: str) -> str:
    a, b = _text(row, first), _text(row, second)
    if a and b and a != b:
        raise DatasetError(f"has both {first!r} and {second!r}, and they differ; give one")
    return a or b


def _text(row: Mapping[str, Any], key: str) -> str:
    """Field `key` as text: strings as they are, numbers via str, lists and objects as JSON."""
    value = row.get(key)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value)
    raise DatasetError(f"field {key!r} has a value of type {type(value).__name__}: {value!r:.80}")
