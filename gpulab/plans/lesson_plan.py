"""A lesson's plan for one card: the sizes its cells read, why each, the seconds each part is expected to take, the
memory the largest experiment needs, the conditions that keep each demonstration in the regime it shows, and what the
card lacks. The lesson prints it first; ``gpulab plan`` prints the same without a GPU."""

import dataclasses
import math
from dataclasses import dataclass, field

from .card import Card


@dataclass(frozen=True)
class Part:
    """A part of the lesson and the seconds it is expected to take on the card, with how that was worked out."""

    name: str
    seconds: float
    basis: str


@dataclass(frozen=True)
class Regime:
    """A condition a demonstration needs on this card to show what it teaches (``holds``), worked out from the card's
    rates and the sizes chosen, and its numbers (``detail``)."""

    name: str
    holds: bool
    detail: str


@dataclass(frozen=True)
class LessonPlan:
    """What one lesson runs on one card. Read a size as ``plan.name`` (or ``plan["name"]``)."""

    lesson: str
    title: str
    card: Card
    quick: bool
    sizes: dict
    why: dict = field(default_factory=dict)  # size name -> why this value on this card
    parts: tuple[Part, ...] = ()
    memory_gb: float = 0.0  # what the largest experiment holds on the device, predicted
    regimes: tuple[Regime, ...] = ()
    target_minutes: float = math.inf  # what the lesson is sized to on this card
    features: tuple[str, ...] = ()  # what of ``card.FEATURES`` the lesson uses: a card that lacks one is told so

    def __getattr__(self, name):
        sizes = self.__dict__.get("sizes", {})
        if name in sizes:
            return sizes[name]
        raise AttributeError(f"lesson {self.__dict__.get('lesson')}'s plan has no size {name!r}: it has "
                             f"{', '.join(sizes)}")

    def __getitem__(self, name):
        return self.sizes[name]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def minutes(self) -> float:
        """The lesson's expected minutes on this card (NaN in quick mode: its sizes are fixed, not planned)."""
        return math.nan if self.quick else self.seconds / 60

    def as_dict(self) -> dict:
        """The plan as JSON-ready values (``gpulab plan --json``)."""
        return {
            "lesson": self.lesson, "title": self.title, "card": self.card.name, "cpu_cores": self.card.cpu_cores,
            "quick": self.quick, "minutes": None if self.quick else round(self.minutes, 2),
            "target_minutes": None if math.isinf(self.target_minutes) else self.target_minutes,
            "memory_gb": round(self.memory_gb, 3), "usable_gb": round(self.card.usable_gb(), 3),
            "sizes": {k: _jsonable(v) for k, v in self.sizes.items()}, "why": dict(self.why),
            "parts": [{"part": p.name, "seconds": round(p.seconds, 1), "basis": p.basis} for p in self.parts],
            "regimes": [{"regime": r.name, "holds": bool(r.holds), "detail": r.detail} for r in self.regimes],
            "lacks": self.card.lacks(self.features),
        }

    def __str__(self) -> str:
        """The plan as the lesson prints it: the card, the minutes, what the card lacks, the sizes chosen for it and
        why, and any demonstration this card cannot keep in its regime; ``details()`` gives the rest."""
        chosen = [k for k in self.sizes if k in self.why and self.sizes[k] is not None]
        lines = self._head()
        if chosen:
            lines.append("Sizes chosen for this card, and why:")
            lines += [f"  {k}: {_shown(k, self.sizes[k])} — {self.why[k]}" for k in chosen]
        failing = [r for r in self.regimes if not r.holds]
        if failing:
            lines.append("Out of the regime it demonstrates on this card (that demonstration may show less):")
            lines += [f"  - {r.name}: {r.detail}" for r in failing]
        lines.append("Every size, each part's seconds and each demonstration's regime: print(plan.details())")
        return "\n".join(lines)

    def details(self) -> str:
        """The whole plan (``gpulab plan`` prints it): every size, the seconds of each part and how they were worked
        out, each demonstration's regime."""
        lines = self._head()
        if not self.quick:
            lines.append("Rates: the datasheet's, times the share of it an H100 reached in the course's runs.")
        width = max(map(len, self.sizes), default=0)
        lines.append("Sizes:")
        lines += [f"  {k:<{width}}  {_shown(k, v)}" + (f"  ({self.why[k]})" if k in self.why else "")
                  for k, v in self.sizes.items()]
        if not self.quick and self.parts:
            lines.append("Minutes, part by part:")
            lines += [f"  {p.seconds:6.0f} s  {p.name}: {p.basis}" for p in self.parts]
        if self.regimes:
            lines.append("Each demonstration's regime on this card:")
            lines += [f"  {'yes' if r.holds else 'NO '}  {r.name}: {r.detail}" for r in self.regimes]
        return "\n".join(lines)

    def _head(self) -> list[str]:
        """The card, the mode or the minutes and memory, and what the card lacks."""
        lines = [f"Lesson {self.lesson} · {self.title}: planned for {self.card}"]
        if self.quick and self.card.is_gpu:
            lines.append("Quick mode (CI or GPULAB_QUICK is set): small sizes and few repetitions for a short run, not "
                         "this card's full plan; a few of them follow what the card has (its precisions, its L2 "
                         "cache, its rates). No minutes are planned.")
        elif self.quick:
            lines.append("Quick mode (no GPU here, or CI or GPULAB_QUICK is set): the small sizes CI uses, few "
                         "repetitions. No minutes are planned.")
        else:
            lines.append(f"About {self.minutes:.1f} min of running on this card (target {self.target_minutes:g}); "
                         f"the largest experiment holds about {self.memory_gb:.1f} GB of {self.card.memory_gb:.0f}.")
        lacks = self.card.lacks(self.features)
        if lacks:
            lines.append("What this card lacks, and what that changes:")
            lines += [f"  - {item}" for item in lacks]
        return lines


def _jsonable(value):
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy or torch scalar
        value = value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


UNITS = {"_mib": " MiB", "_mb": " MB", "_gb": " GB", "_s": " s"}  # a size's name ends in its unit (or in _bytes)


def _shown(name: str, value) -> str:
    """A size as a learner reads it: bytes in KiB, MiB or GiB, the unit its name ends in, a long list by its ends,
    the fields of a dict or a dataclass without those that are None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return ", ".join(f"{k} {_shown(str(k), v)}" for k, v in value.items() if v is not None)
    is_bytes = name.endswith("_bytes")
    unit = "" if is_bytes else next((u for end, u in UNITS.items() if name.endswith(end)), "")
    if isinstance(value, (list, tuple)):
        items = [_number(v, is_bytes) for v in value]
        if len(items) > 6:
            return f"{items[0]} … {items[-1]}{unit} ({len(items)} values)"
        return f"[{', '.join(items)}]{unit}"
    return _number(value, is_bytes) + (unit if isinstance(value, (int, float)) and not isinstance(value, bool) else "")


def _number(value, is_bytes: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if is_bytes:
        return _bytes(value)
    if isinstance(value, int):
        return f"{value:,}" if value >= 100_000 else str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"  # a rate of 1772.27 images/s reads 1,772


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:g} B"


FAST_FP16_TFLOPS = 300.0  # an A100's dense fp16 peak is 312: from there on a card runs the course at its fastest


def target_minutes(card: Card, *, long: bool = False) -> float:
    """The minutes a lesson is sized to on ``card``: 2 on an A100-class card or faster (3 for the ``long`` lessons, the
    capstone and the GPT's waterfall), 5 on a smaller one such as Colab's T4 (6): its sizes stay large enough to show
    each point, and take longer there."""
    fast = card.is_gpu and card.sheet.tflops.get("fp16", 0) >= FAST_FP16_TFLOPS
    return (3.0 if long else 2.0) if fast else (6.0 if long else 5.0)
