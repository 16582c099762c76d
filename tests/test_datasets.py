"""Tests of the prompt mixture: loading JSONL/Parquet datasets and reproducible weighted draws."""

import collections
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu import storage
from rlax_tpu.config import DatasetConfig
from rlax_tpu.data.datasets import (
    DatasetError,
    PromptMixture,
    PromptRecord,
    dataset_name,
    load_dataset,
)

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _records(name: str, n: int) -> list[PromptRecord]:
    return [
        PromptRecord(dataset=name, id=f"{name}-{i}", prompt=f"q{i}", reference="1")
        for i in range(n)
    ]


def _mixture(sizes: list[int], weights: list[float], seed: int) -> PromptMixture:
    names = [f"d{i}" for i in range(len(sizes))]
    return PromptMixture.from_records(
        {n: _records(n, s) for n, s in zip(names, sizes, strict=True)},
        dict(zip(names, weights, strict=True)),
        seed,
    )


def _ids(records: list[PromptRecord]) -> list[str]:
    return [r.id for r in records]


mixtures = st.tuples(
    st.lists(st.integers(1, 7), min_size=1, max_size=4),
    st.integers(-(2**40), 2**40),
).flatmap(
    lambda t: st.tuples(
        st.just(t[0]),
        st.lists(st.floats(0.1, 10.0, allow_nan=False), min_size=len(t[0]), max_size=len(t[0])),
        st.just(t[1]),
    )
)


# -- loading ----------------------------------------------------------------------------------


def test_jsonl_rows_become_records_with_defaults_and_overrides(tmp_path):
    rows = [
        {"prompt": "What is 2 + 2?", "answer": 4},
        {"id": "chat-1", "messages": [{"role": "user", "content": "Hi"}], "reference": "x"},
        {"prompt": "Sort a list.", "tests": "gs://tests/sort", "verifier": "code"},
    ]
    path = tmp_path / "gsm8k.jsonl"  # a blank line is skipped: row indices stay dense
    path.write_text("\n".join([json.dumps(rows[0]), "", *map(json.dumps, rows[1:])]) + "\n")

    records = load_dataset(DatasetConfig(path=str(path), verifier="math"))

    assert records == [
        PromptRecord(dataset="gsm8k", id="gsm8k:0", prompt="What is 2 + 2?", reference="4"),
        PromptRecord(
            dataset="gsm8k",
            id="chat-1",
            messages=({"role": "user", "content": "Hi"},),
            reference="x",
        ),
        PromptRecord(
            dataset="gsm8k",
            id="gsm8k:2",
            prompt="Sort a list.",
            problem="gs://tests/sort",
            verifier="code",
        ),
    ]


def test_parquet_dataset_loads_through_file_url(tmp_path):
    table = pa.table(
        {
            "id": ["a", "b"],
            "prompt": ["What is 1 + 1?", None],
            "messages": [None, [{"role": "user", "content": "What is 3 * 3?"}]],
            "answer": [2, 9],
        }
    )
    pq.write_table(table, tmp_path / "arith.parquet")

    records = load_dataset(DatasetConfig(path=f"file://{tmp_path}/arith.parquet"))

    assert [(r.id, r.prompt, r.messages, r.reference) for r in records] == [
        ("a", "What is 1 + 1?", (), "2"),
        ("b", "", ({"role": "user", "content": "What is 3 * 3?"},), "9"),
    ]
    assert {r.dataset for r in records} == {"arith"}


def test_datasets_load_from_gcs(gcs_bucket, tmp_path):
    rows = [{"id": str(i), "prompt": f"p{i}", "answer": str(i)} for i in range(3)]
    storage.write_text(f"{gcs_bucket}/data/mix.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mix.parquet")
    storage.copy(str(tmp_path / "mix.parquet"), f"{gcs_bucket}/data/mix.parquet")

    from_jsonl = load_dataset(DatasetConfig(path=f"{gcs_bucket}/data/mix.jsonl"))
    from_parquet = load_dataset(DatasetConfig(path=f"{gcs_bucket}/data/mix.parquet"))

    assert [r.prompt for r in from_jsonl] == ["p0", "p1", "p2"]
    assert from_parquet == from_jsonl


def test_dataset_name_is_the_file_stem():
    assert dataset_name(DatasetConfig(path="gs://b/data/gsm8k.jsonl")) == "gsm8k"
    assert dataset_name(DatasetConfig(path="/d/code.v2.parquet")) == "code.v2"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "a", "answer": "1"}, {"answer": "2"}], "row 1 (line 2): has neither"),
        ([{"prompt": "a", "messages": [{"role": "user", "content": "b"}], "answer": "1"}], "both"),
        ([{"id": 7, "prompt": "a", "answer": 1}, {"id": "7", "prompt": "b", "answer": 2}], "'7'"),
        ([{"prompt": "a"}], "needs a reference answer"),
        ([{"prompt": "a", "verifier": "code"}], "needs a link to the problem's tests"),
        ([{"prompt": "a", "answer": "1", "verifier": "poetry"}], "verifier 'poetry' is unknown"),
        ([{"prompt": "a", "answer": "1", "reference": "2"}], "both 'answer' and 'reference'"),
        ([{"messages": [{"role": "user"}], "answer": "1"}], "messages[0] needs a text 'content'"),
        ([["not", "an", "object"]], "expected a JSON object"),
        ([{"prompt": 3, "answer": "1"}], "'prompt' must be text"),
    ],
)
def test_bad_rows_are_reported_with_file_and_row(tmp_path, rows, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match="bad.jsonl, row") as e:
        load_dataset(DatasetConfig(path=path))
    assert message in str(e.value)


def test_duplicate_id_names_both_rows(tmp_path):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "x", "prompt": "a", "answer": 1}, {"id": "x", "prompt": "b", "answer": 2}],
    )
    with pytest.raises(DatasetError, match=r"row 1 \(line 2\): id 'x' already names row 0"):
        load_dataset(DatasetConfig(path=path))


def test_invalid_json_line_is_reported(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"d.jsonl, row 1 \(line 2\): not valid JSON"):
        load_dataset(DatasetConfig(path=str(tmp_path / "d.jsonl")))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", "\n\n", "the dataset is empty"),
        ("data.csv", "prompt,answer\n", "unknown dataset format"),
        ("broken.parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_unusable_files_are_errors(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_dataset(DatasetConfig(path=str(tmp_path / name)))


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_dataset(DatasetConfig(path=str(tmp_path / "absent.jsonl")))


def test_record_json_round_trip():
    records = [
        PromptRecord(dataset="d", id="1", prompt="p", reference="r", verifier="arithmetic"),
        PromptRecord(
            dataset="d",
            id="2",
            messages=({"role": "system", "content": "s"}, {"role": "user", "content": "u"}),
            problem="gs://b/p",
            verifier="code",
        ),
        PromptRecord(dataset="d", id="3", prompt="p", reference="4", sft_target="xyz = 4"),
    ]
    for record in records:
        assert PromptRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert "sft_target" not in records[0].to_json()  # records without one: lines as before


def test_record_from_json_rejects_unknown_fields():
    with pytest.raises(DatasetError, match="unknown fields"):
        PromptRecord.from_json({"dataset": "d", "id": "1", "prompt": "p", "color": "red"})


# -- the mixture ------------------------------------------------------------------------------


def test_mixture_from_configs_draws_from_the_files(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "answer": i} for i in range(3)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "answer": i} for i in range(2)])
    mixture = PromptMixture([DatasetConfig(path=a), DatasetConfig(path=b, weight=3.0)], seed=0)

    drawn = mixture.draw(50)

    assert mixture.names == ["a", "b"]
    assert mixture.counters == collections.Counter(r.dataset for r in drawn)
    assert sum(mixture.counters.values()) == 50


def test_datasets_with_the_same_stem_are_refused(tmp_path):
    (tmp_path / "x").mkdir()
    a = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 1}])
    b = _write_jsonl(tmp_path / "x" / "d.jsonl", [{"prompt": "b", "answer": 1}])
    with pytest.raises(DatasetError, match="both go by the name 'd'"):
        PromptMixture([DatasetConfig(path=a), DatasetConfig(path=b)], seed=0)


@PROPERTY
@given(mixtures, st.integers(0, 40))
def test_same_seed_draws_the_same_sequence(mixture_args, count):
    first = _mixture(*mixture_args).draw(count)
    second = _mixture(*mixture_args).draw(count)
    assert _ids(first) == _ids(second)


def test_different_seeds_draw_different_sequences():
    assert _ids(_mixture([50, 50], [1, 1], 1).draw(30)) != _ids(
        _mixture([50, 50], [1, 1], 2).draw(30)
    )


@PROPERTY
@given(mixtures, st.integers(0, 30), st.integers(0, 30))
def test_restore_continues_the_uninterrupted_sequence(mixture_args, before, after):
    uninterrupted = _mixture(*mixture_args).draw(before + after)

    interrupted = _mixture(*mixture_args)
    head = interrupted.draw(before)
    state = json.loads(json.dumps(interrupted.state()))  # as a snapshot stores it
    interrupted.draw(5)  # drawn after the snapshot and lost with the preempted process
    resumed = _mixture(*mixture_args)
    resumed.restore(state)

    assert _ids(head + resumed.draw(after)) == _ids(uninterrupted)
    drawn = collections.Counter(r.dataset for r in uninterrupted)
    assert resumed.counters == {name: drawn[name] for name in resumed.names}


@PROPERTY
@given(st.integers(1, 20), st.integers(1, 4), st.integers(0, 2**32))
def test_each_epoch_visits_every_prompt_once(size, epochs, seed):
    mixture = _mixture([size], [1.0], seed)
    drawn = _ids(mixture.draw(size * epochs))
    epoch_orders = [drawn[e * size : (e + 1) * size] for e in range(epochs)]
    for order in epoch_orders:
        assert sorted(order) == sorted(f"d0-{i}" for i in range(size))
    if size >= 8 and epochs >= 2:  # a fresh shuffle per epoch (8! orders: a repeat is unlikely)
        assert epoch_orders[0] != epoch_orders[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_are_respected_in_the_long_run(seed):
    weights = [1.0, 2.0, 5.0, 0.5]
    n = 8000
    mixture = _mixture([3, 5, 7, 2], weights, seed)
    mixture.draw(n)
    observed = np.array([mixture.counters[name] for name in mixture.names])
    expected = n * np.array(weights) / sum(weights)
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 27.0  # p < 1e-5 for 3 degrees of freedom


def test_restore_refuses_state_of_other_datasets():
    state = _mixture([2, 3], [1, 1], 0).state()
    other = _mixture([2], [1], 0)
    with pytest.raises(DatasetError, match=r"it names \['d1'\], which this mixture lacks"):
        other.restore(state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("rng"), "lacks \\['rng'\\]"),
        (lambda s: s.update(rng={"bit_generator": "MT19937"}), "bad RNG state"),
        (lambda s: s["counters"].update(d0=-1), "counter of 'd0' must be an int >= 0"),
        (lambda s: s["counters"].update(d0="3"), "counter of 'd0' must be an int >= 0"),
        (lambda s: s.update(counters=[1, 2]), "counters must be a dict"),
        (lambda s: s.update(format=99), "format 99"),
        (lambda s: s["sizes"].update(d1=4), "d1: 4 then, 3 now"),
    ],
)
def test_restore_refuses_malformed_state_and_changes_nothing(change, message):
    mixture = _mixture([2, 3], [1, 1], 0)
    mixture.draw(4)
    before = mixture.state()
    state = json.loads(json.dumps(before))
    change(state)
    with pytest.raises(DatasetError, match=message):
        mixture.restore(state)
    assert mixture.state() == before


def test_draw_refuses_negative_count():
    with pytest.raises(ValueError, match="count must be >= 0"):
        _mixture([1], [1], 0).draw(-1)
