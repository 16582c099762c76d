"""The test-data repository: upload once, fetch once into a cache, on a local path, file:// and
gs:// (emulator); half-finished uploads stay invisible and damaged files are caught."""

import json
import os
import threading
from pathlib import Path

import pytest

from rlax_tpu import storage
from rlax_tpu.verifiers import repository as repo_module
from rlax_tpu.verifiers.problems import ProblemFormatError, load_problem, write_problem
from rlax_tpu.verifiers.repository import (
    ProblemConflictError,
    ProblemLinkError,
    ProblemNotFoundError,
    ProblemResolver,
    TestDataCorruptError,
    TestDataRepository,
)


def make_problem(directory: Path, *, answer: str = "3", executable: bool = False) -> Path:
    """A small problem directory: problem.json and two tests (five files with `executable`)."""
    write_problem(
        directory, name=directory.name, tests=[("1 2\n", answer + "\n"), ("x" * 3000, "x\n")]
    )
    if executable:
        tool = directory / "tool.sh"
        tool.write_text("#!/bin/sh\necho hi\n")
        tool.chmod(0o755)
    return directory


def tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(params=["path", "file", "gs"])
def root(request, tmp_path):
    if request.param == "gs":
        return request.getfixturevalue("gcs_bucket") + "/testdata"
    if request.param == "file":
        return f"file://{tmp_path}/repo"
    return str(tmp_path / "repo")


@pytest.fixture
def copies(monkeypatch):
    """Every storage.copy call the repository makes, as (src, dst)."""
    calls = []
    real = storage.copy

    def counting(src, dst):
        calls.append((src, dst))
        real(src, dst)

    monkeypatch.setattr(repo_module.storage, "copy", counting)
    return calls


def test_upload_then_fetch_gives_the_same_files(root, tmp_path):
    problem = make_problem(tmp_path / "p", executable=True)
    repo = TestDataRepository(root, tmp_path / "cache")
    link = repo.upload(problem, "sum-1")
    assert link == f"{root}/problems/sum-1" == repo.link("sum-1")
    fetched = repo.fetch(link)
    assert fetched.parent == tmp_path / "cache"
    assert tree(fetched) == tree(problem)
    assert os.access(fetched / "tool.sh", os.X_OK)
    assert not os.access(fetched / "problem.json", os.X_OK)


def test_relative_local_root_gives_absolute_links(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    repo = TestDataRepository("repo", tmp_path / "cache")
    assert repo.link("a") == f"{tmp_path}/repo/problems/a"


def test_reupload_of_identical_content_writes_nothing(root, tmp_path, copies):
    problem = make_problem(tmp_path / "p")
    repo = TestDataRepository(root, tmp_path / "cache")
    link = repo.upload(problem, "p1")
    uploaded = len(copies)
    assert uploaded == 5  # problem.json and two tests
    assert repo.upload(problem, "p1") == link
    assert len(copies) == uploaded


def test_different_content_under_a_used_id_is_refused(tmp_path):
    repo = TestDataRepository(str(tmp_path / "repo"), tmp_path / "cache")
    repo.upload(make_problem(tmp_path / "a", answer="3"), "p1")
    with pytest.raises(ProblemConflictError, match=r"tests/01.ans.*new problem id"):
        repo.upload(make_problem(tmp_path / "b", answer="4"), "p1")
    assert (repo.fetch(repo.link("p1")) / "tests" / "01.ans").read_text() == "3\n"


def test_half_finished_upload_is_invisible_and_can_be_redone(root, tmp_path, monkeypatch):
    problem = make_problem(tmp_path / "p")
    repo = TestDataRepository(root, tmp_path / "cache")
    real, done = storage.copy, []

    def dies_after_two_files(src, dst):
        if len(done) == 2:
            raise ConnectionError("uploader preempted")
        real(src, dst)
        done.append(dst)

    monkeypatch.setattr(repo_module.storage, "copy", dies_after_two_files)
    with pytest.raises(ConnectionError):
        repo.upload(problem, "p1")
    monkeypatch.setattr(repo_module.storage, "copy", real)
    assert len(done) == 2 and storage.exists(done[0])  # files are there, but no manifest yet
    with pytest.raises(ProblemNotFoundError, match="upload has not finished"):
        repo.fetch(repo.link("p1"))
    link = repo.upload(problem, "p1")
    assert tree(repo.fetch(link)) == tree(problem)


def test_a_damaged_file_is_detected_and_nothing_is_cached(root, tmp_path):
    repo = TestDataRepository(root, tmp_path / "cache")
    link = repo.upload(make_problem(tmp_path / "p"), "p1")
    storage.write_text(storage.join(link, "files", "tests", "01.ans"), "4\n")
    with pytest.raises(TestDataCorruptError, match=r"tests/01.ans has sha256"):
        repo.fetch(link)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".locks"]


def test_a_cached_problem_is_not_downloaded_again(root, tmp_path, copies):
    repo = TestDataRepository(root, tmp_path / "cache")
    link = repo.upload(make_problem(tmp_path / "p"), "p1")
    first = repo.fetch(link)
    downloads = len(copies)
    storage.remove(link, recursive=True)  # the repository is gone: only the cache can answer
    again = TestDataRepository(root, tmp_path / "cache")  # a new process on the same host
    assert again.fetch(link) == first
    assert len(copies) == downloads


def test_concurrent_fetches_of_one_link_download_once(tmp_path, copies):
    root = str(tmp_path / "repo")
    link = TestDataRepository(root, tmp_path / "cache").upload(make_problem(tmp_path / "p"), "p1")
    copies.clear()
    assert len(list((tmp_path / "p").rglob("*.*"))) == 5
    # Separate instances stand in for separate processes: only the file lock is shared.
    repos = [TestDataRepository(root, tmp_path / "cache") for _ in range(3)]
    barrier, results = threading.Barrier(9), []

    def fetch(repo):
        barrier.wait()
        results.append(repo.fetch(link))

    threads = [threading.Thread(target=fetch, args=(repos[i % 3],)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 9 and len(set(results)) == 1
    assert len(copies) == 5  # each file once


def test_links_outside_the_repository_are_refused(tmp_path):
    repo = TestDataRepository(str(tmp_path / "repo"), tmp_path / "cache")
    other = TestDataRepository(str(tmp_path / "other"), tmp_path / "cache")
    other_link = other.upload(make_problem(tmp_path / "p"), "p1")
    with pytest.raises(ProblemLinkError, match="outside the test-data repository"):
        repo.fetch(other_link)
    for bad in (str(tmp_path / "repo" / "p1"), f"{tmp_path}/repo/problems/../x", ""):
        with pytest.raises(ProblemLinkError):
            repo.fetch(bad)
    with pytest.raises(ProblemLinkError, match="problem id"):
        repo.upload(tmp_path / "p", "a/b")


def test_file_url_and_path_spellings_of_a_link_are_the_same_problem(tmp_path):
    repo = TestDataRepository(str(tmp_path / "repo"), tmp_path / "cache")
    link = repo.upload(make_problem(tmp_path / "p"), "p1")
    assert repo.fetch(f"file://{link}") == repo.fetch(link)


def test_a_problem_never_uploaded_is_a_clear_error(root, tmp_path):
    repo = TestDataRepository(root, tmp_path / "cache")
    with pytest.raises(ProblemNotFoundError, match="never uploaded"):
        repo.fetch(repo.link("nope"))


def test_a_manifest_naming_paths_outside_the_problem_is_refused(tmp_path):
    repo = TestDataRepository(str(tmp_path / "repo"), tmp_path / "cache")
    link = repo.link("evil")
    manifest = {"format": 1, "files": {"../../x": {"sha256": "0" * 64, "size": 1}}}
    storage.write_text(storage.join(link, "manifest.json"), json.dumps(manifest))
    with pytest.raises(TestDataCorruptError, match="unsafe file path"):
        repo.fetch(link)
    assert not (tmp_path / "x").exists()


def test_resolver_fetches_from_any_repository_unless_limited_to_roots(tmp_path):
    a = TestDataRepository(str(tmp_path / "a"), tmp_path / "upload-cache")
    b = TestDataRepository(str(tmp_path / "b"), tmp_path / "upload-cache")
    link_a = a.upload(make_problem(tmp_path / "p"), "p1")
    link_b = b.upload(tmp_path / "p", "p1")
    anywhere = ProblemResolver(tmp_path / "cache")
    assert Path(anywhere(link_a)) != Path(anywhere(link_b))
    assert tree(Path(anywhere(link_b))) == tree(tmp_path / "p")
    limited = ProblemResolver(tmp_path / "cache", roots=[str(tmp_path / "a")])
    assert Path(limited(link_a)).is_dir()
    with pytest.raises(ProblemLinkError, match="outside the test-data repositories"):
        limited(link_b)
    with pytest.raises(ProblemLinkError, match="not a test-data link"):
        anywhere(str(tmp_path / "p"))


CHECKER = r"""
#include <fstream>
int main(int argc, char** argv) {
  std::ifstream out(argv[2]);
  long long x; if (!(out >> x)) return 1;
  return x % 2 == 0 ? 0 : 1;  // any even number is a right answer
}
"""


def test_upload_compiles_the_checker_once_and_ships_the_binary(tmp_path, copies):
    problem = write_problem(
        tmp_path / "even",
        name="even",
        tests=[("", "2\n")],
        checker_source=CHECKER,
        checker_language="cpp",
    )
    repo = TestDataRepository(str(tmp_path / "repo"), tmp_path / "cache")
    link = repo.upload(problem, "even")
    assert (problem / "checker.bin").is_file()
    built = (problem / "checker.bin").stat().st_mtime_ns
    fetched = repo.fetch(link)
    assert os.access(fetched / "checker.bin", os.X_OK)
    assert (
        load_problem(fetched).checker_binary.read_bytes() == (problem / "checker.bin").read_bytes()
    )
    assert repo.upload(problem, "even") == link  # identical: nothing compiled or copied again
    assert (problem / "checker.bin").stat().st_mtime_ns == built


def test_a_directory_that_is_not_a_problem_is_not_uploaded(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    repo = TestDataRepository(str(tmp_path / "repo"), tmp_path / "cache")
    with pytest.raises(ProblemFormatError, match="problem.json: missing"):
        repo.upload(tmp_path / "junk", "junk")
    assert not (tmp_path / "repo").exists()
