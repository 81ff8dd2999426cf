"""`make test-versions`: the quick course on the torch versions the package declares, each in a venv of its own.

Two pairs of torch and torchvision are tried: the floor, the lowest versions pyproject.toml declares
(``torch>=2.7`` is torch 2.7.0, with torchvision 0.22.0), and the newest, the newest torch release for which the
package index also serves its torchvision (an index can hold a torch release days before its torchvision). Each gets
a venv under ``--out`` (``floor/venv``, ``newest/venv``) with the course installed into it, pip given the other
packages' pins from constraints.txt, so that only torch, torchvision and what they bring (Triton, CUDA's
libraries) differ from what CI runs. Then
``GPULAB_QUICK=1 gpulab course`` runs every lesson headless in that venv, into ``floor/course`` and
``newest/course``. The table at the end, also written to ``--out``/summary.csv, says for each pair which versions
ran, how many lessons passed, which failed, the minutes and the load average. Exit status 0 only when every lesson
passed on every pair.

Run as ``python -m gpulab.commands.torch_versions`` (``make test-versions``); ``--only floor`` runs one pair.
A venv is kept for the next run (pip then installs only what changed); ``make clean`` removes them (several GB each).
"""

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
VISION_OFFSET = 15  # torchvision 0.(N+15) is built for torch 2.N (0.21 for 2.6 ... 0.29 for 2.14)
COLUMNS = ["pair", "torch", "torchvision", "python", "passed", "lessons", "failed", "minutes", "date",
           "load_before", "load_after"]


@dataclass(frozen=True)
class Pair:
    """One pair to try: its name and the requirements pip is given for torch and torchvision."""
    name: str
    torch: str        # a requirement, e.g. "torch==2.7.0" or "torch==2.14.*"
    torchvision: str
    why: str


def vision_minor(torch_version: Version) -> int | None:
    """The torchvision minor release built for ``torch_version`` (None for a torch outside 2.x, whose rule we do
    not know)."""
    return torch_version.minor + VISION_OFFSET if torch_version.major == 2 else None


def declared_dependencies(pyproject: Path) -> list[str]:
    """pyproject.toml's [project] dependencies."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise SystemExit("reading pyproject.toml needs Python 3.11 or newer (tomllib)") from None
    return tomllib.loads(pyproject.read_text())["project"]["dependencies"]


def floor_pair(dependencies: list[str]) -> Pair:
    """The lowest torch and torchvision that ``dependencies`` (pyproject.toml's) declare, as exact pins."""
    floors = {}
    for text in dependencies:
        requirement = Requirement(text)
        if requirement.name in ("torch", "torchvision"):
            lows = [s.version for s in requirement.specifier if s.operator == ">="]
            if len(lows) != 1:
                raise ValueError(f"pyproject.toml should declare {requirement.name} with one '>=': {text!r}")
            floors[requirement.name] = Version(lows[0])
    torch, vision = floors["torch"], floors["torchvision"]
    if vision_minor(torch) != vision.minor or vision.major != 0:
        raise ValueError(f"pyproject.toml's floors do not pair: torchvision {vision} is not built for torch {torch} "
                         f"(torch 2.N's torchvision is 0.(N+{VISION_OFFSET}))")
    return Pair("floor", f"torch=={_three(torch)}", f"torchvision=={_three(vision)}",
                "the lowest versions pyproject.toml declares")


def newest_pair(torch_versions: list[str], vision_versions: list[str]) -> Pair:
    """The newest torch release whose torchvision is among ``vision_versions`` (what the index serves), as
    ``==2.N.*`` and ``==0.(N+15).*``: pip picks the newest patch releases that fit each other."""
    torches, visions = _releases(torch_versions), _releases(vision_versions)
    vision_minors = {v.minor for v in visions if v.major == 0}
    paired = [t for t in torches if vision_minor(t) in vision_minors]
    if not paired:
        raise ValueError(f"the index serves no torch 2.x with its torchvision (torch {torch_versions}, "
                         f"torchvision {vision_versions})")
    newest = max(paired)
    unpaired = sorted({f"{t.major}.{t.minor}" for t in torches if t > newest and (t.major, t.minor) !=
                       (newest.major, newest.minor)})
    why = "the newest torch the index serves with its torchvision"
    if unpaired:
        why += f" (torch {', '.join(unpaired)} has none there yet)"
    return Pair("newest", f"torch=={newest.major}.{newest.minor}.*", f"torchvision==0.{vision_minor(newest)}.*", why)


def _releases(versions: list[str]) -> list[Version]:
    """Final releases only: no pre-releases, no local builds such as 2.13.0+cpu (a variant, not a release)."""
    found = []
    for text in versions:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if not (version.is_prerelease or version.is_devrelease or version.local):
            found.append(version)
    return found


def _three(version: Version) -> str:
    return ".".join(str(part) for part in (*version.release, 0, 0)[:3])


def parse_index_versions(output: str) -> list[str]:
    """The versions `pip index versions NAME` printed ("Available versions: 2.15.0, 2.14.1, ...")."""
    match = re.search(r"^Available versions:\s*(.+)$", output, re.MULTILINE)
    if not match:
        raise ValueError(f"pip index versions printed no 'Available versions:' line:\n{output}")
    return [v.strip() for v in match.group(1).split(",") if v.strip()]


def index_versions(python: str, name: str) -> list[str]:
    """What the package index (as pip is configured here) serves of ``name`` for ``python``'s interpreter."""
    done = subprocess.run([python, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip index versions {name} failed:\n{done.stderr}")
    return parse_index_versions(done.stdout)


def install(pair: Pair, venv: Path, python: str, constraints: Path, log: Path) -> dict:
    """Make ``venv`` (unless it exists) and install the course into it with ``pair``'s torch and torchvision; the
    versions it then has."""
    with log.open("a") as out:
        if not (venv / "bin" / "python").exists():
            subprocess.run([python, "-m", "venv", str(venv)], check=True, stdout=out, stderr=subprocess.STDOUT)
        command = [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off", "-c", str(constraints),
                   pair.torch, pair.torchvision, "-e", f"{ROOT}[course]"]
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"pip could not install {pair.torch} {pair.torchvision} (see {log})")
    probe = "import sys, torch, torchvision; print(torch.__version__, torchvision.__version__, sys.version.split()[0])"
    versions = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True)
    return dict(zip(("torch", "torchvision", "python"), versions.stdout.split()))


def constraints_without_torch(source: Path, target: Path) -> Path:
    """constraints.txt less its torch and torchvision pins: CI's versions of everything else."""
    lines = [line for line in source.read_text().splitlines()
             if not re.match(r"(torch|torchvision)\s*==", line.strip(), re.IGNORECASE)]
    target.write_text("\n".join(lines) + "\n")
    return target


def course_in(venv: Path, out: Path, notebooks: list[Path]) -> pd.DataFrame:
    """`GPULAB_QUICK=1 gpulab course` with ``venv``'s gpulab; its summary table (lesson, status, seconds, error)."""
    env = {**os.environ, "GPULAB_QUICK": "1", "VIRTUAL_ENV": str(venv),
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([str(venv / "bin" / "gpulab"), "course", "--out", str(out), *map(str, notebooks)], cwd=ROOT,
                   env=env)
    summary = out / "summary.csv"
    if not summary.exists():
        raise RuntimeError(f"gpulab course wrote no {summary}")
    return pd.read_csv(summary, keep_default_na=False)


def result_row(pair: Pair, versions: dict, course: pd.DataFrame, seconds: float, load_before: float,
               load_after: float) -> dict:
    """One pair's line of the summary."""
    failed = course[course.status != "passed"]
    return {"pair": pair.name, **versions, "passed": len(course) - len(failed), "lessons": len(course),
            "failed": " ".join(failed.lesson), "minutes": round(seconds / 60, 1),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "load_before": round(load_before, 2), "load_after": round(load_after, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "torch-versions")
    parser.add_argument("--python", default=sys.executable, help="the Python each venv is made from (default: this one)")
    parser.add_argument("--only", choices=["floor", "newest"], help="try one pair only")
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    args = parser.parse_args(argv)
    notebooks = [p.resolve() for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))

    pairs = [floor_pair(declared_dependencies(ROOT / "pyproject.toml"))]
    if args.only != "floor":
        pairs.append(newest_pair(index_versions(args.python, "torch"), index_versions(args.python, "torchvision")))
    pairs = [p for p in pairs if args.only in (None, p.name)]
    args.out.mkdir(parents=True, exist_ok=True)
    constraints = constraints_without_torch(ROOT / "constraints.txt", args.out / "constraints.txt")

    rows = []
    for pair in pairs:
        folder = args.out / pair.name
        folder.mkdir(exist_ok=True)
        print(f"{pair.name}: {pair.torch} {pair.torchvision}, {pair.why}; installing into {folder / 'venv'} ...",
              flush=True)
        versions = install(pair, folder / "venv", args.python, constraints, folder / "install.log")
        print(f"{pair.name}: torch {versions['torch']}, torchvision {versions['torchvision']}, Python "
              f"{versions['python']}: the quick course into {folder / 'course'}", flush=True)
        load_before, start = os.getloadavg()[0], time.monotonic()
        course = course_in(folder / "venv", folder / "course", notebooks)
        rows.append(result_row(pair, versions, course, time.monotonic() - start, load_before, os.getloadavg()[0]))
        print(f"{pair.name}: {rows[-1]['passed']} of {rows[-1]['lessons']} lessons passed", flush=True)

    table = pd.DataFrame(rows, columns=COLUMNS)
    table.to_csv(args.out / "summary.csv", index=False)
    print("\n" + table.to_string(index=False))
    return 0 if (table.passed == table.lessons).all() else 1


if __name__ == "__main__":
    sys.exit(main())
