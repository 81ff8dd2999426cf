"""Is the checking machinery the installed package's own? Digests of gpulab's code and of its files.

``gpulab grade`` compares ``fingerprint`` computed in a fresh Python process with the same function run in
a graded notebook's kernel (the grader pastes its source into its own last cell), and hashes the installed
files before and after each notebook with ``digest_files``.
"""

import hashlib
import os
import site
import sys
from pathlib import Path


def fingerprint(module_names: list[str]) -> dict[str, str]:
    """``{"module:name": digest}`` for the code of each loaded module of ``module_names``.

    Covers functions (code, defaults, closures, globals), classes (every method), ``Question`` instances
    (fields and checker) and UPPER_CASE constants. Other module state changes while a notebook runs and is
    left out, and so are torch's own wrappers around a method (a function torch wraps counts as itself).
    Self-contained, so that its source can run as it is in another process.
    """
    import functools
    import hashlib
    import os
    import sys
    import types

    def plain(value, depth=0) -> str:
        if depth > 6:
            return "..."
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return f"{type(value).__name__}:{value!r}"
        if isinstance(value, (tuple, list)):
            return f"{type(value).__name__}[" + ",".join(plain(v, depth + 1) for v in value) + "]"
        if isinstance(value, (set, frozenset)):
            return f"{type(value).__name__}{{" + ",".join(sorted(plain(v, depth + 1) for v in value)) + "}"
        if isinstance(value, dict):
            items = sorted(plain(k, depth + 1) + ":" + plain(v, depth + 1) for k, v in value.items())
            return "dict{" + ",".join(items) + "}"
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial, type)):
            return digest(value, depth + 1)
        return f"object:{type(value).__module__}.{type(value).__qualname__}"

    def code(c) -> str:
        parts = [c.co_name, c.co_qualname, c.co_filename, str(c.co_firstlineno), c.co_code.hex(),
                 *c.co_names, "|", *c.co_varnames, "|", *c.co_freevars, "|", *c.co_cellvars, "|"]
        parts += [code(k) if isinstance(k, types.CodeType) else plain(k) for k in c.co_consts]
        return sha("\0".join(parts))

    def cells(closure) -> list:
        out = []
        for cell in closure or ():
            try:
                out.append(cell.cell_contents)
            except ValueError:  # an empty cell
                out.append(None)
        return out

    def library_wrapper(f) -> bool:  # e.g. torch.optim wraps a subclass's step() when it is first created
        torch = sys.modules.get("torch")
        home = os.path.dirname(getattr(torch, "__file__", None) or "\0") + os.sep
        return isinstance(getattr(f, "__wrapped__", None), types.FunctionType) and f.__code__.co_filename.startswith(home)

    def digest(obj, depth=0) -> str:
        while isinstance(obj, types.FunctionType) and library_wrapper(obj):
            obj = obj.__wrapped__
        if isinstance(obj, types.FunctionType):
            module = sys.modules.get(obj.__module__)
            home = module is not None and obj.__globals__ is vars(module)
            return sha("\0".join(["function", str(obj.__module__), obj.__qualname__, code(obj.__code__), str(home),
                                  plain(obj.__defaults__, depth), plain(obj.__kwdefaults__, depth),
                                  plain(cells(obj.__closure__), depth)]))
        if isinstance(obj, types.MethodType):
            return sha("method\0" + digest(obj.__func__, depth) + plain(obj.__self__, depth))
        if isinstance(obj, functools.partial):
            return sha("partial\0" + digest(obj.func, depth) + plain(obj.args, depth) + plain(obj.keywords, depth))
        if isinstance(obj, type):
            return sha("\0".join(["class", obj.__module__, obj.__qualname__, *(c.__qualname__ for c in obj.__mro__)]))
        wrapped = getattr(obj, "__wrapped__", None)  # functools.cache and friends
        if isinstance(wrapped, types.FunctionType):
            return sha(f"wrapped\0{type(obj).__qualname__}\0" + digest(wrapped, depth))
        return sha(plain(obj, depth))

    def question(q, genuine) -> str:
        fields = ("lesson", "number", "title", "points", "hint_text", "solution_text")
        extra = sorted(set(vars(q)) - {*fields, "checker", "last", "_answers"})
        return sha("\0".join(["question", str(type(q) is genuine), *(plain(getattr(q, f, None)) for f in fields),
                              digest(getattr(q, "checker", None)), plain(extra)]))

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]

    def ours(obj) -> bool:
        return str(getattr(obj, "__module__", None) or "").split(".")[0] == "gpulab"

    genuine = getattr(sys.modules.get("gpulab.check"), "Question", None)
    found = {}
    for name in module_names:
        module = sys.modules.get(name)
        if module is None:
            continue
        found[f"{name}:__file__"] = sha(plain(getattr(module, "__file__", None)))
        for key, value in list(vars(module).items()):
            if key.startswith("__"):
                continue
            if isinstance(value, type) and ours(value):
                found[f"{name}:{key}"] = digest(value)
                for attr, member in list(vars(value).items()):
                    if isinstance(member, property):
                        found[f"{name}:{key}.{attr}"] = sha("".join(digest(f) for f in (member.fget, member.fset)))
                    elif isinstance(member, (staticmethod, classmethod, types.FunctionType)):
                        found[f"{name}:{key}.{attr}"] = digest(getattr(member, "__func__", member))
            elif type(value).__name__ == "Question" and type(value).__module__ == "gpulab.check":
                found[f"{name}:{key}"] = question(value, genuine)
            elif callable(value) and ours(value):
                found[f"{name}:{key}"] = digest(value)
            elif key.isupper():
                found[f"{name}:{key}"] = sha(plain(value))
    return found


def python_path() -> list[str]:
    """The folders a new Python process imports from (site directories included)."""
    return [p for p in dict.fromkeys([*sys.path, *site.getsitepackages(), site.getusersitepackages()]) if p]


def digest_files(package: Path, path_dirs: list[str]) -> dict[str, str]:
    """``{what: sha256}`` for what a later notebook's kernel would run: every file of the package (sources and
    bytecode), and in each folder of ``path_dirs`` the names it holds and its top-level ``*.py`` and ``*.pth``
    files (start-up hooks such as ``sitecustomize.py``, and modules that would shadow installed ones).
    """
    found = {str(p): _sha_file(p) for p in _files_under(Path(package))}
    for directory in map(Path, path_dirs):
        if not directory.is_dir() or directory.resolve() == Path(package).resolve():
            continue
        names = sorted(os.listdir(directory))
        found[f"{directory}{os.sep}"] = hashlib.sha256("\n".join(names).encode("utf-8", "surrogateescape")).hexdigest()
        found |= {str(directory / n): _sha_file(directory / n) for n in names if n.endswith((".py", ".pth"))}
    return found


def _files_under(folder: Path) -> list[Path]:
    """Every file under ``folder``, not following links (a link loop must not hang the grader)."""
    return sorted(Path(root) / name for root, _, names in os.walk(folder) for name in names)


def _sha_file(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        return f"unreadable ({err.strerror})"


def reference() -> dict:
    """What a fresh Python process sees: the package's folder, the import path, every gpulab module, their
    fingerprint and each lesson's questions. Compiles the package first, so that a kernel's imports write
    nothing into it. Run as ``python -m gpulab.integrity``, which prints this as JSON."""
    import compileall
    import importlib
    import pkgutil

    import gpulab
    from gpulab import check

    package = Path(gpulab.__file__).parent
    compileall.compile_dir(package, quiet=2)
    modules = ["gpulab"]
    for info in pkgutil.walk_packages([str(package)], "gpulab."):
        try:
            importlib.import_module(info.name)
            modules.append(info.name)
        except Exception:  # a module that cannot be imported here cannot be in a kernel either
            continue
    lessons = {lesson: [[q.name, q.points] for q in check.questions(lesson)] for lesson in sorted(check._registry)}
    return {"package": str(package), "path": python_path(), "modules": modules,
            "fingerprint": fingerprint(modules), "lessons": lessons}


if __name__ == "__main__":
    import json

    print(json.dumps(reference()))
