#!/usr/bin/env python3
"""Bootstrap and run rlax_tpu with nothing installed beyond Python 3.11+.

    python3 quickstart.py run    # tiny end-to-end job on the CPU (configs/tiny_cpu.py)
    python3 quickstart.py test   # the test suite

Creates a virtual environment in .venv (or $RLAX_TPU_VENV), installs the package
into it (with the `test` extra for `test`) and re-installs only when pyproject.toml,
setup.py or protos/ change. Arguments after the command go to `rlax-tpu run` or pytest.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("RLAX_TPU_VENV", ROOT / ".venv"))


def _bin(name: str) -> Path:
    return VENV / ("Scripts" if os.name == "nt" else "bin") / name


def _install_inputs_digest(extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    files = [
        ROOT / "pyproject.toml",
        ROOT / "setup.py",
        *sorted((ROOT / "protos").rglob("*.proto")),
    ]
    for path in files:
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def ensure_installed(extra: str) -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - this file runs on any python3
        sys.exit(f"rlax_tpu needs Python >= 3.11; this is {sys.version.split()[0]}")
    if not _bin("python").exists():
        print(f"creating virtual environment {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / f".rlax_tpu_installed_{extra or 'base'}"
    digest = _install_inputs_digest(extra)
    if stamp.exists() and stamp.read_text() == digest:
        return
    target = f".[{extra}]" if extra else "."
    print(f"installing rlax_tpu{f'[{extra}]' if extra else ''} into {VENV}", flush=True)
    subprocess.run(
        [str(_bin("python")), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True
    )
    subprocess.run(
        [str(_bin("python")), "-m", "pip", "install", "--quiet", "-e", target],
        cwd=ROOT,
        check=True,
    )
    stamp.write_text(digest)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        ensure_installed("")
        args = [str(_bin("rlax-tpu")), "run", str(ROOT / "configs" / "tiny_cpu.py"), *rest]
    else:
        ensure_installed("test")
        args = [str(_bin("python")), "-m", "pytest", *rest]
    return subprocess.call(args, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
