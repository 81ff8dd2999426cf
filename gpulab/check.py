"""Exercise checks, learntools-style: ``q1.check(answer)``, ``q1.hint()``, ``q1.solution()``.

A checker function receives the learner's answer and returns a short confirmation, or raises
``Wrong("what is wrong")``. An answer left as ``____`` (or a function that raises
NotImplementedError) counts as not attempted. ``check()`` never raises: it prints a friendly
message, and records the result for ``progress()``. It also keeps the answers it was given: ``gpulab grade``
checks them again, with the installed checkers, in a cell of its own at the end of the notebook.
"""

import linecache
import traceback
from collections.abc import Callable
from dataclasses import dataclass

CORRECT, WRONG, NOT_ATTEMPTED = "correct", "wrong", "not attempted"


class _Blank:
    """The placeholder an exercise leaves for the learner to fill in."""

    def __repr__(self) -> str:
        return "____"


____ = _Blank()


class Wrong(Exception):
    """Raised by a checker: the message tells the learner what is wrong."""


class NotAttempted(Exception):
    """Raised by a checker when the answer is still a placeholder."""


@dataclass
class Result:
    lesson: str
    question: str
    points: int
    status: str
    message: str

    @property
    def earned(self) -> int:
        return self.points if self.status == CORRECT else 0


_FILL_IN = "replace the ____ (or the `# YOUR CODE HERE` part) with your answer, then run this cell again."
_FILL_IN_BODY = "your function still raises NotImplementedError: fill in its body, then run this cell again."

_results: dict[tuple[str, str], Result] = {}
_registry: dict[str, list["Question"]] = {}


@dataclass
class Question:
    """One graded question of a lesson's exercise notebook."""

    lesson: str
    number: int
    title: str
    checker: Callable[..., str]
    hint_text: str
    solution_text: str
    points: int = 1

    def __post_init__(self):
        self.last: Result | None = None  # the latest check's result
        _registry.setdefault(self.lesson, [])
        _registry[self.lesson] = [q for q in _registry[self.lesson] if q.number != self.number] + [self]

    @property
    def name(self) -> str:
        return f"q{self.number}"

    def check(self, *answers) -> None:
        """Check the answer(s) and say what is right or wrong."""
        self._answers = answers  # what `gpulab grade` checks again at the end of the notebook
        self._record(*self._judge(answers))

    def _judge(self, answers: tuple) -> tuple[str, str]:
        """(status, message) for these answers; never raises for an error in the learner's code."""
        try:
            if any(isinstance(a, _Blank) for a in answers):
                raise NotAttempted
            return CORRECT, self.checker(*answers) or "well done."
        except NotAttempted:
            return NOT_ATTEMPTED, _FILL_IN
        except NotImplementedError:
            return NOT_ATTEMPTED, _FILL_IN_BODY
        except Wrong as err:
            return WRONG, str(err)
        except Exception as err:  # the learner's code failed inside the check: say where, briefly
            frame = traceback.extract_tb(err.__traceback__)[-1]
            return WRONG, f"your code raised {type(err).__name__}: {err} (line {frame.lineno} of {frame.name})"

    def hint(self) -> None:
        _show(f"💡 **Hint ({self.name}):** {self.hint_text}")

    def solution(self) -> None:
        _show(f"**Solution ({self.name}):**\n\n```python\n{self.solution_text.strip()}\n```")

    def shown(self, name: str, **scope):
        """The function ``name`` that the shown solution defines, as a notebook cell would define it: run with
        ``scope`` as its globals, its source kept where ``inspect.getsource`` finds it (as IPython keeps cells),
        so that checks which send a function's source to another process can run it."""
        filename = f"<solution {self.lesson} {self.name}>"
        linecache.cache[filename] = (len(self.solution_text), None, self.solution_text.splitlines(True), filename)
        scope.setdefault("__name__", "__main__")
        exec(compile(self.solution_text, filename, "exec"), scope)
        return scope[name]

    def _record(self, status: str, message: str) -> None:
        result = Result(self.lesson, self.name, self.points, status, message)
        _results[(self.lesson, self.name)] = self.last = result
        icon = {CORRECT: "✅ Correct", WRONG: "❌ Not yet", NOT_ATTEMPTED: "✏️ Not attempted yet"}[status]
        _show(f"**{icon} ({self.name}, {self.title}):** {message}")


def questions(lesson: str) -> list[Question]:
    """The questions of a lesson, importing its question module ``gpulab.questions.lessonNN``."""
    import importlib

    importlib.import_module(f"gpulab.questions.lesson{lesson}")
    return sorted(_registry.get(lesson, []), key=lambda q: q.number)


def progress(lesson: str):
    """A table of this lesson's questions: points and status so far (a pandas DataFrame)."""
    import pandas as pd

    rows = []
    for q in questions(lesson):
        r = _results.get((lesson, q.name))
        rows.append({"question": q.name, "title": q.title, "points": r.earned if r else 0,
                     "of": q.points, "status": r.status if r else NOT_ATTEMPTED})
    return pd.DataFrame(rows).set_index("question")


def expect_close(value, expected: float, *, rel: float = 0.1, what: str = "the value", unit: str = "") -> str:
    """Raise Wrong unless ``value`` is a number within ``rel`` of ``expected``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise Wrong(f"{what} should be a number, got {type(value).__name__}")
    value = float(value)
    if not abs(value - expected) <= rel * abs(expected):
        raise Wrong(f"expected {what} of {expected:.4g} {unit} ± {rel:.0%}, got {value:.4g} {unit}".replace("  ", " "))
    return f"{what} = {value:.4g} {unit}".strip()


def _show(markdown: str) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(markdown))
            return
    except ImportError:
        pass
    print(markdown.replace("**", ""))
