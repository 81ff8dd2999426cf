"""`make wheelhouse`: every wheel the course needs except torch, for GPU machines without internet.

Workshop GPU VMs bring their own CUDA build of torch (with torchvision and triton) and often no internet. On a
machine with internet, ``build`` asks pip which wheels ``pip install -e ".[course]"`` needs on another Python and
platform (default: CPython 3.12, manylinux x86_64), with torch and torchvision counted as present, downloads exactly
those into one folder and writes ``wheelhouse.json`` beside them (what, for which Python, from which command). On the
VM, with the machine's own torch already installed::

    pip install --no-index --find-links build/wheelhouse -e ".[course]"

``check`` proves that offline: pip resolves the project against the folder alone (no index, no pip configuration,
no ``PIP_*`` variables), torch again counted as present, for any Python version and platform.

Two sets: ``course``, the course extra (JupyterLab and HolisticTraceAnalysis included), and ``headless``, the
headless extra (what ``gpulab course`` and ``gpulab reference record`` need to run the lessons), for an image that
already has torch, numpy, pandas and matplotlib. Packages "counted as present" are stand-in wheels (no files, no
dependencies, version ``<declared floor>+present``) that only the resolver sees: PyPI refuses local versions, so
nothing real can match them, and none of them is ever written into the wheelhouse.

Run as ``python -m gpulab.commands.wheelhouse build|check`` (``make wheelhouse`` builds, then checks).
"""

import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

NEVER = ("torch", "torchvision", "triton")  # the machine's own CUDA build: never in a wheelhouse
MANIFEST = "wheelhouse.json"
DEFAULT_PYTHON = "3.12"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"  # glibc 2.28, what torch's own Linux wheels need
BUILD_BACKEND = "setuptools>=69"  # `pip install -e .` builds the project offline: its backend must be there too


@dataclass(frozen=True)
class WheelSet:
    extra: str                 # the project's extra that the set installs
    present: tuple[str, ...]   # packages the target machine already has: counted as present, never downloaded
    about: str


SETS = {
    "course": WheelSet("course", ("torch", "torchvision"),
                       "the whole course: JupyterLab, HolisticTraceAnalysis, the notebook runner"),
    "headless": WheelSet("headless", ("torch", "torchvision", "numpy", "pandas", "matplotlib"),
                         "running the lessons headless (gpulab course, gpulab reference record) on an image "
                         "that has torch, numpy, pandas and matplotlib"),
}


class WheelhouseError(RuntimeError):
    """Resolving, downloading or checking a wheelhouse failed; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------- requirements

def name_of(requirement: str) -> str:
    """The normalised distribution name of a requirement string ("Jupyter_Lab>=4" -> "jupyter-lab")."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ @]", requirement.strip(), maxsplit=1)[0]).lower()


def floor_of(requirement: str) -> str:
    """The lowest version a requirement admits, from its ``>=``/``==``/``~=`` clause ("0" when it has none)."""
    match = re.search(r"(?:>=|==|~=)\s*([0-9][0-9A-Za-z.]*)", requirement.split(";")[0])
    return match.group(1) if match else "0"


def project_requirements(project: Path, extra: str) -> list[str]:
    """The project's own dependencies plus those of ``extra``, as pyproject.toml declares them."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise WheelhouseError("building a wheelhouse needs Python 3.11 or newer (tomllib)") from None
    path = Path(project) / "pyproject.toml"
    if not path.is_file():
        raise WheelhouseError(f"no pyproject.toml in {project}: run this from the course's folder")
    meta = tomllib.loads(path.read_text())["project"]
    extras = meta.get("optional-dependencies", {})
    if extra not in extras:
        raise WheelhouseError(f"pyproject.toml declares no extra '{extra}' (it has: {', '.join(extras)})")
    return list(meta["dependencies"]) + list(extras[extra])


def present_versions(requirements: list[str], names, overrides: dict | None = None) -> dict[str, str]:
    """The version each package counted as present stands in with: its declared floor, or ``overrides[name]``.
    ``overrides`` may name more packages (what a machine's image has): they are counted as present too."""
    declared = {name_of(r): floor_of(r) for r in requirements}
    overrides = {name_of(k): v for k, v in (overrides or {}).items()}
    present = {name: overrides.get(name, declared.get(name, "0")) for name in names}
    return {**present, **overrides}


def read_freeze(path: Path) -> dict[str, str]:
    """NAME==VERSION lines of a ``pip list --format=freeze`` (or ``pip freeze``) of the target machine; editable
    installs, URLs and comments are skipped."""
    found = {}
    for line in Path(path).read_text().splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([0-9][^\s;#]*)\s*", line)
        if match:
            found[name_of(match.group(1))] = match.group(2)
    return found


def wanted(requirements: list[str], present) -> list[str]:
    """What to ask pip for: every requirement but the ones counted as present, and the build backend."""
    return [r for r in requirements if name_of(r) not in set(present)] + [BUILD_BACKEND]


# ---------------------------------------------------------------------------------------------- targets

def platform_tags(platform: str) -> list[str]:
    """The platform tags pip must accept for ``platform``: pip matches each tag exactly, so a glibc 2.N target
    (``manylinux_2_N_ARCH``) also takes every older manylinux wheel and the legacy aliases (2014, 2010, 1)."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    tags += [alias for n, alias in ((17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1")) if glibc >= n]
    return [t if t.startswith("manylinux_2_") else f"{t}_{arch}" for t in tags]


def target_options(python: str, platform: str) -> list[str]:
    """pip's options for a CPython ``python`` ("3.13") on ``platform``: binary wheels only, as a VM can't build."""
    if not re.fullmatch(r"3\.\d{1,2}", python):
        raise WheelhouseError(f"a Python version is written like 3.12, not {python!r}")
    options = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python,
               "--abi", f"cp{python.replace('.', '')}"]
    for tag in platform_tags(platform):
        options += ["--platform", tag]
    return options


def stub_wheel(name: str, version: str, folder: Path) -> Path:
    """A wheel with nothing in it but its metadata: ``name`` counted as present, at ``version``, needing nothing."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                      "Summary: counted as present by gpulab.commands.wheelhouse (a stand-in, never installed)\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: gpulab.commands.wheelhouse\nRoot-Is-Purelib: true\n"
                                   "Tag: py3-none-any\n",
    }
    record = [f"{path},sha256={_b64sha256(text.encode())},{len(text.encode())}" for path, text in files.items()]
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record + [f"{dist}.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return target


def stub_version(version: str) -> str:
    """The stand-in's version: ``version`` with the local label ``+present`` (replacing one such as ``+cu130``)."""
    return f"{version.split('+')[0]}+present"


# ---------------------------------------------------------------------------------------------- pip

def isolated_env() -> dict:
    """This process's environment without pip's settings: no configuration file, no ``PIP_*`` variables, so
    that nothing but the options given (the wheelhouse alone) can supply a wheel."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def pip(args: list[str], *, env: dict | None = None, python: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m pip args`` (default: this interpreter's pip); a failure raises WheelhouseError with pip's
    last lines."""
    command = [python or sys.executable, "-m", "pip", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise WheelhouseError(f"pip {args[0]} failed (exit {done.returncode}):\n{tail}")
    return done


def resolve(requirements: list[str], python: str, platform: str, *, present: dict[str, str] | None = None,
            constraints: list[str] | None = None, find_links: list[Path] = (), offline: bool = False,
            editable: Path | None = None) -> list[dict]:
    """What pip would install for ``requirements`` on CPython ``python`` / ``platform``, as its ``--report``'s
    "install" entries, without installing anything.

    ``present``: name -> version of packages the target already has (stand-in wheels). ``constraints``: pins
    (lines of a constraints file). ``offline``: resolve against ``find_links`` alone, ignoring the index and pip's
    configuration. ``editable``: also resolve that project folder as ``-e`` (its first requirement's extras).
    """
    with tempfile.TemporaryDirectory(prefix="gpulab-wheelhouse-") as tmp:
        tmp = Path(tmp)
        stubs = [stub_wheel(name, stub_version(version), tmp / "present") for name, version in (present or {}).items()]
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(tmp / "report.json"),
                "--target", str(tmp / "target"), *target_options(python, platform)]
        links = list(find_links) + ([tmp / "present"] if stubs else [])
        for link in links:
            args += ["--find-links", str(link)]
        if offline:
            args.append("--no-index")
        # each stand-in pinned: a newer real release (on the index, or in the folder) must not win over it
        pins = list(constraints or []) + [f"{name}=={stub_version(v)}" for name, v in (present or {}).items()]
        if pins:
            (tmp / "constraints.txt").write_text("\n".join(pins) + "\n")
            args += ["--constraint", str(tmp / "constraints.txt")]
        args += ["--editable", str(editable)] if editable else []
        args += requirements
        pip(args, env=isolated_env() if offline else None)
        report = json.loads((tmp / "report.json").read_text())
    return [item for item in report["install"]  # neither the stand-ins nor the project folder itself
            if not _is_stub(item, present or {}) and "dir_info" not in item.get("download_info", {})]


def _is_stub(item: dict, present: dict) -> bool:
    meta = item["metadata"]
    return name_of(meta["name"]) in present and meta["version"].endswith("+present")


def constraint_lines(path: Path | None, dropped) -> list[str]:
    """The pins of a constraints file, less those of ``dropped`` packages (counted as present, or never shipped)."""
    if path is None or not Path(path).is_file():
        return []
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#") and name_of(line) not in set(dropped)]


# ---------------------------------------------------------------------------------------------- build and check

def build(out: Path, set_name: str = "course", pythons=(DEFAULT_PYTHON,), platform: str = DEFAULT_PLATFORM, *,
          project: Path = Path("."), constraints: Path | None = Path("constraints.txt"),
          present: dict | None = None, log=print) -> dict:
    """Resolve the set for each Python in ``pythons``, download those wheels into ``out`` and write its manifest.

    Returns the manifest (also ``out/wheelhouse.json``). Wheels left in ``out`` by an earlier build that this one
    does not need are removed, so the folder holds exactly what the manifest lists.
    """
    if set_name not in SETS:
        raise WheelhouseError(f"no wheel set '{set_name}': choose {' or '.join(SETS)}")
    wheel_set, out, project = SETS[set_name], Path(out), Path(project)
    _claim(out)
    started = time.perf_counter()
    requirements = project_requirements(project, wheel_set.extra)
    stand_ins = present_versions(requirements, wheel_set.present, present)
    pins = constraint_lines(project / constraints if constraints else None, (*NEVER, *stand_ins))
    wheels: dict[str, dict] = {}
    for python in pythons:
        log(f"resolving the {set_name} set for CPython {python} on {platform} ...")
        resolved = resolve(wanted(requirements, stand_ins), python, platform, present=stand_ins, constraints=pins)
        banned = sorted({name_of(i["metadata"]["name"]) for i in resolved} & set(NEVER))
        if banned:
            raise WheelhouseError(f"for Python {python} the resolution wants {', '.join(banned)}, which a wheelhouse "
                                  "never holds (the GPU machine's own build): a dependency besides gpulab needs it")
        for item in resolved:
            url = item["download_info"]["url"]
            entry = wheels.setdefault(url.rsplit("/", 1)[-1], {
                "name": item["metadata"]["name"], "version": item["metadata"]["version"], "url": url,
                "sha256": item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
                or item["download_info"].get("archive_info", {}).get("hash", "=").split("=", 1)[-1],
                "pythons": []})
            entry["pythons"].append(python)
    _download(out, wheels, pythons, platform, log)
    for stale in sorted(set(p.name for p in out.glob("*.whl")) - set(wheels)):
        (out / stale).unlink()
        log(f"removed {stale} (not needed by this build)")
    files = [{"file": f, "name": w["name"], "version": w["version"], "sha256": w["sha256"],
              "bytes": (out / f).stat().st_size, "pythons": w["pythons"]} for f, w in sorted(wheels.items())]
    manifest = {
        "set": set_name, "about": wheel_set.about, "pythons": list(pythons), "platform": platform,
        "platform_tags": platform_tags(platform),
        "counted_as_present": stand_ins,  # name -> version the target has (check() counts them again)
        "never_included": list(NEVER),
        "constraints": str(constraints) if pins else None,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "install": install_command(out, wheel_set.extra),
        "total_bytes": sum(f["bytes"] for f in files), "wheels": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def install_command(folder: Path, extra: str) -> str:
    return f'pip install --no-index --find-links {folder} -e ".[{extra}]"'


def _claim(out: Path) -> None:
    """``out`` must be new, empty, or a wheelhouse this module wrote: other files there are not ours to remove."""
    if out.exists() and not out.is_dir():
        raise WheelhouseError(f"{out} is a file: name a folder for the wheelhouse")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise WheelhouseError(f"{out} holds files but no {MANIFEST}: name an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)


def _download(out: Path, wheels: dict, pythons, platform: str, log) -> None:
    """Fetch the wheels not already in ``out`` with their hashes checked, through pip (its proxy and index
    settings apply), one Python version at a time (pip checks each wheel's tags against the target)."""
    have = {f for f, w in wheels.items() if (out / f).is_file() and w["sha256"] == _sha256(out / f)}
    for python in pythons:
        todo = [w for f, w in wheels.items() if f not in have and python in w["pythons"]]
        if not todo:
            continue
        log(f"downloading {len(todo)} wheels for CPython {python} into {out}/ ...")
        specs = [f"{w['name']} @ {w['url']}" + (f"#sha256={w['sha256']}" if w["sha256"] else "") for w in todo]
        pip(["download", "--no-deps", "--quiet", "--dest", str(out), *target_options(python, platform), *specs])
        have |= {f for f, w in wheels.items() if python in w["pythons"]}
    missing = [f for f in wheels if not (out / f).is_file()]
    if missing:
        raise WheelhouseError(f"pip did not save {len(missing)} wheel(s), e.g. {missing[0]}")


def check(wheelhouse: Path, python: str | None = None, platform: str | None = None, *, set_name: str | None = None,
          project: Path = Path("."), present: dict | None = None) -> list[str]:
    """Resolve ``pip install -e "project[extra]"`` against ``wheelhouse`` alone for CPython ``python`` on
    ``platform`` (default: the manifest's first Python, its platform and set), the set's packages counted as
    present (and whatever the build counted as present: its ``--present``). Returns "name==version" of everything
    pip would install; raises WheelhouseError when a wheel is missing.
    """
    wheelhouse = Path(wheelhouse)
    manifest_path = wheelhouse / MANIFEST
    if not manifest_path.is_file():
        raise WheelhouseError(f"{wheelhouse} has no {MANIFEST}: build it first (make wheelhouse)")
    manifest = json.loads(manifest_path.read_text())
    set_name = set_name or manifest["set"]
    wheel_set = SETS[set_name]
    python, platform = python or manifest["pythons"][0], platform or manifest["platform"]
    requirements = project_requirements(project, wheel_set.extra)
    built_with = manifest.get("counted_as_present", {}) if set_name == manifest["set"] else {}
    stand_ins = present_versions(requirements, wheel_set.present, {**built_with, **(present or {})})
    try:
        resolved = resolve([], python, platform, present=stand_ins, find_links=[wheelhouse], offline=True,
                           editable=Path(f"{Path(project).resolve()}[{wheel_set.extra}]"))
    except WheelhouseError as err:
        raise WheelhouseError(f"{wheelhouse} does not install the {set_name} set offline on CPython {python} "
                              f"({platform}): {err}") from None
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in resolved)


# ---------------------------------------------------------------------------------------------- helpers, CLI

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _b64sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _present_option(text: str) -> tuple[str, str]:
    name, sep, version = text.partition("==")
    if not sep or not name or not version:
        raise argparse.ArgumentTypeError(f"write NAME==VERSION, e.g. torch==2.11.0, not {text!r}")
    return name, version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpulab.commands.wheelhouse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="download every wheel the set needs (except torch) into a folder")
    b.add_argument("--out", type=Path, default=Path("build/wheelhouse"))
    c = sub.add_parser("check", help="resolve the project against the wheelhouse alone, offline")
    c.add_argument("wheelhouse", type=Path, nargs="?", default=Path("build/wheelhouse"))
    for p in (b, c):
        p.add_argument("--set", dest="set_name", choices=list(SETS), default=None if p is c else "course")
        p.add_argument("--python", action="append", help=f"CPython version, e.g. 3.13 (default {DEFAULT_PYTHON}; "
                       "build takes several)")
        p.add_argument("--platform", default=None if p is c else DEFAULT_PLATFORM,
                       help=f"target platform (default {DEFAULT_PLATFORM}: glibc 2.28 and newer, x86_64)")
        p.add_argument("--present", action="append", type=_present_option, default=[],
                       help="NAME==VERSION the target already has (default: each counted package at its floor)")
        p.add_argument("--present-from", type=Path, help="the target's `pip list --format=freeze`: every package "
                       "it lists is counted as present (not downloaded)")
    b.add_argument("--no-constraints", action="store_true", help="don't pin versions with constraints.txt")
    args = parser.parse_args(argv)
    try:
        present = {**(read_freeze(args.present_from) if args.present_from else {}), **dict(args.present)}
        if args.action == "build":
            manifest = build(args.out, args.set_name, tuple(args.python or [DEFAULT_PYTHON]), args.platform,
                             constraints=None if args.no_constraints else Path("constraints.txt"), present=present)
            print(f"{len(manifest['wheels'])} wheels, {manifest['total_bytes'] / 1e6:.1f} MB, for CPython "
                  f"{', '.join(manifest['pythons'])} on {manifest['platform']}, in {manifest['seconds']:.0f} s. "
                  f"On the offline machine, with its own torch installed:\n  {manifest['install']}")
            return 0
        for python in args.python or [None]:
            started = time.perf_counter()
            would = check(args.wheelhouse, python, args.platform, set_name=args.set_name, present=present)
            print(f"{args.wheelhouse} installs offline on CPython {python or 'as built'}: {len(would)} packages "
                  f"resolved in {time.perf_counter() - started:.0f} s, torch counted as present")
        return 0
    except (WheelhouseError, OSError) as err:
        print(f"gpulab wheelhouse: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
