"""The math verifier: pull the final answer out of a response, normalise it, and compare it
with the reference as a string, a number, or a sympy expression (DESIGN §7).

`verify_math` is the pure check; sympy can hang on hostile input, so callers run it in a
`WorkerPool` with a time limit (`verify_math_in_pool`). The rules are in docs/verifiers.md.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import functools
import math
import re
import string
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from rlax_tpu.api.verifier import Verdict, VerificationResult

if TYPE_CHECKING:
    from rlax_tpu.verifiers.pool import WorkerPool

EXTRACTION_METHODS = ("boxed", "hash", "the_answer_is", "last_number")
DEFAULT_EXTRACTION = EXTRACTION_METHODS
# A decimal ("0.333333", "3.14159", "1.5e3") may be a rounding, so two values are equal within
# this relative tolerance when
#   * the reference is written as a decimal ("\pi" is "3.14159", "1/3" is "0.333333"), though
#     never further from it than one unit in its last written digit (1234568 is not
#     "1234567.5": 0.1 at most), or
#   * the answer is written as a decimal and the reference's value has no finite decimal
#     expansion: irrational ("3.14159" is "\pi") or a fraction whose denominator has a prime
#     factor other than 2 and 5 ("0.333333" is "1/3").
# Otherwise they are compared exactly: a decimal is never a rounding of an integer or of a
# finite decimal ("18.00", "1.8e1" and "18." are 18, "1234568.0" is not 1234567, "0.5" is
# "1/2" and "0.5000001" is not), and two values written exactly ("1/3", "10^{-13}",
# "2^{100} + 1") get no tolerance. The tolerance is relative only: nothing but zero equals zero.
DEFAULT_REL_TOL = 1e-6
# Exact values compared through floats (an irrational side) may differ by this much, relative:
# only the noise of a 30-digit evaluation rounded to a double.
_FLOAT_NOISE_REL = 1e-12
# Below this a float cannot tell a value from zero (e^{-50} from 0): sympy decides.
_FLOAT_NOISE_ABS = 1e-20
# No reference is this long; a longer answer is padding or noise, and is not normalised.
MAX_ANSWER_CHARS = 10_000
# Answers longer than this are compared as strings and numbers only, never given to sympy.
MAX_SYMPY_CHARS = 400
# A numeric exponent larger than this (|e|) makes the expression too big to compare.
MAX_EXPONENT = 1000
# A power whose exact value would have more digits than this (numerator or denominator; with
# variables, at the points where the expression is evaluated) is refused: each exponent of
# {{{2^{1000}}^{1000}}^{1000}}^{1000} is allowed, but its value has 3 * 10^{11} digits and
# sympy computed it for over a minute; {x^{1000}}^{1000} took 8 s at the points. Exact
# arithmetic on 10,000 digits takes milliseconds.
MAX_POWER_DIGITS = 10_000
# sympy computes factorials and binomial coefficients eagerly (10^6! takes seconds): larger
# numeric arguments (for a binomial, the smaller of k and n - k) are refused.
MAX_FACTORIAL = 10_000
_SHOWN_CHARS = 120  # how much of an answer a reason quotes


class UnparseableAnswer(ValueError):
    """The text is not something this module turns into a sympy expression."""


@dataclasses.dataclass(frozen=True)
class ExtractedAnswer:
    method: str  # which of EXTRACTION_METHODS found it
    text: str


# --- extraction ---------------------------------------------------------------------------
#
# Every extractor looks for the *last* answer and is linear in the response: a policy can
# answer with megabytes of degenerate text, and the time limit covers this step too.


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


# "\boxed 5": a box without braces; its answer runs up to a space or "$".
_PLAIN_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z]) *(?=[^\s${])")
_BOX_TOKEN = re.compile(r"[^\s$]+")
_BOX_GROUP = re.compile(r"\\(?:boxed|fbox) *\{")
# An escaped brace or backslash, replaced by two characters that are not braces.
_ESCAPED_BRACE = re.compile(r"\\[\\{}]")


def _group_end(text: str, start: int, limit: int) -> int | None:
    """The index of the "}" closing the "{" at text[start], looking only before `limit`;
    None when it does not close there. Escaped braces (\\{ \\}) do not count."""
    offset = 0
    if text.find("\\{", start, limit) >= 0 or text.find("\\}", start, limit) >= 0:
        # Blank out escapes in C (same length, so indices hold), not token by token in Python.
        text, offset = _ESCAPED_BRACE.sub("__", text[start:limit]), start
        start, limit = 0, len(text)
    # Jump from "}" to "}", counting the "{" between in C.
    depth, pos = 1, start + 1
    while (close := text.find("}", pos, limit)) >= 0:
        depth += text.count("{", pos, close) - 1
        if depth == 0:
            return close + offset
        pos = close + 1
    return None


def _extract_boxed(text: str) -> str | None:
    plain_start, plain_answer = -1, -1
    for match in _PLAIN_BOX.finditer(text):
        plain_start, plain_answer = match.start(), match.end()
    # Then the boxes with braces after it (it wins over earlier ones), the last first. A group
    # still open where a later, never-closing group opens never closes either (the depth
    # cannot fall back to it), so each group is scanned only up to the next unclosed one, and
    # groups after the last "}" before that one are not scanned at all: the search reads each
    # character at most once however many boxes there are.
    groups = array.array("q", (m.end() - 1 for m in _BOX_GROUP.finditer(text, plain_start + 1)))
    limit, k = len(text), len(groups)
    while k > 0:
        group = groups[k - 1]
        close = _group_end(text, group, limit)
        if close is not None:
            return text[group + 1 : close].strip()
        limit = group
        k = bisect.bisect_left(groups, text.rfind("}", 0, group), 0, k - 1)
    return _BOX_TOKEN.match(text, plain_answer).group(0) if plain_start >= 0 else None


# Only lines with something after the "####": blank ones are skipped inside the regex engine.
_HASH_ANSWER = re.compile(r"####[ \t]*([^\n]*\S)")


def _extract_hash(text: str) -> str | None:
    found = None
    for match in _HASH_ANSWER.finditer(text):
        found = match.group(1)
    return found.strip() if found is not None else None


_ANSWER_IS = re.compile(
    r"(?:\bthe\s+(?:final\s+)?answer\s+is\b|\bfinal\s+answer\s*(?:is\b|:)"
    r"|^[ \t>*#]*answer[ \t*]*:)",
    re.IGNORECASE | re.MULTILINE,
)


def _extract_answer_is(text: str) -> str | None:
    if "answer" not in text.casefold():  # a fast scan spares the regex most responses
        return None
    last = None
    for last in _ANSWER_IS.finditer(text):  # noqa: B007 (the loop finds the last match)
        pass
    if last is None:
        return None
    line_end = text.find("\n", last.end())
    rest = text[last.end() : line_end if line_end >= 0 else len(text)]
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
_TAIL_CHARS = 4096  # the first window searched for the last number


def _extract_last_number(text: str) -> str | None:
    # Search a window at the end, doubling it until it holds a number: the whole text is read
    # only when its numbers are far from the end. The window starts after a space, which no
    # number spans, so the matches inside it are those of a search of the whole text.
    if not any(digit in text for digit in string.digits):
        return None
    window = _TAIL_CHARS
    while True:
        start = max(0, len(text) - window)
        if start:
            start = text.rfind(" ", 0, start) + 1
        found = None
        for match in _NUMBER.finditer(text, start):
            found = match.group(0)
        if found is not None or start == 0:
            return found
        window *= 2


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
# Units a number may be followed by, and dropped with ("5 cm", "3 \text{ hours}", "$18 USD").
# Only measures: never a word that scales, negates or combines the number (see _VALUE_WORDS).
_UNITS = frozenset(
    # currency
    "dollar dollars usd buck bucks cent cents euro euros eur pound pounds gbp yen jpy yuan rmb "
    "rupee rupees inr peso pesos franc francs "
    # length
    "mm cm dm m km in inch inches ft foot feet yd yard yards mi mile miles nm micron microns "
    "meter meters metre metres millimeter millimeters millimetre millimetres centimeter "
    "centimeters centimetre centimetres kilometer kilometers kilometre kilometres "
    # area and volume
    "acre acres hectare hectares ha l liter liters litre litres ml milliliter milliliters "
    "millilitre millilitres cc gal gallon gallons qt quart quarts pt pint pints cup cups oz "
    "ounce ounces floz tbsp tablespoon tablespoons tsp teaspoon teaspoons bushel bushels "
    # time
    "s sec secs second seconds min mins minute minutes h hr hrs hour hours day days wk wks week "
    "weeks month months yr yrs year years decade decades century centuries ms millisecond "
    "milliseconds am pm "
    # mass
    "mg g kg kgs gram grams kilogram kilograms milligram milligrams lb lbs ton tons tonne tonnes "
    # temperature and angle
    "degree degrees deg celsius fahrenheit kelvin c f radian radians rad rads "
    # speed, energy, data
    "mph kph kmh kmph mps fps watt watts kw kwh volt volts joule joules cal kcal calorie "
    "calories byte bytes kb mb gb tb".split()
)
# Words that go with a unit: "square feet", "fluid ounces", "meters squared", "miles per hour".
_BEFORE_UNIT = frozenset("square sq cubic fluid fl".split())
_AFTER_UNIT = frozenset("squared cubed".split())
# Words after a unit or a count noun that state no value: "5 apples left", "3 hours in total".
_AFTER_COUNT = frozenset("left remaining total altogether overall".split())
# Words that scale, negate, combine or hedge a number: never a unit or a count noun, so the
# answer keeps them and is compared as written ("5 dozen" is not 5, nor is "5 squared", "5 or
# 6", "5 below zero", "5 halves", "5 times").
_VALUE_WORDS = frozenset(
    # joining and hedging
    "or and nor but not then to vs versus plus minus either else otherwise of than by from "
    "approx approximately about roughly nearly almost around max maximum least most "
    # scale
    "dozen dozens score scores gross grand hundred hundreds thousand thousands million millions "
    "billion billions trillion trillions lakh lakhs crore crores mil bn mn thou "
    "pair pairs couple couples fold "
    # fractions and percentages
    "half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths "
    "seventh sevenths eighth eighths ninth ninths tenth tenths hundredth hundredths "
    "thousandth thousandths millionth millionths percent percents percentage percentages "
    "permille repeating recurring "
    # operations
    "times squared cubed square cube power root factorial inverse reciprocal "
    "twice thrice double doubled triple tripled halved over divided "
    # sign and comparison
    "negative positive below above under beneath less more fewer greater smaller higher lower "
    "short off deficit debt loss down up "
    # numbers written as words
    "zero zeros zeroes one ones two twos three threes four fours five fives six sixes seven "
    "sevens eight eights nine nines ten tens eleven elevens twelve twelves teens twenties "
    "thirties forties fifties sixties seventies eighties nineties".split()
)
# Nouns whose plural does not end in "s".
_IRREGULAR_PLURALS = frozenset(
    "people children men women feet teeth geese mice sheep fish goldfish deer oxen".split()
)
# A unit: a word of two or more letters, then more words; a word starts with a letter, so
# "or 6" is no unit. Words hold letters, digits, / ^ . (no nested repetition: linear time).
_UNIT_WORD = r"[A-Za-z]{2}[A-Za-z/^0-9²³.]*(?:[ \t]+[A-Za-z][A-Za-z/^0-9²³.]*)*"
_PLAIN_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+"
_WITH_UNITS = re.compile(rf"^({_PLAIN_NUM})\s*(%?)\s+({_UNIT_WORD})\.?$")
# A unit set as text after a number, a closing brace or a bracket: "3 \text{ m}", "5\mathrm{cm}^2".
_TEXT_UNIT = re.compile(
    r"(?<=[\d})])\s*\\(?:text|textrm|mathrm|mbox)\s*\{\s*([A-Za-z][A-Za-z/^0-9²³. ]*?)\s*\}"
    r"(?:\^\s*\{?\s*[23]\s*\}?)?\s*$"
)
# A unit's power: "cm^2", "m²", "cm2".
_UNIT_POWER = re.compile(r"(?:\^?[23]|[²³])$")
_THOUSANDS = re.compile(r"^([-+]?)(\d{1,3}(?:,\d{3})+)((?:\.\d+)?%?)$")
_LATEX_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:\{,\}\d{3})+(?!\d)")  # 1{,}000
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*(?:=|:=)\s*(?=\S)")
# Euler's number set upright ("2\mathrm{e}"): a separate symbol, so it becomes "2 e", never the
# "2e" that reads as scientific notation missing its exponent (see _BARE_EXPONENT).
_EULER_COMMAND = re.compile(r"\\(?:mathrm|text|textrm|mathit|mbox|operatorname)\s*\{\s*e\s*\}")
_UNICODE = {
    "−": "-",
    "–": "-",
    "×": r"\times ",
    "÷": r"\div ",
    "π": r"\pi ",
    "∞": r"\infty ",
    "∪": r"\cup ",
}


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


def _is_count_noun(word: str, one: bool) -> bool:
    """Whether `word` (lower case) counts things: a plural noun ("apples", "people"), or after
    the number one any noun ("1 apple"); never a value word or a name sympy knows."""
    if word in _VALUE_WORDS or word in _NAMES or word in _GREEK_NAMES or not word.isalpha():
        return False
    if word in _IRREGULAR_PLURALS or one:
        return len(word) > 1
    # "apples", "bananas", "boxes"; not "less", "minus", "this" (no plural ends so).
    return len(word) > 2 and word.endswith("s") and not word.endswith(("ss", "us", "is"))


def _is_measure_unit(word: str) -> bool:
    """Whether `word` (lower case) is a unit from _UNITS, with a power or per-slashes ("cm^2",
    "km/h", "m/s²")."""
    return all(_UNIT_POWER.sub("", part) in _UNITS for part in word.split("/"))


def _is_unit(phrase: str, number: str) -> bool:
    """Whether `phrase`, after the number written `number`, only says what is counted or
    measured: every word a unit or a count noun, joined as units are ("square feet", "miles per
    hour", "meters squared", "5 apples left"). Anything else (a value word, an adjective, a
    name) makes the phrase part of the answer."""
    words = [word.rstrip(".") for word in phrase.lower().split()]
    one = number.lstrip("+-") == "1"

    def measure(k: int) -> bool:
        return 0 <= k < len(words) and (_is_measure_unit(words[k]) or _is_count_noun(words[k], one))

    for k, word in enumerate(words):
        if word in _BEFORE_UNIT:
            ok = measure(k + 1)
        elif word in _AFTER_UNIT or word in _AFTER_COUNT:
            ok = measure(k - 1) or (k > 0 and words[k - 1] in _AFTER_COUNT)
        elif word == "per":
            ok = measure(k - 1) and k + 1 < len(words)
        else:
            ok = measure(k)
        if not ok:
            return False
    return bool(words)


def _drop_text_unit(text: str) -> str:
    """`text` without a unit set as \\text{...} / \\mathrm{...} at its end, whatever the unit's
    length ("3 \\text{ m}" is 3; a bare "3 m" stays a product with the symbol m)."""
    match = _TEXT_UNIT.search(text)
    if match and _is_unit(match.group(1), text[: match.start()].strip()):
        return text[: match.start()]
    return text


def normalize_answer(text: str) -> str:
    """The canonical spelling of an answer: LaTeX wrappers, spacing, units, currency,
    degrees and thousands separators gone; a percentage keeps its trailing "%"."""
    s = text.strip()
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)
    s = _DROP.sub(" ", s)
    s = _EULER_COMMAND.sub(" e ", s)
    s = _drop_text_unit(s.strip())
    for command in _UNWRAP_COMMANDS:
        s = _unwrap(s, command)
    s = _LATEX_THOUSANDS.sub(lambda m: m.group(0).replace("{,}", ""), s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = _DEGREES.sub(" ", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\s*\bpercent\b", "%", s, flags=re.IGNORECASE)
    s = re.sub(r"\s+", " ", s).strip().strip("*").strip()
    s = s.rstrip(" .")
    if s.count("=") == 1:
        s = _ASSIGNMENT.sub("", s)
    match = _WITH_UNITS.match(s)
    if match and _is_unit(match.group(3), match.group(1)):
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
_SAFE_TOKEN = re.compile(r"\s+|\d+(?:\.\d+)?|\.\d+|[A-Za-z]+|\*\*|[-+*/(),!]")


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
def _parse_context() -> tuple[dict[str, Any], dict[str, Any], tuple[Any, ...]]:
    """(names for parse_expr, the same with combinatorial functions left unevaluated for
    `_check_size`, parse_expr's transformations)."""
    sympy = _sympy()
    from sympy.parsing import sympy_parser as sp

    local: dict[str, Any] = {c: sympy.Symbol(c) for c in string.ascii_letters}
    local.update(e=sympy.E, i=sympy.I)
    local.update({_symbol_name(g): sympy.Symbol(_symbol_name(g)) for g in _GREEK})
    # parse_expr computes 10^6! even with evaluate=False; these keep it a node to check first.
    unevaluated = dict(local)
    for name in ("factorial", "factorial2", "binomial"):
        unevaluated[name] = functools.partial(getattr(sympy, name), evaluate=False)
    transformations = sp.standard_transformations + (
        sp.implicit_multiplication,
        sp.implicit_application,
        sp.function_exponentiation,
        sp.convert_xor,
        sp.rationalize,
    )
    return local, unevaluated, transformations


def _safe_text(expression: str) -> str:
    """Only numbers, operators, brackets, "!" (factorial) and known names survive; other
    letter runs become products of single-letter symbols ("xy" -> "x y"). This is what makes
    eval safe: no attribute access, no strings, no calls but those of known names."""
    tokens: list[str] = []
    pos = 0
    while pos < len(expression):
        match = _SAFE_TOKEN.match(expression, pos)
        if not match:
            char = expression[pos]
            if char == "=":
                raise UnparseableAnswer(
                    "an '=' may appear only once, in an equation such as 'y = 2x + 1'"
                )
            raise UnparseableAnswer(f"the character {char!r} is not part of math it can read")
        token = match.group(0)
        pos = match.end()
        if token.isalpha() and token not in _NAMES and token not in _GREEK_NAMES:
            token = " ".join(token)
        tokens.append(f" {token} " if token.isalpha() else token)
    return "".join(tokens)


def _numeric_value(node: Any) -> complex:
    try:
        return complex(node.evalf(15))
    except Exception as exc:
        raise UnparseableAnswer(f"{node} has no value ({exc})") from None


def _refuse_power(node: Any, size: float) -> None:
    where = " where it is evaluated" if node.free_symbols else ""
    if size < 1e12:
        count = f"about {size:,.0f}"
    else:
        count = f"about {size:.1e}" if size < math.inf else "more than 1e300"
    raise UnparseableAnswer(
        f"the power {_short(str(node))} is too large to compare: {count} digits{where} "
        f"(over {MAX_POWER_DIGITS:,})"
    )


def _check_size(expr: Any) -> None:
    """UnparseableAnswer if a power has a numeric exponent beyond MAX_EXPONENT (2^{10^{9}} would
    take sympy all memory to evaluate) or a value of more than MAX_POWER_DIGITS digits (a tower
    such as {{2^{1000}}^{1000}}^{1000}, each exponent allowed; x^{y^{1000}}), or a factorial or
    binomial coefficient a numeric argument beyond MAX_FACTORIAL. `expr` is unevaluated; nodes
    are checked innermost first, so evaluating one numerically is cheap."""
    sympy = _sympy()
    # About how many digits each node's exact value has (its numerator or denominator, the
    # longer), an upper bound for sums, products and powers, with a variable worth
    # _VARIABLE_DIGITS; and for a variable exponent, an upper bound on log10 of its size
    # (None where none is kept: a quotient or a function can be large anywhere).
    digits: dict[Any, float] = {}
    magnitude: dict[Any, float | None] = {}
    for node in sympy.postorder_traversal(expr):
        size, scale = sum(digits[arg] for arg in node.args), None
        if node.is_Rational:
            p, q = abs(int(node.p)), int(node.q)
            size = max(p, q).bit_length() * math.log10(2)
            scale = max(math.log10(p) - math.log10(q), 0.0) if p else 0.0
        elif node.is_Symbol:
            size, scale = _VARIABLE_DIGITS, _VARIABLE_MAGNITUDE
        elif not node.args:
            size = 1.0  # pi, e, i, infinity: evaluated as floats, never as exact digits
        elif isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            exponent = _numeric_value(node.exp)
            if not abs(exponent) <= MAX_EXPONENT:
                raise UnparseableAnswer(f"the exponent {node.exp} is too large to compare")
            size = abs(exponent) * digits[node.base]
            if abs(exponent) > 1 and not size <= MAX_POWER_DIGITS:
                _refuse_power(node, size)
            if exponent.imag == 0 and exponent.real >= 0 and magnitude[node.base] is not None:
                scale = exponent.real * magnitude[node.base]
        elif isinstance(node, sympy.Pow) and magnitude[node.exp] is not None:
            # |e| is at most 10^magnitude, and b^e has at most |e| times b's digits.
            size = (
                10.0 ** magnitude[node.exp] * digits[node.base]
                if magnitude[node.exp] < 300
                else math.inf
            )
            if not size <= MAX_POWER_DIGITS:
                _refuse_power(node, size)
        elif isinstance(node, (sympy.factorial, sympy.factorial2)) and not node.free_symbols:
            n = abs(_numeric_value(node.args[0]))
            if not n <= MAX_FACTORIAL:
                raise UnparseableAnswer(f"{node} is too large to compute")
            size = math.lgamma(n + 1) / math.log(10)
        elif isinstance(node, sympy.binomial) and not node.free_symbols:
            n, k = (_numeric_value(arg) for arg in node.args)
            smaller = min(abs(k), abs(n - k))
            if not smaller <= MAX_FACTORIAL:
                raise UnparseableAnswer(f"{node} is too large to compute")
            size = smaller * math.log10(abs(n) + 1)
        elif isinstance(node, (sympy.Add, sympy.Mul)):
            # A sum of n fractions has at most the digits of their product, times n.
            size += math.log10(len(node.args))
            scales = [magnitude[arg] for arg in node.args]
            if None not in scales:
                add = isinstance(node, sympy.Add)
                scale = max(scales) + math.log10(len(scales)) if add else sum(scales)
        digits[node], magnitude[node] = size, scale


# 1.5e3, 2.5E-3: digits, e or E, then the exponent, with nothing between. "2e-3" is scientific
# notation; "2e^{3}" is a product with a power of Euler's number. An answer with "2e" and no
# exponent is refused before it gets here (_BARE_EXPONENT); a reference's "2e" is 2 times e.
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([-+]?\d+)")


def _expand_scientific(text: str) -> str:
    """Scientific notation as a product with a power of ten, which sympy reads exactly."""
    return _SCIENTIFIC.sub(r"(\1*10**(\2))", text)


_OPERATOR_PAIR = re.compile(r"(?:[-+*/^]\s*[*/^]|[*/^]\s*[-+])(?!\d)|[*/^]\s*[*/^]")
_TRAILING_OPERATOR = re.compile(r"[-+*/^]\s*$")
_BAD_THOUSANDS = re.compile(r"\{,\}(?!\d{3}(?!\d))")


def _unbalanced(text: str) -> str | None:
    """Which bracket of `text` does not pair up, in words; None when all do."""
    opened: list[tuple[str, int]] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for i, ch in enumerate(text):
        if ch in "([{":
            opened.append((ch, i))
        elif ch in pairs:
            # An interval may pair "(" with "]" and "[" with ")".
            if not opened or (opened[-1][0] == "{") != (ch == "}"):
                return f"{ch!r} at position {i} closes nothing"
            opened.pop()
    if opened:
        ch, i = opened[-1]
        return f"{ch!r} at position {i} is never closed"
    return None


def _plain_reason(exc: Exception, text: str) -> str:
    """What a parser exception on `text` means, in words a user can act on."""
    unbalanced = _unbalanced(text.replace("\\{", "{").replace("\\}", "}"))
    if unbalanced:
        return f"its brackets do not balance: {unbalanced}"
    if bad := _BAD_THOUSANDS.search(text):
        return (
            f"the thousands separator '{{,}}' at position {bad.start()} is not followed by "
            "three digits (as in 1{,}000)"
        )
    if pair := _OPERATOR_PAIR.search(text):
        return f"two operators in a row ({pair.group(0)!r} at position {pair.start()})"
    if trailing := _TRAILING_OPERATOR.search(text):
        return f"it ends with the operator {trailing.group(0).strip()!r}"
    if "," in text:
        return "it has a comma that separates nothing this verifier reads as a list or a tuple"
    if isinstance(exc, SyntaxError) or type(exc).__name__ == "TokenError":
        return "it is not a well-formed expression (an operand or an operator is missing)"
    return f"sympy could not build it ({type(exc).__name__}: {_short(str(exc))})"


def to_sympy(text: str) -> Any:
    """A normalised answer as a sympy expression (an equation "a = b" as a - b is not done
    here); UnparseableAnswer, saying in words what could not be read, when it cannot be read
    safely."""
    try:
        if len(text) > MAX_SYMPY_CHARS:
            raise UnparseableAnswer(f"it is longer than {MAX_SYMPY_CHARS} characters")
        from sympy.parsing.sympy_parser import parse_expr

        local, unevaluated, transformations = _parse_context()
        safe = _safe_text(latex_to_expression(_expand_scientific(text)))
        _check_size(
            parse_expr(
                safe, local_dict=unevaluated, transformations=transformations, evaluate=False
            )
        )
        return parse_expr(safe, local_dict=local, transformations=transformations)
    except UnparseableAnswer as exc:
        raise UnparseableAnswer(f"could not read {_short(text)!r} as math: {exc}") from None
    except Exception as exc:  # sympy's parser raises many types (SyntaxError, TypeError...)
        reason = _plain_reason(exc, text)
        raise UnparseableAnswer(f"could not read {_short(text)!r} as math: {reason}") from None


# --- comparison ---------------------------------------------------------------------------

_SCIENTIFIC_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)[eE]([-+]?\d+)")


def _plain_number(text: str) -> Fraction | None:
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", text):
        return Fraction(text)
    scientific = _SCIENTIFIC_NUMBER.fullmatch(text)
    if scientific and abs(int(scientific.group(1))) <= MAX_EXPONENT:
        return Fraction(text)
    fraction = re.fullmatch(r"([-+]?\d+)/(\d+)", text)
    if fraction and int(fraction.group(2)) != 0:
        return Fraction(int(fraction.group(1)), int(fraction.group(2)))
    return None


def _written_inexactly(text: str) -> bool:
    """Whether `text` holds a decimal fraction ("0.333333", "1.5e3"): it may be a rounding."""
    return re.search(r"\d\.|\.\d", text) is not None


# A number with an "e" or "E" glued to it and no exponent after ("2e", "2.5e", "2e+", "3E",
# the "2e" of "2e - 3"): scientific notation cut short, or 2 times Euler's number? Not guessed.
# "e" followed by a letter, a digit or "^" ("2ex", "2e3", "2e^{2}") is something else, and
# "2 e", "2\cdot e", "2\mathrm{e}" are products: scientific notation never has a space.
_BARE_EXPONENT = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE][-+]?(?![\w^]|[-+]?\d)")


def _bare_exponent_reason(text: str) -> str | None:
    """Why `text` (an answer) is refused when it holds scientific notation without an
    exponent; None when it does not."""
    bare = _BARE_EXPONENT.search(text)
    if bare is None:
        return None
    number = bare.group(1)
    thousand = format(Decimal(number).scaleb(3), "f")
    return (
        f"{bare.group(0)!r} looks like scientific notation without an exponent; write "
        f"{number}e3 for {thousand} or {number}\\cdot e for {number} times Euler's number"
    )


def _numbers_equal(
    a: complex | Fraction,
    b: complex | Fraction,
    rel_tol: float,
    abs_tol: float = 0.0,
    most: Fraction | None = None,
) -> bool:
    """a == b within `rel_tol` (relative, so nothing but 0 equals 0) or `abs_tol`, and never
    more than `most` apart; with rel_tol 0, exactly, apart from float noise when a value had
    to be evaluated."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        # Fraction("1e-06") is the decimal meant; Fraction(1e-06), the float, is a bit smaller
        # and would refuse 1/3 against 0.333333, which sits exactly at the tolerance.
        rel, tol_abs = Fraction(repr(rel_tol)), Fraction(repr(abs_tol))
        tol = max(rel * max(abs(a), abs(b)), tol_abs)
        return abs(a - b) <= (tol if most is None else min(tol, most))
    a, b = complex(a), complex(b)
    scale = max(abs(a), abs(b))
    if not abs(a - b) <= max(max(rel_tol, _FLOAT_NOISE_REL) * scale, abs_tol):
        return False
    # As fractions: `most` may be beyond a float's range (a reference written 1.5e400).
    return most is None or Fraction(abs(a - b)) <= max(most, Fraction(_FLOAT_NOISE_REL * scale))


def _is_exact_decimal(value: Any) -> bool:
    """Whether `value` (a Fraction or a sympy expression) is a rational with a finite decimal
    expansion (5, 1/2, 3/8, 10^{-13}): its denominator divides a power of ten."""
    if isinstance(value, Fraction):
        denominator = value.denominator
    elif getattr(value, "is_Rational", False):
        denominator = int(value.q)
    else:
        return False  # irrational (\pi, \sqrt{2}), or not a number
    return pow(10, denominator.bit_length(), denominator) == 0


_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _last_digit(text: str) -> Fraction | None:
    """One unit in the last written digit of a number written as a decimal ("0.25": 1/100,
    "1234567.0": 1/10, "1.5e3": 100); None for anything else."""
    if not _DECIMAL.fullmatch(text) or _plain_number(text) is None:
        return None
    return Fraction(10) ** Decimal(text).as_tuple().exponent


def _tolerance(c_text: str, r_text: str, r_value: Any, rel_tol: float) -> float:
    """The relative tolerance between an answer and a reference (texts without "%", the
    reference's value as a Fraction or a sympy expression); see DEFAULT_REL_TOL."""
    if _written_inexactly(r_text):
        return rel_tol
    if _written_inexactly(c_text) and not _is_exact_decimal(r_value):
        return rel_tol
    return 0.0


def _reference_readings(
    value: Any, percent: bool, last_digit: Fraction | None
) -> list[tuple[Any, Fraction | None]]:
    """The readings of a reference (see _readings), each with how far an answer may be from it
    at most: one unit in the last digit of a decimal reference (None: no such bound)."""
    if last_digit is None:
        return [(reading, None) for reading in _readings(value, percent)]
    return list(zip(_readings(value, percent), _readings(last_digit, percent), strict=True))


def _how_compared(rel_tol: float, most: Fraction | None) -> str:
    if rel_tol == 0:
        return "exactly"
    if most is None:
        return f"within relative tolerance {rel_tol:g}"
    # `most` is a power of ten: 1/10 shows as 0.1, 10^400 as 1e+400.
    digit = Decimal(1).scaleb(round(math.log10(most.numerator) - math.log10(most.denominator)))
    return (
        f"within relative tolerance {rel_tol:g}, and at most {digit:g} (the reference's last digit)"
    )


def _readings(value: Any, percent: bool) -> list[Any]:
    """A percentage reads as its number and as a fraction of one: "50%" is 50 and 0.5."""
    return [value, value / 100] if percent else [value]


def _split_percent(text: str) -> tuple[str, bool]:
    return (text[:-1].strip(), True) if text.endswith("%") else (text, False)


_TEST_POINTS = ("7/10", "13/10", "19/7", "-5/11", "23/9")
# A variable counts as this many digits when sizes are checked (_check_size): the longest
# numerator or denominator of the points where expressions are evaluated exactly (23).
_VARIABLE_DIGITS = max(
    math.log10(max(abs(p.numerator), p.denominator)) for p in map(Fraction, _TEST_POINTS)
)
# And its size at most this, log10: the largest point (23/9).
_VARIABLE_MAGNITUDE = max(math.log10(abs(Fraction(p))) for p in _TEST_POINTS)


def _evaluate(expr: Any, values: dict[Any, Any]) -> complex | None:
    try:
        value = complex(expr.subs(values).evalf(30))
    except Exception:  # undefined at this point (zoo, nan), or sympy could not evaluate it
        return None
    return value if all(map(math.isfinite, (value.real, value.imag))) else None


def _shown(value: Any) -> str:
    """`value` as a reason quotes it: shortened, or said to be too long when it has too many
    digits to print (Python refuses to print an integer of more than 4300 digits)."""
    try:
        return _short(str(value))
    except ValueError:
        return "a number too long to print"


def _compare_constants(
    c: Any, r: Any, rel_tol: float, most: Fraction | None = None
) -> tuple[bool, str]:
    sympy = _sympy()
    if c.is_Rational and r.is_Rational:
        # As fractions: 10^{-13} is not 0, 2^{100} + 1 is not 2^{100}.
        a, b = Fraction(int(c.p), int(c.q)), Fraction(int(r.p), int(r.q))
        same = _numbers_equal(a, b, rel_tol, most=most)
        how = "equal" if same else "different"
        compared = "exactly" if rel_tol == 0 else "numerically"
        return same, f"{compared} {how} ({_shown(c)} vs {_shown(r)})"
    cv, rv = _evaluate(c, {}), _evaluate(r, {})
    if cv is None or rv is None:
        same = sympy.simplify(c - r) == 0
        return same, f"symbolically {'equal' if same else 'different'} (simplify)"
    same = _numbers_equal(cv, rv, rel_tol, most=most)
    if not same and 0 in (cv, rv) and abs(cv - rv) < _FLOAT_NOISE_ABS:
        # Tiny against zero: float noise of an exact zero, or a tiny number (e^{-50}).
        same = sympy.simplify(c - r) == 0
        return same, f"symbolically {'equal' if same else 'different'} (simplify)"
    how = "equal" if same else "different"
    return same, f"numerically {how} ({_shown(c)} vs {_shown(r)})"


def _compare_expressions(
    c: Any, r: Any, rel_tol: float, most: Fraction | None = None
) -> tuple[bool, str]:
    sympy = _sympy()
    symbols = sorted(c.free_symbols | r.free_symbols, key=str)
    if not symbols:
        return _compare_constants(c, r, rel_tol, most)
    # Cheap rejection first: different expressions differ at some rational point.
    for k in range(3):
        point = {s: sympy.Rational(_TEST_POINTS[(k + j) % 5]) for j, s in enumerate(symbols)}
        cv, rv = _evaluate(c, point), _evaluate(r, point)
        if cv is not None and rv is not None and not _numbers_equal(cv, rv, 1e-9, 1e-12):
            where = ", ".join(f"{s}={v}" for s, v in point.items())
            return False, f"symbolically different (differ at {where})"
    if c == r or sympy.simplify(c - r) == 0:
        return True, "symbolically equal (simplify(answer - reference) = 0)"
    return False, "symbolically different (simplify(answer - reference) != 0)"


def _value_words_reason(text: str) -> str | None:
    """Why a number followed by words that change its value ("5 dozen", "5 below zero") is
    not that number; None when `text` is no such thing."""
    match = _WITH_UNITS.match(text)
    if match is None:
        return None
    found = [word for word in match.group(3).lower().split() if word in _VALUE_WORDS]
    if not found:
        return None
    return (
        f"{found[0]!r} in {_short(text)!r} changes the number's value: only units and counted "
        "things are dropped after a number"
    )


def _compare_single(candidate: str, reference: str, rel_tol: float) -> tuple[bool, str]:
    """Two normalised single values (not identical as text: callers check that first)."""
    # Only the answer: a trusted reference's "2e" is 2 times e, and an answer written the same
    # way was accepted as identical text before this.
    if bare := _bare_exponent_reason(candidate):
        return False, bare
    if value_words := _value_words_reason(candidate):
        return False, value_words
    c_text, c_percent = _split_percent(candidate)
    r_text, r_percent = _split_percent(reference)
    # A decimal reference may be a rounding, but by no more than its last written digit.
    last_digit = _last_digit(r_text) if _written_inexactly(r_text) else None
    cn, rn = _plain_number(c_text), _plain_number(r_text)
    if cn is not None and rn is not None:
        tol = _tolerance(c_text, r_text, rn, rel_tol)
        for cv in _readings(cn, c_percent):
            for rv, most in _reference_readings(rn, r_percent, last_digit):
                if _numbers_equal(cv, rv, tol, most=most):
                    return True, f"numerically equal ({_how_compared(tol, most)})"
        return False, f"numbers differ (compared {_how_compared(tol, last_digit)})"
    try:
        c_eq, r_eq = c_text.count("=") == 1, r_text.count("=") == 1
        if c_eq != r_eq:
            return False, "one is an equation and the other is not"
        if c_eq:  # compare lhs - rhs, in either orientation
            cl, cr = (to_sympy(side) for side in c_text.split("="))
            rl, rr = (to_sympy(side) for side in r_text.split("="))
            tol = _tolerance(c_text, r_text, rl - rr, rel_tol)
            same, how = _compare_expressions(cl - cr, rl - rr, tol)
            if not same:
                same, how = _compare_expressions(cl - cr, rr - rl, tol)
            return same, f"equations {how}"
        c_expr, r_expr = to_sympy(c_text), to_sympy(r_text)
    except UnparseableAnswer as exc:
        return False, f"the texts differ and {exc}"
    tol = _tolerance(c_text, r_text, r_expr, rel_tol)
    how = ""
    for cv in _readings(c_expr, c_percent):
        for rv, most in _reference_readings(r_expr, r_percent, last_digit):
            same, how = _compare_expressions(cv, rv, tol, most)
            if same:
                return True, how
    return False, how


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _split_top_level(text: str, separator: re.Pattern[str]) -> list[str]:
    """`text` cut at each match of `separator` outside brackets, the pieces stripped."""
    pieces, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            match = separator.match(text, i)
            if match and match.end() > i:
                pieces.append(text[start:i].strip())
                start = i = match.end()
                continue
        i += 1
    pieces.append(text[start:].strip())
    return pieces


_COMMA = re.compile(r"\s*,\s*")
# Between the items of a bare list, or the alternatives of a hedged answer: "2, 3", "2; 3",
# "2 or 3", "2, and 3". "or"/"and" count only as whole words.
_LIST_SEPARATOR = re.compile(
    r"\s*(?:[,;]\s*(?:(?:or|and)(?![A-Za-z]))?|(?<![A-Za-z\\])(?:or|and)(?![A-Za-z]))\s*",
    re.IGNORECASE,
)
_ITEM_ASSIGNMENT = re.compile(r"([A-Za-z]\w*)\s*=\s*([^=]+)")
_UNION = re.compile(r"\s*\\cup(?![A-Za-z])\s*")


def _strip_assignments(items: list[str]) -> list[str]:
    """The values of "x = 2 or x = 3" when every item assigns the same variable; the items
    unchanged otherwise ("x = 2, y = 3" pairs values with names, so the names stay)."""
    matches = [_ITEM_ASSIGNMENT.fullmatch(item) for item in items]
    if all(matches) and len({m.group(1) for m in matches}) == 1:  # type: ignore[union-attr]
        return [m.group(2).strip() for m in matches]  # type: ignore[union-attr]
    return items


def _split_list(text: str) -> tuple[str, list[str]]:
    """("()" | "[)" | "{}" | "", items) of a tuple, interval or set (items between commas) or
    of a bare list (items between commas, semicolons, "or", "and"); ("", [text]) for
    anything else."""
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
    items = _split_top_level(inner, _COMMA if kind else _LIST_SEPARATOR)
    if len(items) == 1:
        return "", [text]
    return kind, items if kind else _strip_assignments(items)


def _compare_items(c: str, r: str, rel_tol: float) -> bool:
    return _squash(c) == _squash(r) or _compare_single(c, r, rel_tol)[0]


def _compare_lists(c: str, r: str, rel_tol: float) -> tuple[bool, str]:
    """Two normalised answers that are not unions: tuples and intervals item by item in order,
    sets and bare lists in any order, anything else as a single value."""
    c_kind, c_items = _split_list(c)
    r_kind, r_items = _split_list(r)
    if len(c_items) == 1 and len(r_items) == 1:
        return _compare_single(c, r, rel_tol)
    if len(c_items) > 1 and not c_kind and (len(r_items) == 1 or r_kind not in ("", "{}")):
        # "5 or 6" against 5: a hedge must not earn the reward of either of its answers.
        listed = ", ".join(repr(_short(item)) for item in c_items)
        return False, (
            f"the answer lists {len(c_items)} alternatives ({listed}) "
            "while the reference is a single value"
        )
    if len(c_items) != len(r_items):
        return False, f"{len(c_items)} items vs {len(r_items)} in the reference"
    if c_kind != r_kind and {c_kind, r_kind} != {"", "{}"}:
        return False, f"brackets differ ({c_kind or 'none'} vs {r_kind or 'none'})"
    if c_kind in ("", "{}"):  # a set, or a bare list such as the roots of an equation
        return _match_unordered(c_items, r_items, rel_tol, _compare_items, "items")
    for k, (item, ref) in enumerate(zip(c_items, r_items, strict=True)):
        if not _compare_items(item, ref, rel_tol):
            return False, f"item {k} differs ({item!r} vs {ref!r}, in order)"
    return True, f"all {len(c_items)} items equal (in order)"


def _match_unordered(
    c_parts: list[str], r_parts: list[str], rel_tol: float, equal: Any, what: str
) -> tuple[bool, str]:
    """Whether each part of the answer equals a different part of the reference."""
    unmatched = list(r_parts)
    for part in c_parts:
        match = next((j for j, ref in enumerate(unmatched) if equal(part, ref, rel_tol)), None)
        if match is None:
            return False, f"{part!r} matches nothing in the reference (unordered {what})"
        unmatched.pop(match)
    return True, f"all {len(c_parts)} {what} equal (unordered)"


def _union_parts_equal(c: str, r: str, rel_tol: float) -> bool:
    return _squash(c) == _squash(r) or _compare_lists(c, r, rel_tol)[0]


def compare_answers(
    candidate: str, reference: str, *, rel_tol: float = DEFAULT_REL_TOL
) -> tuple[bool, str]:
    """(equal, how it was decided) for two answers, normalised here. May run sympy."""
    if len(candidate) > MAX_ANSWER_CHARS:
        return False, f"the answer is {len(candidate)} characters long (over {MAX_ANSWER_CHARS})"
    c, r = normalize_answer(candidate), normalize_answer(reference)
    if not c:
        return False, "the answer is empty after normalisation"
    if _squash(c) == _squash(r) or (c.isalpha() and c.lower() == r.lower()):
        return True, "identical after normalisation"
    c_union, r_union = _split_top_level(c, _UNION), _split_top_level(r, _UNION)
    if len(c_union) == 1 and len(r_union) == 1:
        return _compare_lists(c, r, rel_tol)
    # A union of intervals or sets is one set: its parts in any order, each with its brackets.
    if len(c_union) != len(r_union):
        return False, f"a union of {len(c_union)} parts vs {len(r_union)} in the reference"
    return _match_unordered(c_union, r_union, rel_tol, _union_parts_equal, "parts of the union")


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
        # The answer is not quoted: extracting it again here, outside the time limit, is what
        # a huge response would make slow (the reference is trusted and short).
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.TIME_LIMIT,
            reason=(
                f"reference {_short(reference_answer(reference))!r}: extracting the answer "
                f"from the response ({len(response)} characters) and comparing it with the "
                f"reference ran past {timeout_s:g}s"
            ),
        )
    except WorkerCrashed as exc:
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.VERIFIER_ERROR,
            reason=f"the math check's worker process died: {exc}",
        )
