"""A lesson's code cells, run in a test as the notebook runs them: the one cell that contains a marker, in the test's
own globals, or only some of that cell's top-level definitions."""

import ast

import nbformat

from .conftest import ROOT


class Cells:
    """The code cells of ``notebooks/<notebook>``."""

    def __init__(self, notebook: str):
        self.notebook = notebook
        self.lesson = notebook[:2]

    def code(self, marker: str) -> str:
        """The source of the one code cell that contains ``marker``."""
        nb = nbformat.read(ROOT / "notebooks" / self.notebook, as_version=4)
        found = [c.source for c in nb.cells if c.cell_type == "code" and marker in c.source]
        assert len(found) == 1, f"{len(found)} code cells of lesson {self.lesson} contain {marker!r}"
        return found[0]

    def run(self, scope: dict, *markers: str) -> dict:
        """Run the cells that contain ``markers``, in order, in ``scope`` (the notebook's globals)."""
        for marker in markers:
            exec(compile(self.code(marker), f"<lesson {self.lesson}: {marker}>", "exec"), scope)
        return scope

    def define(self, scope: dict, marker: str, *names: str) -> dict:
        """Run only the top-level definitions of ``names`` (functions, classes, assignments) of the cell with
        ``marker``."""
        tree = ast.parse(self.code(marker))
        kept = [node for node in tree.body if getattr(node, "name", None) in names or any(
            isinstance(t, ast.Name) and t.id in names for t in getattr(node, "targets", []))]
        assert {getattr(n, "name", None) or n.targets[0].id for n in kept} == set(names)
        exec(compile(ast.Module(kept, type_ignores=[]), f"<lesson {self.lesson}: {marker}>", "exec"), scope)
        return scope
