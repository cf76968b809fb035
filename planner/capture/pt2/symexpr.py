"""The grammar a symbolic size in a `.pt2` graph must follow before torch reads it.

torch's deserializer hands every ``expr_str`` of the serialized graph to
``sympy.sympify``, which evaluates it as Python: a crafted archive runs code
through a size. torch itself writes these strings with ``sympy.srepr``::

    Add(Mul(Integer(4), Symbol('s77', positive=True, integer=True)), FloorDiv(Symbol('s77', ...), Integer(2)))

`check_expr` parses a string with Python's `ast` (nothing is evaluated) and
accepts only integers, symbols, ``+ - * // %``, small integer powers (torch writes a square as
``Pow(s0, Integer(2))``) and the calls below; anything
else (attributes, subscripts, lambdas, other names or calls, strings outside
``Symbol('name')``, floats) is refused.

A size may also be bounded by a condition: torch writes the checks on a size that
depends on the data (a boolean mask's count, ``u0``) as relations of two sizes,
``LessThan(Symbol('u0', integer=True), Integer(64))``, joined by ``And``/``Or``/``Not``.
A whole expression may be such a condition; its sides are sizes in the grammar above,
and a condition is never a size (no relation inside ``Add`` or ``Max``).

sympy folds integer arithmetic as it parses, and torch substitutes each size's
hint into the expression: a short string such as ``((10**64)**64)**64`` stands
for a number of hundreds of thousands of digits, and one level more for one
that no machine finishes computing. `check_expr` therefore also bounds the
magnitude of every subexpression, in bits, taking each symbol at its largest
(a 64-bit size), and refuses anything past `MAX_VALUE_BITS`.
"""

from __future__ import annotations

import ast
import re

__all__ = ["MAX_EXPR_CHARS", "MAX_VALUE_BITS", "SYMBOL_NAME", "ExprError", "check_expr", "check_symbol_name"]

MAX_EXPR_CHARS = 10_000
"""Longest expression string accepted (torch writes a few hundred characters at most)."""
MAX_INT_DIGITS = 20
"""An integer literal has at most this many digits (sizes fit in 64 bits)."""
SYMBOL_NAME = re.compile(r"[a-z]{1,8}[0-9]{1,12}")
"""torch's size symbols: a short prefix and a number (s0, u3, s77); never a sympy constant (E, I, S, pi)."""

_FUNCTIONS = {"Add", "Mul", "Mod", "Max", "Min", "FloorDiv", "PythonMod", "CleanDiv"}
_TWO_ARGS = {"Mod", "FloorDiv", "PythonMod", "CleanDiv"}
# sympy's relations as srepr writes them (`u0 <= 64` is LessThan, `Eq` is Equality) and their short names,
# which sympify knows too; each compares two sizes
_RELATIONS = {"LessThan", "GreaterThan", "StrictLessThan", "StrictGreaterThan", "Equality", "Unequality",
              "Eq", "Ne", "Le", "Lt", "Ge", "Gt"}
_LOGIC = {"And", "Or", "Not"}
_TRUTH = {"true", "false"}  # srepr of sympy's true and false
MAX_POWER = 64
"""`Pow(x, n)` (torch writes `Pow(s70, Integer(2))` for a square) only with a literal n in 0..MAX_POWER."""
MAX_VALUE_BITS = 4096
"""Largest magnitude, in bits, any subexpression may reach with every symbol at 2**64 (torch's sizes are
64-bit: a product of a few sizes, or a square, stays far below; a power tower does not)."""
_SYMBOL_BITS = 64  # a size symbol's value is below 2**64
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
_UNARY = (ast.USub, ast.UAdd)
_SYMBOL_ASSUMPTIONS = {"integer", "positive", "nonnegative", "negative", "nonpositive", "real", "finite"}


class ExprError(ValueError):
    """An expression string outside the grammar; the message says what was found."""


def check_symbol_name(name: object) -> None:
    if not isinstance(name, str) or not SYMBOL_NAME.fullmatch(name):
        raise ExprError(f"symbol name {str(name)[:40]!r} is not a size symbol (like s0 or u3)")


def _int(node: ast.AST) -> int:
    """An integer literal's magnitude in bits."""
    if type(node) is not ast.Constant or type(node.value) is not int:
        raise ExprError(f"{type(node).__name__} where an integer literal belongs")
    if len(str(abs(node.value))) > MAX_INT_DIGITS:
        raise ExprError(f"an integer of more than {MAX_INT_DIGITS} digits")
    return max(1, abs(node.value).bit_length())


def _symbol_call(node: ast.Call) -> int:
    if len(node.args) != 1 or type(node.args[0]) is not ast.Constant or not isinstance(node.args[0].value, str):
        raise ExprError("Symbol(...) takes exactly one name string")
    check_symbol_name(node.args[0].value)
    for kw in node.keywords:
        if kw.arg not in _SYMBOL_ASSUMPTIONS or type(kw.value) is not ast.Constant or type(kw.value.value) is not bool:
            raise ExprError(f"Symbol(...) keyword {str(kw.arg)[:20]!r} is not a True/False size assumption")
    return _SYMBOL_BITS


def _power(node: ast.AST) -> int:
    """An exponent: a literal integer in 0..MAX_POWER, bare or as Integer(n) (a huge one would hang sympy)."""
    if type(node) is ast.Call and type(node.func) is ast.Name and node.func.id == "Integer" and len(node.args) == 1:
        node = node.args[0]
    if type(node) is not ast.Constant or type(node.value) is not int or not 0 <= node.value <= MAX_POWER:
        raise ExprError(f"an exponent other than an integer from 0 to {MAX_POWER}")
    return node.value


def _bounded(bits: int) -> int:
    if bits > MAX_VALUE_BITS:
        raise ExprError(
            f"a value of up to {bits} bits, past the {MAX_VALUE_BITS}-bit bound for sizes (sympy would compute it)"
        )
    return bits


def _call(node: ast.Call) -> int:
    name = node.func.id if type(node.func) is ast.Name else None
    if name == "Symbol":
        return _symbol_call(node)
    if name == "Integer":
        if len(node.args) != 1 or node.keywords:
            raise ExprError("Integer(...) takes exactly one integer")
        arg = node.args[0]
        if type(arg) is ast.UnaryOp and type(arg.op) is ast.USub:
            arg = arg.operand
        return _int(arg)
    if name == "Pow":
        if len(node.args) != 2 or node.keywords:
            raise ExprError("Pow(...) takes a base and an exponent")
        base = _walk(node.args[0])
        return _bounded(max(1, base * _power(node.args[1])))
    if name in _FUNCTIONS:
        if node.keywords or not node.args or (name in _TWO_ARGS and len(node.args) != 2):
            raise ExprError(f"{name}(...) with the wrong arguments")
        bits = [_walk(arg) for arg in node.args]
        if name == "Mul":
            return _bounded(sum(bits))
        if name == "Add":
            return _bounded(max(bits) + (len(bits) - 1).bit_length())
        return max(bits)
    shown = name if name is not None else type(node.func).__name__
    raise ExprError(f"call of {shown[:40]!r} (only {', '.join(sorted(_FUNCTIONS | {'Integer', 'Pow', 'Symbol'}))})")


def _condition(node: ast.AST) -> None:
    """Check a condition: a relation of two sizes, And/Or/Not of conditions, or true/false."""
    if type(node) is ast.Name and node.id in _TRUTH:
        return
    name = node.func.id if type(node) is ast.Call and type(node.func) is ast.Name else None
    if name in _RELATIONS:
        if len(node.args) != 2 or node.keywords:
            raise ExprError(f"{name}(...) compares exactly two sizes")
        for arg in node.args:
            _walk(arg)
        return
    if name in _LOGIC:
        if node.keywords or not node.args or (name == "Not" and len(node.args) != 1):
            raise ExprError(f"{name}(...) with the wrong arguments")
        for arg in node.args:
            _condition(arg)
        return
    raise ExprError(f"{_shown(node)} where a condition belongs (only {', '.join(sorted(_RELATIONS | _LOGIC))})")


def _shown(node: ast.AST) -> str:
    if type(node) is ast.Call:
        return f"call of {node.func.id[:40]!r}" if type(node.func) is ast.Name else f"call of {type(node.func).__name__}"
    return type(node).__name__


def _walk(node: ast.AST) -> int:
    """Check `node` against the grammar; returns a bound on its magnitude in bits (symbols taken at 2**64)."""
    kind = type(node)
    if kind is ast.Constant:
        return _int(node)
    if kind is ast.Name:
        check_symbol_name(node.id)
        return _SYMBOL_BITS
    if kind is ast.BinOp:
        if type(node.op) is ast.Pow:
            base = _walk(node.left)
            return _bounded(max(1, base * _power(node.right)))
        if not isinstance(node.op, _BINOPS):
            raise ExprError(f"operator {type(node.op).__name__} (only + - * // % ** are allowed)")
        left, right = _walk(node.left), _walk(node.right)
        if type(node.op) is ast.Mult:
            return _bounded(left + right)
        if isinstance(node.op, (ast.Add, ast.Sub)):
            return _bounded(max(left, right) + 1)
        return max(left, right)
    if kind is ast.UnaryOp:
        if not isinstance(node.op, _UNARY):
            raise ExprError(f"operator {type(node.op).__name__} (only unary + and - are allowed)")
        return _walk(node.operand)
    if kind is ast.Call:
        return _call(node)
    raise ExprError(f"{kind.__name__} is not part of a size expression")


def check_expr(text: object) -> None:
    """Raise ExprError unless `text` is a size expression in the grammar above. Nothing is evaluated."""
    if not isinstance(text, str):
        raise ExprError(f"expression is a {type(text).__name__}, not a string")
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ExprError(f"expression does not parse ({type(e).__name__})") from None
    body = tree.body
    is_condition = (type(body) is ast.Name and body.id in _TRUTH) or (
        type(body) is ast.Call and type(body.func) is ast.Name and body.func.id in _RELATIONS | _LOGIC)
    try:
        _condition(body) if is_condition else _walk(body)
    except RecursionError:
        raise ExprError("expression nested too deeply") from None
