"""The calculator tool: arithmetic the policy can ask for, evaluated safely over Python's `ast`.

Only numbers, + - * / // % **, unary + and -, and parentheses are allowed: no names, calls,
attributes or other syntax, so nothing the policy writes runs as code. Limits on the
expression's length, its nesting and the size of every intermediate result (checked before
a power is computed) keep a hostile expression (`2**10**10`) from taking the process's time
or memory.

Integer arithmetic is exact (Python's big integers): + - * // % and ** with a non-negative
integer exponent give ints. `/` of two integers gives an int when the division is exact
(`6/3` is 2, `10**30/10**10` is 10**20, not the float 1e+20) and a float otherwise (`7/2` is
3.5): exact wherever the answer is an integer, which is what arithmetic tasks check. Any float
operand, or a negative exponent, gives a float.
"""

from __future__ import annotations

import ast
import math
import operator
import reprlib
from collections.abc import Callable

from rlax_tpu.api.environments import tool

MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 100  # nested operators and parentheses
# An integer result of at most this many bits (about 3,000 decimal digits, under Python's
# 4,300-digit limit on converting an int to text).
MAX_INTEGER_BITS = 10_000

_OPERATORS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SYMBOLS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}
_ALLOWED = "numbers, + - * / // % **, unary + and -, and parentheses"


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of the arithmetic `expression` (see the module's docstring for what is
    allowed and how division rounds); CalculatorError for anything else, and for a result
    past the limits."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(
            f"the expression is {len(expression)} characters long, over the limit of "
            f"{MAX_EXPRESSION_CHARS}: split it into smaller steps"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression ({exc.msg}); use {_ALLOWED}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError(f"the expression is nested too deeply; use {_ALLOWED}") from None
    return _value(tree.body, 0)


def _value(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int, but True is not a number
            raise CalculatorError(f"{node.value!r} is not a number; use {_ALLOWED}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _value(node.operand, depth + 1)
        return _checked(-operand if isinstance(node.op, ast.USub) else +operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
        left = _value(node.left, depth + 1)
        right = _value(node.right, depth + 1)
        symbol = _SYMBOLS[type(node.op)]
        try:
            return _checked(_apply(node.op, left, right))
        except ZeroDivisionError:
            raise CalculatorError(
                f"division by zero in {_short(left)} {symbol} {_short(right)}"
            ) from None
        except OverflowError:
            raise CalculatorError(
                f"{_short(left)} {symbol} {_short(right)} is too large for a floating-point number"
            ) from None
    raise CalculatorError(f"{_name_of(node)} is not allowed; use {_ALLOWED}")


def _apply(op: ast.operator, left: int | float, right: int | float) -> int | float:
    if isinstance(op, ast.Div):
        if isinstance(left, int) and isinstance(right, int) and right and left % right == 0:
            return left // right  # exact: stays an int
        return left / right
    if isinstance(op, ast.Pow):
        return _power(left, right)
    return _OPERATORS[type(op)](left, right)


def _power(base: int | float, exponent: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # the result has more than (bits(base) - 1) * exponent bits: refuse before computing
        if (abs(base).bit_length() - 1) * exponent > MAX_INTEGER_BITS:
            raise CalculatorError(
                f"{_short(base)} ** {_short(exponent)} has more than {MAX_INTEGER_BITS} bits "
                f"(about {_digits()} digits), the calculator's limit"
            )
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError(f"{_short(base)} ** {_short(exponent)} is not a real number")
    return result


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise CalculatorError(
            f"a result has more than {MAX_INTEGER_BITS} bits (about {_digits()} digits), "
            "the calculator's limit"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("a result is too large for a floating-point number")
    return value


def _short(value: int | float) -> str:
    """An operand as an error shows it: long numbers cut, negative ones in parentheses."""
    text = reprlib.repr(value)
    return f"({text})" if value < 0 else text


def _digits() -> int:
    return int(MAX_INTEGER_BITS * math.log10(2))


def _name_of(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return f"the attribute {node.attr!r}"
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return f"the operator {type(node.op).__name__}"
    return type(node).__name__


@tool
def calculator(expression: str) -> int | float:
    """Evaluates arithmetic (numbers, + - * / // % **, parentheses); integers are exact.

    Args:
        expression: The expression, such as "(12 + 7) * 3 / 4" or "2**64 % 97".
    """
    return evaluate(expression)
