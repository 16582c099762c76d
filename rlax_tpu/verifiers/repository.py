"""The test-data repository (RLAX's Oubliette): code problems' tests, answers and compiled
checkers are uploaded once under a root (a local path, file:// or gs://), verification
requests carry only a link `<root>/problems/<problem_id>`, and each verifier host fetches a
problem once into a local cache, where the code verifier reads it as a problem directory.

Layout under a root:

    problems/<problem_id>/files/<path>     every file of the problem directory, as uploaded
    problems/<problem_id>/manifest.json    {path: sha256, size, executable}, written last

A problem exists once its manifest does, so a half-finished upload is never visible, and a
fetch checks every file against the manifest. Content under a problem id never changes
(uploading different content under a used id is refused), which is what lets a cache entry
be trusted without asking the repository again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from rlax_tpu import storage

MANIFEST = "manifest.json"
FILES = "files"
PROBLEMS = "problems"
MANIFEST_FORMAT = 1
_PROBLEM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_CHUNK = 4 * 2**20


class TestDataError(Exception):
    """Base of the repository's errors; the message says what to fix."""

    __test__ = False  # not a pytest test class


class ProblemNotFoundError(TestDataError, FileNotFoundError):
    """No problem at a link: never uploaded, or its upload has not finished."""


class ProblemLinkError(TestDataError, ValueError):
    """A link or problem id that does not name a problem in this repository."""


class ProblemConflictError(TestDataError):
    """Different content was uploaded under a problem id that already holds a problem."""


class TestDataCorruptError(TestDataError):
    """A fetched file does not match the digest its manifest records."""


def check_problem_id(problem_id: str) -> str:
    """`problem_id` if it is one safe path segment (letters, digits, `.`, `_`, `-`)."""
    if not isinstance(problem_id, str) or not _PROBLEM_ID.fullmatch(problem_id):
        raise ProblemLinkError(
            f"problem id {problem_id!r} must be 1-200 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    if problem_id in (".", ".."):
        raise ProblemLinkError(f"problem id {problem_id!r} is not allowed")
    return problem_id


def _canonical(url: str) -> str:
    """One spelling per location: gs:// as given; file:// and local paths as absolute paths."""
    if storage.is_remote(url):
        return url.rstrip("/")
    path = url[len("file://") :] if url.startswith("file://") else url
    return os.path.normpath(os.path.abspath(path))


def split_link(link: str) -> tuple[str, str]:
    """(root, problem_id) of a link `<root>/problems/<problem_id>`, or ProblemLinkError."""
    if not isinstance(link, str) or not link:
        raise ProblemLinkError(f"a problem link must be a non-empty URL or path, got {link!r}")
    head, _, problem_id = link.rstrip("/").rpartition("/")
    root, _, problems = head.rpartition("/")
    if problems != PROBLEMS or not root:
        raise ProblemLinkError(
            f"{link!r} is not a test-data link; links look like <root>/problems/<problem_id>"
        )
    return root, check_problem_id(problem_id)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _manifest_bytes(files: dict[str, dict]) -> bytes:
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def _checked_relpath(rel: str, link: str) -> str:
    """`rel` if it stays inside a problem directory (a manifest is data, not trusted paths)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise TestDataCorruptError(f"{link}: manifest names an unsafe file path {rel!r}")
    return rel


def _check_and_compile(problem_dir: Path) -> None:
    """Validate the problem directory, and compile its checker into it if it has one and no
    `checker.bin` yet, so verifier hosts never compile checkers."""
    from rlax_tpu.verifiers.problems import compile_checker

    compile_checker(problem_dir)  # loads (validates) the problem; no-op without a checker


class TestDataRepository:
    """Problems under `root_url` (local path, file:// or gs://), fetched into `cache_dir`.

    Thread-safe, and processes may share a cache directory: a problem is downloaded once per
    cache, into a temporary directory that is renamed into place once every file checked out.
    """

    __test__ = False

    def __init__(self, root_url: str, cache_dir: str | Path) -> None:
        if not isinstance(root_url, str) or not root_url:
            raise ValueError(
                f"root_url must be a local path, file:// or gs:// URL, got {root_url!r}"
            )
        if not storage.is_remote(root_url) and not root_url.startswith("file://"):
            root_url = os.path.abspath(root_url)  # links must work from any working directory
        self.root_url = root_url.rstrip("/") or root_url
        self.cache_dir = Path(cache_dir)
        self._root = _canonical(self.root_url)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # -- links ------------------------------------------------------------------------------
    def link(self, problem_id: str) -> str:
        """The link requests carry for `problem_id`: `<root_url>/problems/<problem_id>`."""
        return storage.join(self.root_url, PROBLEMS, check_problem_id(problem_id))

    def problem_id(self, link: str) -> str:
        """The problem id `link` names, if it lies in this repository (else ProblemLinkError)."""
        root, problem_id = split_link(link)
        if _canonical(root) != self._root:
            raise ProblemLinkError(
                f"{link!r} is outside the test-data repository {self.root_url!r}"
            )
        return problem_id

    # -- upload -----------------------------------------------------------------------------
    def upload(self, problem_dir: str | Path, problem_id: str) -> str:
        """Upload the problem directory under `problem_id` and return its link.

        The directory must load as a problem (rlax_tpu.verifiers.problems; ProblemFormatError
        if not), and a checker without a compiled `checker.bin` is compiled into it first
        (CheckerCompileError if it does not compile). Files go up first and the manifest
        last, so readers see the whole problem or none of it. Uploading identical content
        again is a no-op; different content under an id that holds a problem raises
        ProblemConflictError (pick a new id: links are immutable).
        """
        problem_dir = Path(problem_dir)
        if not problem_dir.is_dir():
            raise FileNotFoundError(f"problem directory {problem_dir} does not exist")
        link = self.link(problem_id)
        _check_and_compile(problem_dir)
        files = {
            p.relative_to(problem_dir).as_posix(): {
                "sha256": _file_digest(p),
                "size": p.stat().st_size,
                "executable": bool(p.stat().st_mode & 0o111),
            }
            for p in sorted(problem_dir.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
        }
        if not files:
            raise ValueError(f"problem directory {problem_dir} holds no files")
        existing = self._read_manifest(link, missing_ok=True)
        if existing is not None:
            if existing == files:
                return link
            changed = sorted(set(files) ^ set(existing)) or sorted(
                k for k in files if files[k] != existing[k]
            )
            raise ProblemConflictError(
                f"{link} already holds a different problem (files differ: "
                f"{', '.join(changed[:5])}); upload it under a new problem id"
            )
        for rel in files:
            storage.copy(str(problem_dir / rel), storage.join(link, FILES, rel))
        storage.write_bytes(storage.join(link, MANIFEST), _manifest_bytes(files))
        return link

    def _read_manifest(self, link: str, *, missing_ok: bool = False) -> dict[str, dict] | None:
        try:
            raw = storage.read_bytes(storage.join(link, MANIFEST))
        except FileNotFoundError:
            if missing_ok:
                return None
            raise ProblemNotFoundError(
                f"no problem at {link}: it was never uploaded, or its upload has not finished "
                "(the manifest is written last)"
            ) from None
        try:
            manifest = json.loads(raw)
            if manifest["format"] != MANIFEST_FORMAT:
                raise ValueError(f"format {manifest['format']!r}, expected {MANIFEST_FORMAT}")
            files = manifest["files"]
            for rel, entry in files.items():
                _checked_relpath(rel, link)
                if not (isinstance(entry["sha256"], str) and isinstance(entry["size"], int)):
                    raise ValueError(f"bad entry for {rel!r}")
                entry.setdefault("executable", False)
        except TestDataError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise TestDataCorruptError(f"{link}/{MANIFEST} is not a valid manifest: {e}") from None
        return files

    # -- fetch ------------------------------------------------------------------------------
    def cache_path(self, link: str) -> Path:
        """Where `link`'s problem lives in the cache once fetched."""
        problem_id = self.problem_id(link)
        key = hashlib.sha256(self.link(problem_id).encode()).hexdigest()[:16]
        return self.cache_dir / f"{problem_id}.{key}"

    def fetch(self, link: str) -> Path:
        """The local problem directory for `link`, downloading it on first use.

        A cached problem is returned without touching the repository. Concurrent fetches of
        one link (threads or processes sharing the cache) download it once. Raises
        ProblemLinkError (not in this repository), ProblemNotFoundError (not uploaded) or
        TestDataCorruptError (a file does not match its digest; nothing is cached).
        """
        final = self.cache_path(link)
        if final.is_dir():
            return final
        with self._lock(final.name):
            if final.is_dir():  # another thread or process fetched it meanwhile
                return final
            self._download(self.link(self.problem_id(link)), final)
        return final

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        """This key's thread lock, then its file lock (other processes on the same cache)."""
        with self._locks_lock:
            lock = self._locks.setdefault(key, threading.Lock())
        locks = self.cache_dir / ".locks"
        with lock:
            locks.mkdir(parents=True, exist_ok=True)
            with open(locks / f"{key}.lock", "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)

    def _download(self, link: str, final: Path) -> None:
        files = self._read_manifest(link)
        for stale in self.cache_dir.glob(f".tmp-{final.name}-*"):  # left by a crashed fetch
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.cache_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            for rel, entry in files.items():
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                storage.copy(storage.join(link, FILES, rel), str(target))
                digest = _file_digest(target)
                if digest != entry["sha256"]:
                    raise TestDataCorruptError(
                        f"{link}: {rel} has sha256 {digest[:12]}…, its manifest says "
                        f"{entry['sha256'][:12]}…; the repository copy is damaged or was "
                        "overwritten — upload the problem again under a new id"
                    )
                if entry["executable"]:
                    target.chmod(0o755)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class ProblemResolver:
    """Link -> local problem directory for a verifier host, over one cache directory.

    `roots` limits links to those repositories; empty accepts a link into any repository
    (the root is what precedes `/problems/<id>`). Callable, as LocalVerifier's
    `problem_resolver`.
    """

    def __init__(self, cache_dir: str | Path, roots: tuple[str, ...] | list[str] = ()) -> None:
        self.cache_dir = Path(cache_dir)
        self._repositories = {_canonical(r): TestDataRepository(r, self.cache_dir) for r in roots}
        self._fixed = bool(roots)
        self._lock = threading.Lock()

    def repository(self, link: str) -> TestDataRepository:
        root, _ = split_link(link)
        key = _canonical(root)
        with self._lock:
            repository = self._repositories.get(key)
            if repository is None:
                if self._fixed:
                    allowed = ", ".join(r.root_url for r in self._repositories.values())
                    raise ProblemLinkError(
                        f"{link!r} is outside the test-data repositories this verifier "
                        f"serves ({allowed})"
                    )
                repository = self._repositories[key] = TestDataRepository(root, self.cache_dir)
        return repository

    def __call__(self, link: str) -> str:
        return str(self.repository(link).fetch(link))
