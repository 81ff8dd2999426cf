"""A learner's function as source code that defines it again in a fresh Python process.

Checks that time or distribute a learner's function run it in processes of their own (where it cannot reach
the checker's clock, baseline or expected values). ``source_of(fn)`` writes what that process needs: the
modules and imported names the function uses, plain constants, the notebook's own functions and classes it
calls (their source, recursively), then the function itself. Anything else is named in a ``Wrong`` that says
how to make the function self-contained.
"""

import ast
import builtins
import inspect
import sys
import textwrap
import types

import torch

from ..check import Wrong


def source_of(fn) -> str:
    """Source that defines ``fn`` (under its own name) and what it uses from its module."""
    if not isinstance(fn, types.FunctionType):
        raise Wrong(f"pass a function defined with `def`, got {type(fn).__name__}")
    lines: dict[str, str] = {}  # name → the line or definition that binds it, in dependency order
    _collect(fn, fn.__module__, lines, set())
    imports = [text for text in lines.values() if text.startswith(("import ", "from "))]
    rest = [text for text in lines.values() if not text.startswith(("import ", "from "))]
    return "\n".join(imports) + "\n\n" + "\n\n".join(rest) + "\n"


def left_blank(fn) -> bool:
    """Whether ``fn``'s body is only ``raise NotImplementedError`` (an exercise not attempted yet)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return False
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]  # docstrings
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc))


def _collect(obj, home: str, lines: dict, seen: set) -> None:
    """Add what defines ``obj`` (a function or class of module ``home``) to ``lines``, its needs first."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if getattr(obj, "__closure__", None):
        raise Wrong(f"`{obj.__name__}` is defined inside another function: the check runs it in a fresh process, "
                    "so define it at the top level of a cell")
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        raise Wrong(f"the check runs `{obj.__name__}` in a fresh process and needs its source: define it with "
                    "`def` (or `class`) in a cell of the notebook") from None
    namespace = getattr(obj, "__globals__", None) or vars(sys.modules.get(obj.__module__, builtins))
    for name in sorted(_names_used(obj, source)):
        if name in lines or name == obj.__name__ or name not in namespace:
            continue
        value = namespace[name]
        if isinstance(value, (types.FunctionType, type)) and value.__module__ in (home, "__main__"):
            _collect(value, home, lines, seen)  # the notebook's own: its source travels
            if value.__name__ != name:
                lines[name] = f"{name} = {value.__name__}"
        else:
            lines[name] = _binding(name, value)
            if isinstance(value, (torch.dtype, torch.device)):
                lines.setdefault("torch", "import torch")
    lines[obj.__name__] = source.rstrip()


def _names_used(obj, source: str) -> set[str]:
    """The global names a function or class reads: names in its source that its code looks up globally
    (a local variable that shares a notebook global's name does not count)."""
    tree = ast.parse(source).body[0]
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    if isinstance(tree, ast.ClassDef):  # its bases, decorators and class-level statements, then its methods
        outside = [*tree.bases, *tree.keywords, *tree.decorator_list,
                   *(s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)))]
        direct = {n.id for part in outside for n in ast.walk(part) if isinstance(n, ast.Name)}
        codes = [m.__code__ for m in vars(obj).values() if hasattr(m, "__code__")]
    else:
        direct, codes = set(), [obj.__code__]
    looked_up = set()
    while codes:
        code = codes.pop()
        looked_up |= set(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names & (looked_up | direct)


def _binding(name: str, value) -> str:
    """The line that binds ``name`` to ``value`` in a fresh process: an import or a constant."""
    if isinstance(value, types.ModuleType):
        module = value.__name__
        return f"import {module}" if module == name else f"import {module} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and getattr(sys.modules.get(module), qualname, None) is value:
        return f"from {module} import {qualname}" + ("" if qualname == name else f" as {name}")
    if isinstance(value, torch.dtype):
        return f"{name} = {value!r}"
    if isinstance(value, torch.device):
        return f"{name} = torch.device({str(value)!r})"
    if _is_literal(value):
        return f"{name} = {value!r}"
    raise Wrong(f"your function uses `{name}` (a {type(value).__name__}) from elsewhere in the notebook; the check "
                "runs it in a fresh process, where only imports, functions, classes and plain constants travel: "
                f"create `{name}` inside the function, or pass what it holds as an argument")


def _is_literal(value) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value and type(ast.literal_eval(repr(value))) is type(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
