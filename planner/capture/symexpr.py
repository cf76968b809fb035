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
"""

from __future__ import annotations

import ast
import re

__all__ = ["MAX_EXPR_CHARS", "SYMBOL_NAME", "ExprError", "check_expr", "check_symbol_name"]

MAX_EXPR_CHARS = 10_000
"""Longest expression string accepted (torch writes a few hundred characters at most)."""
MAX_INT_DIGITS = 20
"""An integer literal has at most this many digits (sizes fit in 64 bits)."""
SYMBOL_NAME = re.compile(r"[a-z]{1,8}[0-9]{1,12}")
"""torch's size symbols: a short prefix and a number (s0, u3, s77); never a sympy constant (E, I, S, pi)."""

_FUNCTIONS = {"Add", "Mul", "Mod", "Max", "Min", "FloorDiv", "PythonMod", "CleanDiv"}
_TWO_ARGS = {"Mod", "FloorDiv", "PythonMod", "CleanDiv"}
MAX_POWER = 64
"""`Pow(x, n)` (torch writes `Pow(s70, Integer(2))` for a square) only with a literal n in 0..MAX_POWER."""
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
_UNARY = (ast.USub, ast.UAdd)
_SYMBOL_ASSUMPTIONS = {"integer", "positive", "nonnegative", "negative", "nonpositive", "real", "finite"}


class ExprError(ValueError):
    """An expression string outside the grammar; the message says what was found."""


def check_symbol_name(name: object) -> None:
    if not isinstance(name, str) or not SYMBOL_NAME.fullmatch(name):
        raise ExprError(f"symbol name {str(name)[:40]!r} is not a size symbol (like s0 or u3)")


def _int(node: ast.AST) -> None:
    if type(node) is not ast.Constant or type(node.value) is not int:
        raise ExprError(f"{type(node).__name__} where an integer literal belongs")
    if len(str(abs(node.value))) > MAX_INT_DIGITS:
        raise ExprError(f"an integer of more than {MAX_INT_DIGITS} digits")


def _symbol_call(node: ast.Call) -> None:
    if len(node.args) != 1 or type(node.args[0]) is not ast.Constant or not isinstance(node.args[0].value, str):
        raise ExprError("Symbol(...) takes exactly one name string")
    check_symbol_name(node.args[0].value)
    for kw in node.keywords:
        if kw.arg not in _SYMBOL_ASSUMPTIONS or type(kw.value) is not ast.Constant or type(kw.value.value) is not bool:
            raise ExprError(f"Symbol(...) keyword {str(kw.arg)[:20]!r} is not a True/False size assumption")


def _power(node: ast.AST) -> None:
    """An exponent: a literal integer in 0..MAX_POWER, bare or as Integer(n) (a huge one would hang sympy)."""
    if type(node) is ast.Call and type(node.func) is ast.Name and node.func.id == "Integer" and len(node.args) == 1:
        node = node.args[0]
    if type(node) is not ast.Constant or type(node.value) is not int or not 0 <= node.value <= MAX_POWER:
        raise ExprError(f"an exponent other than an integer from 0 to {MAX_POWER}")


def _walk(node: ast.AST) -> None:
    kind = type(node)
    if kind is ast.Constant:
        _int(node)
    elif kind is ast.Name:
        check_symbol_name(node.id)
    elif kind is ast.BinOp:
        if type(node.op) is ast.Pow:
            _walk(node.left)
            _power(node.right)
            return
        if not isinstance(node.op, _BINOPS):
            raise ExprError(f"operator {type(node.op).__name__} (only + - * // % ** are allowed)")
        _walk(node.left)
        _walk(node.right)
    elif kind is ast.UnaryOp:
        if not isinstance(node.op, _UNARY):
            raise ExprError(f"operator {type(node.op).__name__} (only unary + and - are allowed)")
        _walk(node.operand)
    elif kind is ast.Call:
        name = node.func.id if type(node.func) is ast.Name else None
        if name == "Symbol":
            _symbol_call(node)
        elif name == "Integer":
            if len(node.args) != 1 or node.keywords:
                raise ExprError("Integer(...) takes exactly one integer")
            arg = node.args[0]
            if type(arg) is ast.UnaryOp and type(arg.op) is ast.USub:
                arg = arg.operand
            _int(arg)
        elif name == "Pow":
            if len(node.args) != 2 or node.keywords:
                raise ExprError("Pow(...) takes a base and an exponent")
            _walk(node.args[0])
            _power(node.args[1])
        elif name in _FUNCTIONS:
            if node.keywords or not node.args or (name in _TWO_ARGS and len(node.args) != 2):
                raise ExprError(f"{name}(...) with the wrong arguments")
            for arg in node.args:
                _walk(arg)
        else:
            shown = name if name is not None else type(node.func).__name__
            raise ExprError(f"call of {shown[:40]!r} (only {', '.join(sorted(_FUNCTIONS | {'Integer', 'Pow', 'Symbol'}))})")
    else:
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
    try:
        _walk(tree.body)
    except RecursionError:
        raise ExprError("expression nested too deeply") from None
