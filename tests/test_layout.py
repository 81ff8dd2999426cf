"""The package's layout shows its architecture: the learner's API at the top (what the notebooks import), the
exercise checks' machinery in ``questions/``, the instructor's grading in ``grader/`` and the command-line tools in
``commands/``. Each folder imports only from its own audience and the ones below it, nothing imports in a cycle, and
ending a process tree is written once (``gpulab.processes``)."""

import ast
from pathlib import Path

import nbformat

from .conftest import ROOT

PACKAGE = ROOT / "gpulab"
# What each audience may import, besides itself: the learner's API imports nothing above it.
MAY_IMPORT = {"learner": {"learner"}, "questions": {"learner", "questions"}, "grader": {"learner", "grader"},
              "commands": {"learner", "questions", "grader", "commands"}}
FOLDERS = {"questions": "questions", "grader": "grader", "commands": "commands"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def audience(module: str) -> str:
    parts = module.split(".")
    return FOLDERS.get(parts[1], "learner") if len(parts) > 1 else "learner"


def imports(path: Path) -> set[str]:
    """The gpulab modules ``path`` imports (relative imports resolved; ``from . import x`` as the module x)."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            if not target.startswith("gpulab"):
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _exists(candidate) else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gpulab")}
    return found - {module}


def _exists(module: str) -> bool:
    path = ROOT / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_each_audience_imports_only_its_own_and_those_below_it():
    wrong = [f"{m} ({audience(m)}) imports {t} ({audience(t)})" for m, p in MODULES.items() for t in imports(p)
             if audience(t) not in MAY_IMPORT[audience(m)]]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_in_a_cycle():
    graph = {m: {t for t in imports(p) if t in MODULES} for m, p in MODULES.items()}
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*trail, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*trail, node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, " -> ".join(cycle)


def test_ending_a_process_tree_is_written_once():
    """Killing a process group, waiting for killed processes or walking a process's children happens in
    gpulab.processes only; everything that ends a tree calls it."""
    words = ("killpg", "wait_procs", "children(recursive=True)")
    elsewhere = [f"{p.relative_to(ROOT)}: {w}" for p in PACKAGE.rglob("*.py") if p.name != "processes.py"
                 for w in words if w in p.read_text()]
    assert not elsewhere, elsewhere


def test_what_the_notebooks_import_is_the_learners_api():
    """Moving the tools into folders left every name a lesson, solution or exercise imports where it was."""
    for path in sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb")]):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            for node in ast.walk(ast.parse(_python(cell.source))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpulab"):
                    names = [f"{node.module}.{a.name}" for a in node.names]
                    missing = [n for n in names if not (_exists(n) or _attribute(node.module, n.split(".")[-1]))]
                    assert not missing, f"{path.name} imports {missing}"


def _python(source: str) -> str:
    """A cell's source without IPython's magics and shell lines."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _attribute(module: str, name: str) -> bool:
    import importlib

    return hasattr(importlib.import_module(module), name)


def test_every_module_of_the_package_imports():
    """The grader fingerprints the modules a fresh process can import and leaves the others out: a module broken by a
    move would go unchecked there, so it must fail here."""
    import importlib

    broken = {}
    for name in sorted(MODULES):
        try:
            importlib.import_module(name)
        except Exception as err:  # every failure is the finding
            broken[name] = f"{type(err).__name__}: {err}"
    assert not broken, broken
