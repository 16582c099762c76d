"""The loop's typed records (rlax_tpu/api/records.py) and their on-disk form: the rollout
log's lines are byte for byte what they were when rollouts travelled as dicts, so the logs
of earlier runs still load, and a resumed run writes what the first one did."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from rlax_tpu.api.inference import Rollout
from rlax_tpu.api.records import Group, Judgement, RolloutKey, RolloutRecord, ScoredRollout
from rlax_tpu.controller.generation import rollout_record
from rlax_tpu.controller.replay import ReplayStage
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.data.datasets import PromptRecord

# Lines as the dict-based controller wrote them (rollout_record + json.dumps(sort_keys=True)).
OLD_ROLLOUT_LINE = (
    '{"batch": 3, "finish_reason": "stop", "logprobs": [-0.25, -1.5, -0.0], "prompt_id": '
    '"b3:gsm8k:17", "prompt_tokens": [101, 7, 8], "sample_index": 2, "tokens": [9, 10, 2], '
    '"version": 2}\n'
)
OLD_VERDICT_LINE = (
    '{"prompt_id": "b3:gsm8k:17", "reason": "ok", "response": "42", "reward": 1.0, '
    '"sample_index": 2, "verdict": "correct", "version": 2}\n'
)
OLD_DENSE_VERDICT_LINE = (
    '{"prompt_id": "b3:gsm8k:17", "reason": "", "response": "", "reward": 0.5, '
    '"sample_index": 2, "token_rewards": [0.1, 0.3333333333333333, 0.0], "verdict": "accepted", '
    '"version": 2}\n'
)

RECORD = RolloutRecord(
    batch=3,
    prompt_id="b3:gsm8k:17",
    sample_index=2,
    version=2,
    prompt_tokens=(101, 7, 8),
    tokens=(9, 10, 2),
    logprobs=(-0.25, -1.5, -0.0),
    finish_reason="stop",
)


def _only_file(directory, prefix):
    (path,) = [p for p in directory.iterdir() if p.name.startswith(prefix)]
    return path.read_text()


def test_a_worker_rollout_becomes_the_record_the_log_always_held():
    rollout = Rollout(
        request_id="b3:gsm8k:17/s2/v2",
        prompt_id="b3:gsm8k:17",
        sample_index=2,
        version=2,
        prompt_tokens=(101, 7, 8),
        tokens=(9, 10, 2),
        logprobs=(-0.25, -1.5, -0.0),
        finish_reason="stop",
    )
    assert rollout_record(3, rollout) == RECORD
    assert json.dumps(RECORD.to_json(), sort_keys=True) + "\n" == OLD_ROLLOUT_LINE


def test_the_rollout_log_writes_the_old_lines_byte_for_byte(tmp_path):
    log = RolloutLog(str(tmp_path))
    log.append(3, [RECORD])
    dense = Judgement(0.5, "accepted", token_rewards=(0.1, 1 / 3, 0.0))
    log.append_verdicts(3, [(RECORD.key, Judgement(1.0, "correct", "ok", response="42"))])
    log.flush()
    batch_dir = tmp_path / "rollouts" / "batch_000000003"
    assert _only_file(batch_dir, "rollouts-") == OLD_ROLLOUT_LINE
    assert _only_file(batch_dir, "verdicts-") == OLD_VERDICT_LINE
    assert json.dumps(dense.to_json(RECORD.key), sort_keys=True) + "\n" == OLD_DENSE_VERDICT_LINE


def test_a_log_written_in_the_old_format_loads_as_records(tmp_path):
    batch_dir = tmp_path / "rollouts" / "batch_000000003"
    batch_dir.mkdir(parents=True)
    (batch_dir / "rollouts-old.jsonl").write_text(OLD_ROLLOUT_LINE)
    (batch_dir / "verdicts-old.jsonl").write_text(OLD_VERDICT_LINE)
    (batch_dir / "verdicts-dense.jsonl").write_text(
        OLD_DENSE_VERDICT_LINE.replace('"sample_index": 2', '"sample_index": 3')
    )
    log = RolloutLog(str(tmp_path))
    assert log.rollouts(3) == {RolloutKey("b3:gsm8k:17", 2, 2): RECORD}
    judgements = log.judgements(3)
    assert judgements[RECORD.key] == Judgement(1.0, "correct", "ok")
    assert judgements[RECORD.key].response == "42"
    assert judgements[RolloutKey("b3:gsm8k:17", 3, 2)].token_rewards == (0.1, 1 / 3, 0.0)
    # Read back and written again: the same bytes (what a resumed run logs).
    again = RolloutLog(str(tmp_path / "again"))
    again.append(3, list(log.rollouts(3).values()))
    again.flush()
    assert _only_file(tmp_path / "again" / "rollouts" / "batch_000000003", "rollouts-") == (
        OLD_ROLLOUT_LINE
    )


def test_an_incomplete_logged_rollout_is_skipped_to_be_generated_again(tmp_path, caplog):
    batch_dir = tmp_path / "rollouts" / "batch_000000000"
    batch_dir.mkdir(parents=True)
    torn = json.loads(OLD_ROLLOUT_LINE)
    del torn["tokens"]
    (batch_dir / "rollouts-torn.jsonl").write_text(json.dumps(torn) + "\n")
    log = RolloutLog(str(tmp_path))
    assert log.rollouts(0) == {}
    assert "unreadable; regenerating" in caplog.text
    assert len(log.read_batch(0)) == 1  # `rlax-tpu samples` still shows the line as written


def test_records_round_trip_through_json_and_a_none_field_stays_off_disk():
    assert RolloutRecord.from_json(json.loads(json.dumps(RECORD.to_json()))) == RECORD

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithTokenVersions(RolloutRecord):  # how a later per-token field is added
        token_versions: tuple[int, ...] | None = None

    plain = WithTokenVersions(
        **{f.name: getattr(RECORD, f.name) for f in dataclasses.fields(RECORD)}
    )
    assert plain.to_json() == RECORD.to_json()  # old lines stay what they were
    assert WithTokenVersions.from_json(RECORD.to_json()) == plain  # and old lines load
    versioned = dataclasses.replace(plain, token_versions=[2, 2, 3])
    assert versioned.token_versions == (2, 2, 3)
    assert versioned.to_json()["token_versions"] == [2, 2, 3]
    assert WithTokenVersions.from_json(versioned.to_json()) == versioned


def test_a_group_holds_only_judged_samples():
    judged = ScoredRollout.of(RECORD, Judgement(1.0, "correct", token_rewards=(0.0, 0.0, 1.0)))
    assert (judged.reward, judged.token_rewards) == (1.0, (0.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="unjudged"):
        ScoredRollout.of(RECORD, Judgement(None, "verifier_error", "sandbox down"))
    group = Group("b3:gsm8k:17", [judged, ScoredRollout(RECORD, 0.0)], baseline=0.5)
    assert group.samples[1].reward == 0.0 and group.baseline == 0.5


def test_the_prompts_of_a_batch_are_logged_as_before(tmp_path):
    record = PromptRecord(dataset="gsm8k", id="17", prompt="What is 6*7?", reference="42")
    log = RolloutLog(str(tmp_path))
    log.append_prompts(3, {"b3:gsm8k:17": record})
    log.flush()
    assert _only_file(tmp_path / "rollouts" / "batch_000000003", "prompts-") == (
        '{"prompt_id": "b3:gsm8k:17", "record": {"dataset": "gsm8k", "id": "17", "problem": "", '
        '"prompt": "What is 6*7?", "reference": "42", "verifier": "math"}}\n'
    )


def test_a_resumed_replay_stage_samples_the_same_groups_reading_the_rollout_log(tmp_path):
    """The replay stage keeps its rollouts in memory; after a resume (its state from the
    snapshot, nothing in memory) it reads them back from the rollout log, and samples the
    same groups, rows and values."""
    replay = types.SimpleNamespace(
        per_prompt_cap=4, global_cap=16, recency_prob=0.5, reward_temperature=1.0, sync_every=1
    )
    controller = types.SimpleNamespace(
        replay=replay,
        prompts_per_batch=2,
        samples_per_prompt=2,
    )
    config = types.SimpleNamespace(controller=controller, seed=5)
    log = RolloutLog(str(tmp_path))

    def stage() -> ReplayStage:
        return ReplayStage(config, log=log, max_staleness=2)

    groups = []
    for p in range(3):
        samples = []
        for i in range(2):
            record = dataclasses.replace(
                RECORD, batch=0, prompt_id=f"b0:d:{p}", sample_index=i, tokens=(p, i, 2)
            )
            dense = None if p else (0.5, 0.25, 0.0)
            samples.append(ScoredRollout(record, float(p + i) / 2, dense))
        log.append(0, [s.rollout for s in samples])
        groups.append(Group(f"d:{p}", tuple(samples)))
    first = stage()
    first.prefill(first.entries(0, groups))
    state = json.loads(json.dumps(first.state()))  # as a snapshot holds it
    resumed = stage()
    resumed.restore(state)
    assert resumed.groups(1, []) == first.groups(1, [])
