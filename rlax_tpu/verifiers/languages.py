"""The languages the code verifier can compile and run, and code extraction from responses.

A `Language` is data: where the source goes, how to compile it (inside the sandbox) and
how to run the result. Adding a language is adding a row to `LANGUAGES` (docs/verifiers.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from rlax_tpu.verifiers.sandbox import RunLimits

# Compilers get more room than the programs they build.
DEFAULT_COMPILE_LIMITS = RunLimits(
    cpu_time_s=30.0,
    wall_time_s=60.0,
    memory_bytes=2 * 2**30,
    output_bytes=1 * 2**20,
    max_processes=32,
    file_size_bytes=256 * 2**20,
    open_files=256,
    tmp_bytes=512 * 2**20,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Language:
    """One row of the language table.

    name:         the name requests and configs use ("python", "cpp").
    source_name:  file the source is written to in the work directory.
    binary_name:  what `run` executes: the compiler's output, or the source itself.
    compile:      argv template run once per submission in the sandbox (with
                  `compile_limits`), or None. `{source}` and `{binary}` are replaced by the
                  file names; a non-zero exit is a compile error (its stderr is the reason).
    run:          argv template that runs the program (cwd = the work directory).
    fence_names:  code-fence tags that mean this language (```cpp, ```c++ ...), lowercase.
    """

    name: str
    source_name: str
    binary_name: str
    compile: tuple[str, ...] | None
    run: tuple[str, ...]
    fence_names: tuple[str, ...]
    compile_limits: RunLimits = DEFAULT_COMPILE_LIMITS

    def compile_argv(self, *, source: str | None = None, binary: str | None = None) -> list[str]:
        if self.compile is None:
            raise ValueError(f"{self.name} has no compile step")
        return _fill(self.compile, source or self.source_name, binary or self.binary_name)

    def run_argv(self, *, binary: str | None = None, args: Sequence[str] = ()) -> list[str]:
        name = binary or self.binary_name
        return [*_fill(self.run, name, name), *args]


def _fill(template: Sequence[str], source: str, binary: str) -> list[str]:
    return [part.replace("{source}", source).replace("{binary}", binary) for part in template]


# The system Python in /usr (the sandbox sees nothing else): -I isolates it from the
# environment and user site, -B writes no bytecode. Its "compile" is a syntax check, so a
# syntax error is a compile error rather than a runtime error on every test.
_PYTHON_SYNTAX_CHECK = (
    "import sys, traceback\n"
    "try:\n"
    "    compile(open(sys.argv[1], 'rb').read(), sys.argv[1], 'exec')\n"
    "except (SyntaxError, ValueError) as e:\n"
    "    sys.stderr.write(''.join(traceback.format_exception_only(e)))\n"
    "    sys.exit(1)\n"
)

LANGUAGES: dict[str, Language] = {
    "python": Language(
        name="python",
        source_name="main.py",
        binary_name="main.py",
        compile=("python3", "-I", "-B", "-c", _PYTHON_SYNTAX_CHECK, "{source}"),
        run=("python3", "-I", "-B", "{binary}"),
        fence_names=("python", "python3", "py"),
    ),
    "cpp": Language(
        name="cpp",
        source_name="main.cpp",
        binary_name="main",
        compile=("g++", "-O2", "-std=c++17", "-pipe", "-o", "{binary}", "{source}"),
        run=("./{binary}",),
        fence_names=("cpp", "c++", "cc", "cxx"),
    ),
}


class UnknownLanguage(ValueError):
    """A language name that is not in the table (or not enabled)."""


def get_language(
    name: str, enabled: Sequence[str] | None = None, table: Mapping[str, Language] = LANGUAGES
) -> Language:
    """The table row for `name`; raises `UnknownLanguage` naming what is available."""
    names = tuple(enabled) if enabled is not None else tuple(table)
    if name not in table or name not in names:
        raise UnknownLanguage(
            f"language {name!r} is not enabled; enabled: {', '.join(names) or 'none'}"
        )
    return table[name]


def language_for_fence(
    tag: str, enabled: Sequence[str] | None = None, table: Mapping[str, Language] = LANGUAGES
) -> str | None:
    """The language name a code-fence tag means (case-insensitive), or None."""
    tag = tag.strip().lower()
    for name in enabled if enabled is not None else table:
        language = table.get(name)
        if language is not None and (tag == name or tag in language.fence_names):
            return name
    return None


@dataclasses.dataclass(frozen=True)
class CodeBlock:
    """A fenced code block: its tag as written ("" when untagged) and its text."""

    tag: str
    code: str


# ```tag\n ... \n``` with the fence at the start of a line; the tag is the first word.
_FENCE = re.compile(
    r"^[ \t]*```[ \t]*(?P<tag>[^\s`]*)[^\n]*\n(?P<code>.*?)^[ \t]*```[ \t]*\r?$",
    re.MULTILINE | re.DOTALL,
)


def code_blocks(response: str) -> list[CodeBlock]:
    """Every closed fenced code block of `response`, in order."""
    return [CodeBlock(m.group("tag"), m.group("code")) for m in _FENCE.finditer(response)]


def extract_code(
    response: str,
    *,
    language: str = "",
    enabled: Sequence[str] | None = None,
    table: Mapping[str, Language] = LANGUAGES,
) -> tuple[str, str] | None:
    """(code, language tag) of the block to judge, or None when the response has none.

    The last fenced block wins. With `language` given, the last block tagged as that language
    (or untagged) wins, falling back to the last block. The returned tag is the fence's
    language name when recognised, else the tag as written ("" when untagged)."""
    blocks = code_blocks(response)
    if not blocks:
        return None
    chosen = blocks[-1]
    if language:
        for block in reversed(blocks):
            if not block.tag or language_for_fence(block.tag, enabled, table) == language:
                chosen = block
                break
    tag = language_for_fence(chosen.tag, enabled, table) or chosen.tag
    return chosen.code, tag
