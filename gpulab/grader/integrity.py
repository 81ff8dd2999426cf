"""Is the checking machinery the installed package's own? gpulab's code, the grader's report, the installation.

``gpulab grade`` compares ``fingerprint`` computed in a fresh Python process with the same function run in a
graded notebook's kernel, where ``serve_report`` (started with the kernel, before any cell of the notebook)
writes the grader's report to a file descriptor of its own. ``Installation`` watches the files a later
notebook's kernel would run, from one notebook to the next.
"""

import base64
import hashlib
import os
import site
import sys
import time
from pathlib import Path

# The grader's last cell. It runs no code: the report is written by ``serve_report``'s hook once it has run, so
# that no name of the notebook's namespace (``print``, ``sys``, ``json``, ``__builtins__``) is looked up.
REPORT_CELL = "# gpulab grade: the grader's own last cell; its report is written once this cell has run"


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


def grade_report(lesson: str, modules: list[str]) -> dict:
    """In a graded kernel: every answer the notebook gave to ``qN.check`` checked again with the installed
    checkers, the fingerprint of gpulab's code, what checking changed in it, and questions with a result but no
    answer (recorded without running the checks)."""
    import importlib

    from gpulab import check

    module = importlib.import_module("gpulab.questions.lesson" + lesson)
    before = fingerprint(modules)
    results, unchecked = {}, []
    for q in sorted((q for q in vars(module).values() if type(q) is check.Question), key=lambda q: q.number):
        answers = vars(q).get("_answers")
        if answers is None:
            if q.last is not None or (lesson, q.name) in check._results:
                unchecked.append(q.name)
            continue
        status, message = check.Question._judge(q, answers)
        results[q.name] = {"status": status, "message": str(message)}
    after = fingerprint(modules)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return {"fingerprint": before, "changed": changed, "results": results, "unchecked": unchecked}


def serve_report(fd: int, lesson: str, modules: list[str]) -> None:
    """Run in a graded kernel before any cell of the notebook: read this run's tag from ``fd`` (a socket only
    the kernel inherited from the grader's worker), keep ``fd`` from the processes the notebook starts, and write
    ``tag + JSON`` there once the grader's last cell (``REPORT_CELL``) has run.

    The grader runs this module's source in a namespace of its own, with a copy of the builtins, so nothing it
    calls is looked up where the notebook can replace it by name; the report never passes through the notebook's
    ``print`` or ``sys.stdout``.
    """
    import json

    from IPython import get_ipython

    write, fstat, encode = os.write, os.fstat, json.JSONEncoder().encode
    tag = b""
    while not tag.endswith(b"\n") and len(tag) < 256:
        tag += os.read(fd, 256) or b"\n"
    os.set_inheritable(fd, False)
    channel = fstat(fd)

    def report(result) -> None:
        if result.info.raw_cell != REPORT_CELL:
            return
        try:
            body = {"report": grade_report(lesson, modules)}
        except BaseException as err:  # the notebook broke gpulab or Python: the grader says so
            body = {"error": f"{type(err).__name__}: {err}"}
        now = fstat(fd)
        if (now.st_dev, now.st_ino) != (channel.st_dev, channel.st_ino):
            return  # the notebook put something else behind the descriptor: no report, and zero points
        data = tag.strip() + encode(body).encode() + b"\n"
        while data:
            data = data[write(fd, data):]

    get_ipython().events.register("post_run_cell", report)


def python_path() -> list[str]:
    """The folders a new Python process imports from (site directories included)."""
    return [p for p in dict.fromkeys([*sys.path, *site.getsitepackages(), site.getusersitepackages()]) if p]


def watched_folders() -> list[str]:
    """The folders whose files a new kernel runs or reads as it starts: the import path, the interpreter's folder,
    Jupyter's configuration and kernel specs, and IPython's system-wide configuration."""
    from IPython.core.application import SYSTEM_CONFIG_DIRS
    from jupyter_core.paths import jupyter_config_path, jupyter_path

    return [*python_path(), os.path.dirname(os.path.realpath(sys.executable)), *jupyter_config_path(),
            *jupyter_path("kernels"), *SYSTEM_CONFIG_DIRS, os.path.join(sys.prefix, "etc", "ipython")]


class InstallationChanged(RuntimeError):
    """Installed files differ from what their packages installed (their RECORD); the message says which."""


class Installation:
    """The files a later notebook's kernel would run, watched from one notebook to the next.

    Every file under ``folders`` and every file that an installed distribution lists in its RECORD is listed with
    its size, modification and change times, inode and mode: ``changes()`` says which of them differ from the start
    (a write changes a file's ctime, which no program can set back). As watching starts, every file a RECORD lists
    with a hash is hashed and compared with it (InstallationChanged when one differs); that is skipped when the
    listing is exactly the one last verified on this machine. ``seconds`` is the time all this took.
    """

    def __init__(self, folders: list[str]):
        start = time.perf_counter()
        self.folders = sorted({os.path.normpath(os.path.abspath(f)) for f in folders if os.path.isdir(f)})
        outermost = [f for f in self.folders if not _inside(f, [g for g in self.folders if g != f])]
        self.record = _record(outermost)  # not the copies vendored in a package (setuptools/_vendor is on the path)
        self.files = [p for p in self.record if not _inside(p, self.folders)]
        self.parents = sorted({os.path.dirname(p) for p in self.files})
        self.start = self._listing()
        self._verify()
        self.seconds = time.perf_counter() - start

    def changes(self) -> list[str]:
        """Files added, removed or written since watching started."""
        start = time.perf_counter()
        now = self._listing()
        self.seconds += time.perf_counter() - start
        return sorted(p for p in self.start.keys() | now.keys() if self.start.get(p) != now.get(p))

    def _listing(self) -> dict[str, tuple]:
        found = {}
        for folder in self.folders:
            _walk(folder, found, skip=set(self.folders))
        for folder in self.parents:
            _walk(folder, found, skip=None)
        for path in self.files:
            found[path] = _stat(path)
        return found

    def _verify(self) -> None:
        """Hash every file a RECORD lists with a hash; InstallationChanged when one differs. Skipped when this very
        listing (paths, sizes, times, inodes) was verified before on this machine."""
        hashed = {p: h for p, (h, _) in self.record.items() if h}
        listing = "\n".join(f"{p} {self.start.get(p)} {h}" for p, h in sorted(hashed.items()))
        key = hashlib.sha256(listing.encode("utf-8", "surrogateescape")).hexdigest()
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpulab" / "verified-installations"
        try:
            verified = cache.read_text().split()
        except OSError:
            verified = []
        if key in verified:
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            digests = dict(zip(hashed, pool.map(_record_digest, hashed.items())))
        wrong = sorted(p for p, h in hashed.items() if digests[p] != h)
        if wrong:
            shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
            names = " ".join(sorted({self.record[p][1] for p in wrong}))
            raise InstallationChanged(f"{len(wrong)} installed file(s) differ from what their package installed "
                                      f"({shown}): reinstall with pip install --force-reinstall {names}")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text("\n".join([*verified[-7:], key]) + "\n")
        except OSError:
            pass  # no cache: the next run hashes again


def _record(folders: list[str]) -> dict[str, tuple[str | None, str]]:
    """``{path: ("algorithm=digest" or None, distribution)}`` for every file a distribution lists in its RECORD."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions(path=folders):
        name = dist.metadata["Name"] or dist.name
        for file in dist.files or []:
            path = os.path.normpath(os.path.abspath(dist.locate_file(file)))
            found[path] = (f"{file.hash.mode}={file.hash.value}" if file.hash else None, name)
    return found


def _record_digest(item: tuple[str, str]) -> str | None:
    """The file's digest, written as its RECORD writes it ("sha256=urlsafe-base64"); None when unreadable."""
    path, expected = item
    algorithm = expected.split("=", 1)[0]
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, algorithm).digest()
    except (OSError, ValueError):
        return None
    return f"{algorithm}={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"


def _walk(folder: str, found: dict, skip: set | None) -> None:
    """Add every file (and link) in ``folder`` to ``found``, without following links; with ``skip``, also those in
    its sub-folders, except the folders in ``skip`` (walked on their own) and other Pythons' site-packages (a
    venv's base Python's)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                found[entry.path] = _key(entry.stat(follow_symlinks=False))
            elif skip is not None and entry.path not in skip and entry.name not in ("site-packages", "dist-packages"):
                _walk(entry.path, found, skip)
        except OSError:
            continue


def _stat(path: str) -> tuple | None:
    try:
        return _key(os.lstat(path))
    except OSError:
        return None


def _key(stat: os.stat_result) -> tuple:
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_mode


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def reference() -> dict:
    """What a fresh Python process sees: the package's folder, the folders to watch, every gpulab module, their
    fingerprint and each lesson's questions. Compiles the package first, so that kernels find its bytecode. Run as
    ``python -m gpulab.grader.integrity``, which prints this as JSON."""
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
    return {"package": str(package), "watched": [str(package), *watched_folders()], "modules": modules,
            "fingerprint": fingerprint(modules), "lessons": lessons}


if __name__ == "__main__":
    import json

    sys.modules.setdefault("rfc3987_syntax", None)  # as grade_worker._without_iri_checker: gpulab's modules load 1.5 s sooner
    print(json.dumps(reference()))
