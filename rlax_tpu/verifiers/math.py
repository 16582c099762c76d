"""The math verifier: pull the final answer out of a response, normalise it, and compare it
with the reference as a string, a number, or a sympy expression (DESIGN §7).

`verify_math` is the pure check; sympy can hang on hostile input, so callers run it in a
`WorkerPool` with a time limit (`verify_math_in_pool`). The rules are in docs/verifiers.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import string
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from rlax_tpu.verifiers.types import Verdict, VerificationResult

if TYPE_CHECKING:
    from rlax_tpu.verifiers.pool import WorkerPool

EXTRACTION_METHODS = ("boxed", "hash", "the_answer_is", "last_number")
DEFAULT_EXTRACTION = EXTRACTION_METHODS
# Two numbers that are not both integers are equal within this relative tolerance.
DEFAULT_REL_TOL = 1e-6
# Answers longer than this are compared as strings and numbers only, never given to sympy.
MAX_SYMPY_CHARS = 400
# A numeric exponent larger than this (|e|) makes the expression too big to compare.
MAX_EXPONENT = 1000
_SHOWN_CHARS = 120  # how much of an answer a reason quotes


class UnparseableAnswer(ValueError):
    """The text is not something this module turns into a sympy expression."""


@dataclasses.dataclass(frozen=True)
class ExtractedAnswer:
    method: str  # which of EXTRACTION_METHODS found it
    text: str


# --- extraction ---------------------------------------------------------------------------


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the brace group opening at text[start] == "{" and the index after its
    closing brace; None when it never closes. Escaped braces (\\{ \\}) do not count."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """{index of "{": index of its "}"} for every brace pair, in one pass (a response may hold
    thousands of unclosed \\boxed{: scanning from each would be quadratic)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for match in re.finditer(r"\\.|[{}]", text, flags=re.DOTALL):
        if match.group(0) == "{":
            stack.append(match.start())
        elif match.group(0) == "}" and stack:
            pairs[stack.pop()] = match.start()
    return pairs


_BOX_TOKEN = re.compile(r"[^\s$]+")


def _extract_boxed(text: str) -> str | None:
    boxes = list(re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text))
    pairs = _closing_braces(text) if boxes else {}
    for match in reversed(boxes):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            if i in pairs:
                return text[i + 1 : pairs[i]].strip()
        else:  # "\\boxed 5"
            plain = _BOX_TOKEN.match(text, i)
            if plain:
                return plain.group(0)
    return None


def _extract_hash(text: str) -> str | None:
    found = None
    for match in re.finditer(r"####[ \t]*([^\n]*)", text):
        if match.group(1).strip():
            found = match.group(1)
    return found.strip() if found is not None else None


_ANSWER_IS = re.compile(
    r"(?:\bthe\s+(?:final\s+)?answer\s+is\b|\bfinal\s+answer\s*(?:is\b|:)"
    r"|^[ \t>*#]*answer[ \t*]*:)",
    re.IGNORECASE | re.MULTILINE,
)


def _extract_answer_is(text: str) -> str | None:
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0]
    rest = rest.strip().lstrip(":").strip().strip("*").strip()
    math_span = re.match(r"\$\$?(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", rest)
    if math_span:
        return next(g for g in math_span.groups() if g is not None).strip() or None
    rest = re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0]
    rest = rest.strip().strip("*").strip().rstrip(".").strip()
    return rest or None


_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\d])|(?<![\w.])-?\.\d+"
)


def _extract_last_number(text: str) -> str | None:
    found = None
    for match in _NUMBER.finditer(text):
        found = match.group(0)
    return found


_EXTRACTORS = {
    "boxed": _extract_boxed,
    "hash": _extract_hash,
    "the_answer_is": _extract_answer_is,
    "last_number": _extract_last_number,
}


def check_extraction_methods(methods: Sequence[str]) -> tuple[str, ...]:
    """`methods` as a tuple; ValueError naming the valid names if one is unknown or none given."""
    unknown = [m for m in methods if m not in _EXTRACTORS]
    if unknown or not methods:
        raise ValueError(
            f"math answer extraction methods {list(methods)!r}: unknown {unknown!r}; "
            f"choose one or more of {EXTRACTION_METHODS!r}"
        )
    return tuple(methods)


def extract_answer(
    response: str, methods: Sequence[str] = DEFAULT_EXTRACTION
) -> ExtractedAnswer | None:
    """The final answer by the first method in `methods` that finds one, else None."""
    for method in check_extraction_methods(methods):
        text = _EXTRACTORS[method](response)
        if text:
            return ExtractedAnswer(method=method, text=text)
    return None


def reference_answer(reference: str) -> str:
    """The answer inside a reference that is a whole solution (\\boxed{...} or GSM8K's
    "#### 42"), else the reference itself."""
    for extractor in (_extract_boxed, _extract_hash):
        found = extractor(reference)
        if found:
            return found
    return reference.strip()


# --- normalisation ------------------------------------------------------------------------

_UNWRAP_COMMANDS = (
    "text",
    "textbf",
    "textit",
    "textrm",
    "mathrm",
    "mathbf",
    "mathit",
    "mbox",
    "operatorname",
    "boxed",
)
_DROP = re.compile(
    r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[bB]igg?[lr]?(?![A-Za-z])"
    r"|\\displaystyle|\\[,;:! ]|\\q?quad(?![A-Za-z])|~"
)
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
# Two letters, then letters, digits, spaces and / ^ . (no nested repetition: linear time).
_UNIT_WORD = r"[A-Za-z]{2}[A-Za-z/^0-9²³. \t]*"
_PLAIN_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+"
_WITH_UNITS = re.compile(rf"^({_PLAIN_NUM})\s*(%?)\s+({_UNIT_WORD})\.?$")
_THOUSANDS = re.compile(r"^([-+]?)(\d{1,3}(?:,\d{3})+)((?:\.\d+)?%?)$")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*(?:=|:=)\s*(?=\S)")
_UNICODE = {"−": "-", "–": "-", "×": r"\times ", "÷": r"\div ", "π": r"\pi ", "∞": r"\infty "}


def _unwrap(text: str, command: str) -> str:
    pattern = re.compile(rf"\\{command}\s*(?=\{{)")
    while True:
        match = pattern.search(text)
        if not match:
            return text
        group = _braced(text, match.end())
        if group is None:
            return text
        text = f"{text[: match.start()]}{group[0]}{text[group[1] :]}"


def normalize_answer(text: str) -> str:
    """The canonical spelling of an answer: LaTeX wrappers, spacing, units, currency,
    degrees and thousands separators gone; a percentage keeps its trailing "%"."""
    s = text.strip()
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)
    for command in _UNWRAP_COMMANDS:
        s = _unwrap(s, command)
    s = _DROP.sub(" ", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = _DEGREES.sub(" ", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\s*\bpercent\b", "%", s, flags=re.IGNORECASE)
    s = re.sub(r"\s+", " ", s).strip().strip("*").strip()
    s = s.rstrip(" .")
    if s.count("=") == 1:
        s = _ASSIGNMENT.sub("", s)
    match = _WITH_UNITS.match(s)
    if match and match.group(3).split()[0] not in _NAMES | _GREEK_NAMES:
        s = match.group(1) + match.group(2)
    s = re.sub(r"\s+%", "%", s)
    match = _THOUSANDS.match(s)
    if match:
        s = match.group(1) + match.group(2).replace(",", "") + match.group(3)
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)
    return choice.group(1) if choice else s


# --- LaTeX-ish text to sympy --------------------------------------------------------------

_FUNCTIONS = {
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "sec": "sec",
    "csc": "csc",
    "cot": "cot",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "log": "log",
    "ln": "log",
    "exp": "exp",
}
_GREEK = (
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu "
    "nu xi rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma "
    "Upsilon Phi Psi Omega"
).split()
# Names allowed through to parse_expr (which evals its input): sympy functions and
# constants, and Greek letters; every other run of letters is split into single letters.
_NAMES = {"sqrt", "pi", "oo", "binomial", *_FUNCTIONS.values()}
_GREEK_NAMES = frozenset("lamda" if g == "lambda" else g for g in _GREEK)
_SAFE_TOKEN = re.compile(r"\s+|\d+(?:\.\d+)?|\.\d+|[A-Za-z]+|\*\*|[-+*/(),]")


def _symbol_name(greek: str) -> str:
    return "lamda" if greek == "lambda" else greek  # sympy's spelling avoids the keyword


def _latex_arg(text: str, i: int) -> tuple[str, int]:
    """One argument of a LaTeX command at text[i]: a {group}, a \\command, or one char."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        raise UnparseableAnswer("a command is missing its argument")
    if text[i] == "{":
        group = _braced(text, i)
        if group is None:
            raise UnparseableAnswer("unbalanced braces")
        return group
    if text[i] == "\\":
        command = re.match(r"\\[A-Za-z]+", text[i:])
        if command:
            return command.group(0), i + len(command.group(0))
    return text[i], i + 1


def _paren_or_arg(text: str, i: int) -> tuple[str, int]:
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "(":
        depth = 0
        for j in range(i, len(text)):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j], j + 1
        raise UnparseableAnswer("unbalanced parentheses")
    return _latex_arg(text, i)


def latex_to_expression(text: str) -> str:
    """LaTeX-ish math (\\frac, \\sqrt, ^{...}, \\cdot, \\pi, ...) as plain sympy syntax;
    UnparseableAnswer for constructs it does not know."""
    mixed = re.fullmatch(r"([-+]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}", text.strip())
    if mixed:  # a mixed number: 2\frac{1}{4} is 2 + 1/4
        sign, whole, num, den = mixed.groups()
        return f"{sign}({whole} + {num}/{den})"
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            command = re.match(r"\\([A-Za-z]+|.)", text[i:])
            assert command is not None
            name = command.group(1)
            i += len(command.group(0))
            if name == "frac":
                num, i = _latex_arg(text, i)
                den, i = _latex_arg(text, i)
                out.append(f"(({latex_to_expression(num)})/({latex_to_expression(den)}))")
            elif name == "sqrt":
                while i < len(text) and text[i] == " ":
                    i += 1
                if i < len(text) and text[i] == "[":
                    end = text.find("]", i)
                    if end < 0:
                        raise UnparseableAnswer("unclosed \\sqrt[")
                    degree = latex_to_expression(text[i + 1 : end])
                    radicand, i = _latex_arg(text, end + 1)
                    out.append(f"(({latex_to_expression(radicand)})**(1/({degree})))")
                else:
                    radicand, i = _latex_arg(text, i)
                    out.append(f"sqrt({latex_to_expression(radicand)})")
            elif name in ("binom", "dbinom", "tbinom"):
                n, i = _latex_arg(text, i)
                k, i = _latex_arg(text, i)
                out.append(f"binomial({latex_to_expression(n)}, {latex_to_expression(k)})")
            elif name == "log" and text[i : i + 1] == "_":
                base, i = _latex_arg(text, i + 1)
                arg, i = _paren_or_arg(text, i)
                out.append(f"log({latex_to_expression(arg)}, {latex_to_expression(base)})")
            elif name in ("cdot", "times", "ast"):
                out.append("*")
            elif name == "div":
                out.append("/")
            elif name == "pi":
                out.append(" pi ")
            elif name == "infty":
                out.append(" oo ")
            elif name in _FUNCTIONS:
                out.append(f" {_FUNCTIONS[name]} ")
            elif name in _GREEK:
                out.append(f" {_symbol_name(name)} ")
            else:
                raise UnparseableAnswer(f"unsupported LaTeX command \\{name}")
        elif ch == "{":
            group = _braced(text, i)
            if group is None:
                raise UnparseableAnswer("unbalanced braces")
            out.append(f"({latex_to_expression(group[0])})")
            i = group[1]
        elif ch == "}":
            raise UnparseableAnswer("unbalanced braces")
        elif ch == "^":
            out.append("**")
            i += 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _sympy() -> Any:
    import sympy  # imported on first use: only the worker processes need it

    return sympy


@functools.cache
def _parse_context() -> tuple[dict[str, Any], tuple[Any, ...]]:
    sympy = _sympy()
    from sympy.parsing import sympy_parser as sp

    local: dict[str, Any] = {c: sympy.Symbol(c) for c in string.ascii_letters}
    local.update(e=sympy.E, i=sympy.I)
    local.update({_symbol_name(g): sympy.Symbol(_symbol_name(g)) for g in _GREEK})
    transformations = sp.standard_transformations + (
        sp.implicit_multiplication,
        sp.implicit_application,
        sp.function_exponentiation,
        sp.convert_xor,
        sp.rationalize,
    )
    return local, transformations


def _safe_text(expression: str) -> str:
    """Only numbers, operators, brackets and known names survive; other letter runs become
    products of single-letter symbols ("xy" -> "x y"). This is what makes eval safe."""
    tokens: list[str] = []
    pos = 0
    while pos < len(expression):
        match = _SAFE_TOKEN.match(expression, pos)
        if not match:
            raise UnparseableAnswer(f"unsupported character {expression[pos]!r}")
        token = match.group(0)
        pos = match.end()
        if token.isalpha() and token not in _NAMES and token not in _GREEK_NAMES:
            token = " ".join(token)
        tokens.append(f" {token} " if token.isalpha() else token)
    return "".join(tokens)


def _check_size(expr: Any) -> None:
    """UnparseableAnswer if a power has a numeric exponent beyond MAX_EXPONENT (2^{10^{9}} would
    take sympy all memory to evaluate). `expr` is unevaluated; exponents are checked
    innermost first, so evaluating one numerically is cheap."""
    sympy = _sympy()
    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            try:
                value = complex(node.exp.evalf(15))
            except Exception as exc:
                raise UnparseableAnswer(f"exponent {node.exp} has no value ({exc})") from None
            if not abs(value) <= MAX_EXPONENT:
                raise UnparseableAnswer(f"exponent {node.exp} is too large to compare")


def to_sympy(text: str) -> Any:
    """A normalised answer as a sympy expression (an equation "a = b" as a - b is not done
    here); UnparseableAnswer when it cannot be read safely."""
    if len(text) > MAX_SYMPY_CHARS:
        raise UnparseableAnswer(f"longer than {MAX_SYMPY_CHARS} characters")
    from sympy.parsing.sympy_parser import parse_expr

    local, transformations = _parse_context()
    try:
        safe = _safe_text(latex_to_expression(text))
        _check_size(
            parse_expr(safe, local_dict=local, transformations=transformations, evaluate=False)
        )
        return parse_expr(safe, local_dict=local, transformations=transformations)
    except UnparseableAnswer:
        raise
    except Exception as exc:  # sympy's parser raises many types (SyntaxError, TypeError...)
        raise UnparseableAnswer(f"{type(exc).__name__}: {exc}") from None


# --- comparison ---------------------------------------------------------------------------


def _plain_number(text: str) -> Fraction | None:
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", text):
        return Fraction(text)
    fraction = re.fullmatch(r"([-+]?\d+)/(\d+)", text)
    if fraction and int(fraction.group(2)) != 0:
        return Fraction(int(fraction.group(1)), int(fraction.group(2)))
    return None


def _numbers_equal(a: complex | Fraction, b: complex | Fraction, rel_tol: float) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if a == b:
            return True
        if a.denominator == 1 and b.denominator == 1:
            return False  # integers are equal exactly or not at all
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)
    a, b = complex(a), complex(b)
    return abs(a - b) <= max(rel_tol * max(abs(a), abs(b)), 1e-12)


def _readings(value: Any, percent: bool) -> list[Any]:
    """A percentage reads as its number and as a fraction of one: "50%" is 50 and 0.5."""
    return [value, value / 100] if percent else [value]


def _split_percent(text: str) -> tuple[str, bool]:
    return (text[:-1].strip(), True) if text.endswith("%") else (text, False)


_TEST_POINTS = ("7/10", "13/10", "19/7", "-5/11", "23/9")


def _evaluate(expr: Any, values: dict[Any, Any]) -> complex | None:
    try:
        value = complex(expr.subs(values).evalf(30))
    except Exception:  # undefined at this point (zoo, nan), or sympy could not evaluate it
        return None
    return value if all(map(math.isfinite, (value.real, value.imag))) else None


def _compare_expressions(c: Any, r: Any, rel_tol: float) -> tuple[bool, str]:
    sympy = _sympy()
    symbols = sorted(c.free_symbols | r.free_symbols, key=str)
    if not symbols:
        cv, rv = _evaluate(c, {}), _evaluate(r, {})
        if cv is None or rv is None:
            same = sympy.simplify(c - r) == 0
            return same, f"symbolically {'equal' if same else 'different'} (simplify)"
        same = _numbers_equal(cv, rv, rel_tol)
        how = "equal" if same else "different"
        return same, f"numerically {how} ({_short(str(c))} vs {_short(str(r))})"
    # Cheap rejection first: different expressions differ at some rational point.
    for k in range(3):
        point = {s: sympy.Rational(_TEST_POINTS[(k + j) % 5]) for j, s in enumerate(symbols)}
        cv, rv = _evaluate(c, point), _evaluate(r, point)
        if cv is not None and rv is not None and not _numbers_equal(cv, rv, 1e-9):
            where = ", ".join(f"{s}={v}" for s, v in point.items())
            return False, f"symbolically different (differ at {where})"
    if c == r or sympy.simplify(c - r) == 0:
        return True, "symbolically equal (simplify(answer - reference) = 0)"
    return False, "symbolically different (simplify(answer - reference) != 0)"


def _compare_single(candidate: str, reference: str, rel_tol: float) -> tuple[bool, str]:
    c_text, c_percent = _split_percent(candidate)
    r_text, r_percent = _split_percent(reference)
    cn, rn = _plain_number(c_text), _plain_number(r_text)
    if cn is not None and rn is not None:
        for cv in _readings(cn, c_percent):
            for rv in _readings(rn, r_percent):
                if _numbers_equal(cv, rv, rel_tol):
                    return True, "numerically equal"
        return False, "numbers differ"
    try:
        c_eq, r_eq = c_text.count("=") == 1, r_text.count("=") == 1
        if c_eq != r_eq:
            return False, "one is an equation and the other is not"
        if c_eq:  # compare lhs - rhs, in either orientation
            cl, cr = (to_sympy(side) for side in c_text.split("="))
            rl, rr = (to_sympy(side) for side in r_text.split("="))
            same, how = _compare_expressions(cl - cr, rl - rr, rel_tol)
            if not same:
                same, how = _compare_expressions(cl - cr, rr - rl, rel_tol)
            return same, f"equations {how}"
        c_expr, r_expr = to_sympy(c_text), to_sympy(r_text)
    except UnparseableAnswer as exc:
        return False, f"strings differ and not comparable as math ({exc})"
    how = ""
    for cv in _readings(c_expr, c_percent):
        for rv in _readings(r_expr, r_percent):
            same, how = _compare_expressions(cv, rv, rel_tol)
            if same:
                return True, how
    return False, how


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


_OPEN_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _split_list(text: str) -> tuple[str, list[str]]:
    """("()" | "[)" | "{}" | "", top-level comma-separated items) of a tuple, interval, set
    or bare list; ("", [text]) for anything else."""
    kind, inner = "", text
    set_match = re.fullmatch(r"\\\{(.*)\\\}", text)
    if set_match:
        kind, inner = "{}", set_match.group(1)
    elif text[:1] in "([" and text[-1:] in ")]":
        depth = 0
        for i, ch in enumerate(text):
            depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
            if depth == 0:
                if i == len(text) - 1:
                    kind, inner = text[0] + text[-1], text[1:-1]
                break
    items, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == "," and depth == 0:
            items.append(inner[start:i].strip())
            start = i + 1
    items.append(inner[start:].strip())
    if len(items) == 1:
        return "", [text]
    return kind, items


def _compare_items(c: str, r: str, rel_tol: float) -> bool:
    return _squash(c) == _squash(r) or _compare_single(c, r, rel_tol)[0]


def compare_answers(
    candidate: str, reference: str, *, rel_tol: float = DEFAULT_REL_TOL
) -> tuple[bool, str]:
    """(equal, how it was decided) for two answers, normalised here. May run sympy."""
    c, r = normalize_answer(candidate), normalize_answer(reference)
    if not c:
        return False, "the answer is empty after normalisation"
    if _squash(c) == _squash(r) or (c.isalpha() and c.lower() == r.lower()):
        return True, "identical after normalisation"
    c_kind, c_items = _split_list(c)
    r_kind, r_items = _split_list(r)
    if len(c_items) == 1 and len(r_items) == 1:
        return _compare_single(c, r, rel_tol)
    if len(c_items) != len(r_items):
        return False, f"{len(c_items)} items vs {len(r_items)} in the reference"
    if c_kind != r_kind and {c_kind, r_kind} != {"", "{}"}:
        return False, f"brackets differ ({c_kind or 'none'} vs {r_kind or 'none'})"
    if c_kind in ("", "{}"):  # a set, or a bare list such as the roots of an equation
        unmatched = list(r_items)
        for item in c_items:
            match = next(
                (j for j, ref in enumerate(unmatched) if _compare_items(item, ref, rel_tol)), None
            )
            if match is None:
                return False, f"item {item!r} matches nothing in the reference (unordered)"
            unmatched.pop(match)
        return True, f"all {len(c_items)} items equal (unordered)"
    for k, (item, ref) in enumerate(zip(c_items, r_items, strict=True)):
        if not _compare_items(item, ref, rel_tol):
            return False, f"item {k} differs ({item!r} vs {ref!r}, in order)"
    return True, f"all {len(c_items)} items equal (in order)"


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def verify_math(
    response: str,
    reference: str,
    methods: Sequence[str] = DEFAULT_EXTRACTION,
    rel_tol: float = DEFAULT_REL_TOL,
) -> VerificationResult:
    """Judges `response` against `reference` (an answer, or a solution with \\boxed{} or
    "####"). Pure and possibly slow (sympy): run it through `verify_math_in_pool`."""
    ref = reference_answer(reference)
    if not ref:
        return VerificationResult(
            reward=0.0, verdict=Verdict.VERIFIER_ERROR, reason="the reference answer is empty"
        )
    found = extract_answer(response, methods)
    if found is None:
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.NO_ANSWER,
            reason=f"no final answer found (tried {', '.join(methods)})",
        )
    try:
        equal, how = compare_answers(found.text, ref, rel_tol=rel_tol)
    except Exception as exc:  # sympy fails in many ways on odd input (RecursionError, ...)
        equal, how = False, f"could not compare ({type(exc).__name__}: {_short(str(exc))})"
    reason = f"extracted {_short(found.text)!r} by {found.method}; reference {_short(ref)!r}: {how}"
    return VerificationResult(
        reward=1.0 if equal else 0.0,
        verdict=Verdict.ACCEPTED if equal else Verdict.WRONG_ANSWER,
        reason=reason,
    )


def verify_math_in_pool(
    pool: WorkerPool,
    response: str,
    reference: str,
    *,
    timeout_s: float,
    methods: Sequence[str] = DEFAULT_EXTRACTION,
    rel_tol: float = DEFAULT_REL_TOL,
) -> VerificationResult:
    """`verify_math` in a worker of `pool`; TIME_LIMIT when it runs past `timeout_s`."""
    from rlax_tpu.verifiers.pool import TaskTimeout, WorkerCrashed

    methods = check_extraction_methods(methods)
    try:
        return pool.run(verify_math, response, reference, methods, rel_tol, timeout_s=timeout_s)
    except TaskTimeout:
        found = extract_answer(response, methods)
        what = f"{_short(found.text)!r} by {found.method}" if found else "nothing"
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.TIME_LIMIT,
            reason=f"extracted {what}; comparing it with the reference ran past {timeout_s:g}s",
        )
    except WorkerCrashed as exc:
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.VERIFIER_ERROR,
            reason=f"the math check's worker process died: {exc}",
        )
