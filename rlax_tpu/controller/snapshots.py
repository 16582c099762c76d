"""Controller snapshots and the rollout log: what a resumed run needs to continue exactly.

A snapshot is written atomically at every weight-reload boundary (every η steps). It names
the trainer checkpoint the run resumes from and everything the controller's deterministic
choices depend on at that step: the prompt-mixture RNG and counters, the accounting.
The rollout log keeps every finished rollout, keyed by (batch, prompt id, sample index,
version), one object each, so a resumed run reuses what was generated before the stop; and
each rollout's final verdict (its reward, or that it stayed unjudged, and the response text
judged), so a resumed run trains on exactly the rewards the uninterrupted one did, faults of
the verifier included; and, once per prompt, the dataset record it was drawn from, so that
people can read a batch (`rlax-tpu samples`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from rlax_tpu import storage
from rlax_tpu.api.records import Judgement, RolloutKey, RolloutRecord
from rlax_tpu.data.datasets import PromptRecord
from rlax_tpu.run_dir import ROLLOUTS, SNAPSHOTS

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

CONSUMED_DIR = "consumed"
ROLLOUTS_PREFIX = "rollouts-"
VERDICTS_PREFIX = "verdicts-"
PROMPTS_PREFIX = "prompts-"
PARTIALS_PREFIX = "partials-"
FORMAT = 1


class SnapshotError(RuntimeError):
    """No usable snapshot (truncated, of another config, or its checkpoint is gone)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The controller's state at a reload boundary.

    step: batches [0, step) are trained. checkpoint_step: the trainer checkpoint to resume
    from (<= step); batches [checkpoint_step, step) are retrained from the rollout log.
    mixture: the prompt mixture's state before drawing batch `checkpoint_step`.
    stats: the run's accounting as of `checkpoint_step` (rejected rollouts, ...).
    versions: the model version each component held when the snapshot was written.
    """

    step: int
    checkpoint_step: int
    config_digest: str
    mixture: dict[str, Any]
    stats: dict[str, int]
    versions: dict[str, int]

    def to_json(self) -> str:
        body = {"format": FORMAT, **dataclasses.asdict(self)}
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body})

    @classmethod
    def from_json(cls, text: str, where: str) -> Snapshot:
        """Parse and verify a snapshot; SnapshotError says what is wrong with it."""
        try:
            outer = json.loads(text)
            body = outer["body"]
            digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        except (ValueError, KeyError, TypeError) as e:
            raise SnapshotError(f"snapshot {where} is truncated or not JSON ({e})") from None
        if outer.get("sha256") != digest:
            raise SnapshotError(f"snapshot {where} fails its checksum (truncated or edited)")
        if body.get("format") != FORMAT:
            raise SnapshotError(f"snapshot {where} has format {body.get('format')}, not {FORMAT}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in fields})


def snapshot_name(step: int) -> str:
    return f"snapshot_{step:09d}.json"


class SnapshotStore:
    """The snapshots of one run directory (local or gs://); each object is written whole."""

    def __init__(self, run_dir: str, keep: int) -> None:
        self.directory = storage.join(run_dir, SNAPSHOTS)
        self.keep = keep

    def steps(self) -> list[int]:
        if not storage.exists(self.directory):
            return []
        steps = []
        for name in storage.listdir(self.directory):
            if name.startswith("snapshot_") and name.endswith(".json"):
                try:
                    steps.append(int(name[len("snapshot_") : -len(".json")]))
                except ValueError:
                    continue
        return sorted(steps)

    def write(self, snapshot: Snapshot) -> None:
        storage.write_text(
            storage.join(self.directory, snapshot_name(snapshot.step)), snapshot.to_json()
        )
        for old in self.steps()[: -self.keep]:
            storage.remove(storage.join(self.directory, snapshot_name(old)))

    def read(self, step: int) -> Snapshot:
        url = storage.join(self.directory, snapshot_name(step))
        return Snapshot.from_json(storage.read_text(url), url)

    def candidates(self, config_digest: str) -> Iterator[Snapshot]:
        """Valid snapshots of this config, newest first. A snapshot of another config is an
        error (never a silently divergent run); a corrupt one is skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                snapshot = self.read(step)
            except SnapshotError as e:
                _log.warning("%s; trying the previous snapshot", e)
                continue
            if snapshot.config_digest != config_digest:
                raise SnapshotError(
                    f"snapshot of step {step} in {self.directory} was written by a run with "
                    f"config digest {snapshot.config_digest[:12]}…, this config's is "
                    f"{config_digest[:12]}…; resume with the run's own config (config.json "
                    "in the run directory) or start a new run directory"
                )
            yield snapshot


# -- the rollout log -----------------------------------------------------------------------------
def rollout_key(batch: int, prompt_id: str, sample_index: int, version: int) -> str:
    """A file-name-safe key of one rollout."""
    safe = hashlib.sha256(prompt_id.encode()).hexdigest()[:16]
    return f"p{safe}-s{sample_index}-v{version}"


class RolloutLog:
    """Every finished rollout of the run, as JSON lines under rollouts/batch_<b>/: one file
    per write (a worker job's rollouts, written as the job finishes); their final verdicts
    (verdicts-*.jsonl, written once each scoring round's retries are over); the dataset
    records of the batch's prompts (prompts-*.jsonl, for people: nothing reads them back
    to train); and per batch, what the trainer consumed.

    Writes go to storage in the background, in order, each atomic as before: a local
    file's fsyncs or an object store's upload are off the loop's path (a job's rollouts
    are in the batch the moment they arrive). What a snapshot relies on must be on storage
    before it: `flush()` waits for every write so far (the controller's Recovery calls it
    before each snapshot), and raises the first that failed; a read of a batch waits for
    that batch's writes. A write that failed also raises at the next append."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.directory = storage.join(run_dir, ROLLOUTS)
        self._lock = threading.Lock()
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[tuple[int | None, concurrent.futures.Future]] = []

    # -- writes in the background, in order -------------------------------------------------------
    def _put(self, batch: int | None, url: str, text: str) -> None:
        """Write `text` to `url` after every earlier write (`batch`: whose files it is; None
        for the consumed records)."""
        self._in_order(batch, storage.write_text, url, text)

    def _in_order(self, batch: int | None, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the writer thread after every earlier write."""
        self._raise_failed()
        with self._lock:
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(1, "rollout-log")
            self._pending.append((batch, self._writer.submit(fn, *args)))

    def _raise_failed(self) -> None:
        """Forget the writes that are done; raise the first that failed."""
        with self._lock:
            done = [f for _, f in self._pending if f.done()]
            self._pending = [(b, f) for b, f in self._pending if not f.done()]
        for future in done:
            future.result()

    def _settle(self, batch: int | None = None) -> None:
        """Until the writes so far (of `batch` only, if given) are on storage; the first that
        failed raises."""
        with self._lock:
            waiting = [f for b, f in self._pending if batch is None or b == batch]
        concurrent.futures.wait(waiting)
        self._raise_failed()

    def flush(self) -> None:
        """Until every write so far is on storage (before a snapshot relies on them); raises
        the first that failed."""
        self._settle()

    def close(self) -> None:
        """Finish the writes (a failure is logged: no snapshot relies on a write after the
        last `flush`) and stop the writer thread."""
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 - the loop's own error, if any, is the one to see
            _log.warning("a rollout log write failed after the last snapshot: %s", e)
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def _batch_dir(self, batch: int) -> str:
        return storage.join(self.directory, f"batch_{batch:09d}")

    def append(self, batch: int, rollouts: Sequence[RolloutRecord]) -> None:
        """Persist rollouts in one atomic write. The file is named by the rollouts' keys, so
        writing the same rollouts again replaces the file instead of duplicating them."""
        self._write(batch, ROLLOUTS_PREFIX, rollouts, lambda r: r.to_json())

    def _write(
        self,
        batch: int,
        prefix: str,
        items: Sequence[Any],
        to_json: Callable[[Any], dict[str, Any]],
        salt: Sequence[int] | None = None,
    ) -> None:
        """Write to_json(item) of each of `items` (immutable: made into lines and written on
        the writer thread, off the loop's path) as one file of `batch`'s. `salt`: per item, a
        number that tells its writes apart (a partial's length)."""
        if items:
            self._in_order(batch, self._write_now, batch, prefix, list(items), to_json, salt)

    def _write_now(
        self,
        batch: int,
        prefix: str,
        items: Sequence[Any],
        to_json: Callable[[Any], dict[str, Any]],
        salt: Sequence[int] | None,
    ) -> None:
        records = [to_json(item) for item in items]
        keys = sorted(
            rollout_key(batch, r["prompt_id"], r["sample_index"], r["version"])
            + ("" if salt is None else f"-n{salt[k]}")
            for k, r in enumerate(records)
        )
        name = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:24]
        lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        storage.write_text(storage.join(self._batch_dir(batch), f"{prefix}{name}.jsonl"), lines)

    def read_batch(self, batch: int) -> dict[tuple[str, int, int], dict[str, Any]]:
        """The logged rollout lines of `batch`, as written, by (prompt_id, sample_index,
        version): for people (`rlax-tpu samples`); the loop reads `rollouts`."""
        return self._read(batch, ROLLOUTS_PREFIX, "regenerating")

    def rollouts(self, batch: int) -> dict[RolloutKey, RolloutRecord]:
        """The logged rollouts of `batch` by key; a line that does not parse is ignored
        (with a warning), and its rollout will be regenerated."""
        return self._typed(batch, self.read_batch(batch), RolloutRecord.from_json, "regenerating")

    def append_verdicts(self, batch: int, verdicts: Sequence[tuple[RolloutKey, Judgement]]) -> None:
        """Persist final verdicts (the rollout's key, its judgement) of `batch`'s rollouts,
        in one atomic write."""
        self._write(batch, VERDICTS_PREFIX, verdicts, lambda kj: kj[1].to_json(kj[0]))

    def read_verdicts(self, batch: int) -> dict[tuple[str, int, int], dict[str, Any]]:
        """The logged verdict lines of `batch`, as written, by (prompt_id, sample_index,
        version) (reward — None when unjudged —, verdict, reason, response); the loop reads
        `judgements`."""
        return self._read(batch, VERDICTS_PREFIX, "judging again")

    def judgements(self, batch: int) -> dict[RolloutKey, Judgement]:
        """The logged verdicts of `batch` by rollout key; one that does not parse is ignored
        (with a warning): its rollout is judged again."""
        return self._typed(batch, self.read_verdicts(batch), Judgement.from_json, "judging again")

    @staticmethod
    def _typed(
        batch: int,
        lines: Mapping[tuple[str, int, int], Mapping[str, Any]],
        parse: Callable[[Mapping[str, Any]], _T],
        then: str,
    ) -> dict[RolloutKey, _T]:
        out = {}
        for key, line in lines.items():
            try:
                out[RolloutKey(*key)] = parse(line)
            except (KeyError, TypeError, ValueError):
                _log.warning("rollout log entry %s of batch %d is unreadable; %s", key, batch, then)
        return out

    def append_prompts(self, batch: int, records: Mapping[str, PromptRecord]) -> None:
        """Persist the dataset records of `batch`'s prompts, by prompt id, in one atomic
        write named by the ids (writing the same prompts again replaces it)."""
        if not records:
            return
        ids = sorted(records)
        name = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:24]
        lines = "".join(
            json.dumps({"prompt_id": i, "record": records[i].to_json()}, sort_keys=True) + "\n"
            for i in ids
        )
        url = storage.join(self._batch_dir(batch), f"{PROMPTS_PREFIX}{name}.jsonl")
        self._put(batch, url, lines)

    def read_prompts(self, batch: int) -> dict[str, dict[str, Any]]:
        """The logged dataset records of `batch`'s prompts by prompt id ({} for batches
        logged before prompts were); an unreadable line is skipped."""
        self._settle(batch)
        directory = self._batch_dir(batch)
        if not storage.exists(directory):
            return {}
        out = {}
        for name in sorted(storage.listdir(directory)):
            if not (name.startswith(PROMPTS_PREFIX) and name.endswith(".jsonl")):
                continue
            for line in storage.read_text(storage.join(directory, name)).splitlines():
                try:
                    entry = json.loads(line)
                    out[str(entry["prompt_id"])] = dict(entry["record"])
                except (ValueError, KeyError, TypeError):
                    continue
        return out

    def batches(self) -> list[int]:
        """The batches the log holds anything of, in order."""
        self._settle()
        if not storage.exists(self.directory):
            return []
        out = []
        for name in storage.listdir(self.directory):
            name = name.rstrip("/")
            if name.startswith("batch_"):
                try:
                    out.append(int(name[len("batch_") :]))
                except ValueError:
                    continue
        return sorted(out)

    def has_verdicts(self, batch: int) -> bool:
        """Whether any verdict of `batch` is logged (its judging finished a round)."""
        self._settle(batch)
        directory = self._batch_dir(batch)
        return storage.exists(directory) and any(
            name.startswith(VERDICTS_PREFIX) for name in storage.listdir(directory)
        )

    def append_partials(self, batch: int, rollouts: Sequence[RolloutRecord]) -> None:
        """Persist rollouts paused at a tick's token budget (mixed-version rollouts, finish
        reason "paused"), in one atomic write; a resumed run carries each on from its
        longest logged partial instead of generating it again."""
        salt = [len(r.tokens) for r in rollouts]
        self._write(batch, PARTIALS_PREFIX, rollouts, lambda r: r.to_json(), salt=salt)

    def partials(self, batch: int) -> dict[RolloutKey, RolloutRecord]:
        """The longest logged partial of each of `batch`'s unfinished rollouts, by key."""
        lines = self._read(batch, PARTIALS_PREFIX, "carrying on from an earlier one", longest=True)
        return self._typed(batch, lines, RolloutRecord.from_json, "carrying on from before")

    def _read(
        self, batch: int, prefix: str, then: str, *, longest: bool = False
    ) -> dict[tuple[str, int, int], dict]:
        """The lines of `batch`'s files named `prefix`*, by key; the last read wins, or with
        `longest` the one with the most tokens."""
        self._settle(batch)
        directory = self._batch_dir(batch)
        if not storage.exists(directory):
            return {}
        out = {}
        for name in storage.listdir(directory):
            if not (name.startswith(prefix) and name.endswith(".jsonl")):
                continue
            text = storage.read_text(storage.join(directory, name))
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                    key = (record["prompt_id"], int(record["sample_index"]), int(record["version"]))
                except (ValueError, KeyError, TypeError):
                    _log.warning(
                        "rollout log entry in %s/%s is unreadable; %s", directory, name, then
                    )
                    continue
                if longest and key in out and len(out[key]["tokens"]) >= len(record["tokens"]):
                    continue
                out[key] = record
        return out

    def record_consumed(self, batch: int, keys: list[tuple[str, int, int]]) -> None:
        """What train step `batch` consumed (prompt id, sample index, version per row)."""
        self._put(
            None,
            storage.join(self.run_dir, CONSUMED_DIR, f"batch_{batch:09d}.json"),
            json.dumps([list(k) for k in keys]),
        )

    def consumed(self) -> dict[int, list[tuple[str, int, int]]]:
        self._settle()
        directory = storage.join(self.run_dir, CONSUMED_DIR)
        if not storage.exists(directory):
            return {}
        out = {}
        for name in sorted(storage.listdir(directory)):
            batch = int(name[len("batch_") : -len(".json")])
            rows = json.loads(storage.read_text(storage.join(directory, name)))
            out[batch] = [(p, int(s), int(v)) for p, s, v in rows]
        return out
