"""Hostile submissions that once changed grades: a detached process, torchrun left running, a forged report, an
edited file of another installed package. Each gets zero with its reason; a good notebook next to it keeps full
marks; nothing of the grading is left running or on disk."""

import csv
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import nbformat
import pandas as pd
import psutil
import pytest

from gpulab.grader import execute
from gpulab.grader.grading import GradingError, grade

from .conftest import ROOT

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)

LESSON = "00_setup_and_diagnostics.ipynb"
TOKEN = f"gpulab-hostile-{secrets.token_hex(4)}"  # in the command line of every process a hostile notebook starts

# A process that double-forks into a session of its own and, as the one in the review did, keeps rewriting the
# notebook of whichever submission is graded next.
ESCAPE = f"""
import subprocess, sys
daemon = '''
import glob, sys, time
forged = open(sys.argv[1]).read()
for _ in range(2400):
    for work in glob.glob(sys.argv[2] + "/gpulab-submission-*/work"):
        open(work + "/{LESSON}", "w").write(forged)
    time.sleep(0.05)
'''
launcher = "import os, subprocess, sys; os.setsid(); subprocess.Popen(sys.argv[1:], start_new_session=True)"
subprocess.run([sys.executable, "-c", launcher, sys.executable, "-c", daemon, {str(ROOT / "solutions" / LESSON)!r},
                {tempfile.gettempdir()!r}, {TOKEN!r}], check=True)
"""
# torchrun with two ranks that hang, in a session of its own, and a notebook that waits past the time limit.
TORCHRUN = f"""
import pathlib, subprocess, sys, time
pathlib.Path("rank.py").write_text("import time\\ntime.sleep(600)\\n")
subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "rank.py",
                  {TOKEN!r}], start_new_session=True)
time.sleep(600)
"""
# Blank submissions that rewrite the grader's report on its way out, each in its own way.
FORGE = """
import json, re
def forged(text):
    match = re.match(r"(GPULAB-GRADE-\\w+:)(.*)", text)
    if not match:
        return text
    report = json.loads(match.group(2))
    for result in report["report"]["results"].values():
        result["status"] = "correct"
    return match.group(1) + json.dumps(report)
"""
FORGERS = {
    "stdout_wrapper": FORGE + """
import sys
class Rewrite:
    def __init__(self, out):
        self.out = out
    def write(self, text):
        return self.out.write(forged(text))
    def __getattr__(self, name):
        return getattr(self.out, name)
sys.stdout = Rewrite(sys.stdout)
""",
    "notebook_print": FORGE + """
import builtins
def print(*args, **kwargs):
    builtins.print(*(forged(str(a)) for a in args), **kwargs)
""",
    "patched_os_write": FORGE + """
import os
real_write = os.write
os.write = lambda fd, data: real_write(fd, forged(data.decode()).encode())
""",
    "writes_to_the_grader_socket": """
import json, os, socket
line = json.dumps({"report": {"fingerprint": {}, "changed": [], "unchecked": [],
                              "results": {f"q{i}": {"status": "correct", "message": "x"} for i in range(1, 5)}}})
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        continue
    try:
        if sock.family == socket.AF_UNIX and not sock.getsockname() and not sock.getpeername():  # a socket pair
            for tag in ("", "GPULAB-GRADE-0:"):
                sock.sendall((tag + line + "\\n").encode())
    finally:
        sock.detach()
""",
}


def _notebook(path: Path, *sources, base: Path | None = None) -> Path:
    nb = nbformat.read(base, as_version=4) if base else nbformat.v4.new_notebook()
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _leftovers() -> list[str]:
    """Processes started by the hostile notebooks, and folders of this process's runs, still there."""
    found = [f"{p.pid} {' '.join(p.info['cmdline'] or [])[:80]}" for p in psutil.process_iter(["cmdline"])
             if TOKEN in " ".join(p.info["cmdline"] or [])]
    for where in {tempfile.gettempdir(), "/tmp"}:
        found += [str(f) for f in Path(where).glob(f"gpulab-*-{os.getpid()}-*")]
    home = execute._cgroup_home()
    return found + [str(f) for f in (home.glob(f"gpulab-{os.getpid()}-*") if home else [])]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Copies of gpulab and of ipykernel (an installed distribution, with its RECORD) that the graded kernels import,
    so that a notebook may edit them without touching the real installation."""
    import ipykernel

    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "gpulab", site / "gpulab", ignore=shutil.ignore_patterns("__pycache__"))
    installed = Path(ipykernel.__file__).parent
    shutil.copytree(installed, site / "ipykernel", ignore=shutil.ignore_patterns("__pycache__"))
    info = next(installed.parent.glob("ipykernel-*.dist-info"))
    shutil.copytree(info, site / info.name)
    record = site / info.name / "RECORD"
    rows = [row for row in csv.reader(record.read_text().splitlines())
            if row and row[0].startswith(("ipykernel/", info.name)) and "__pycache__" not in row[0]]
    with record.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(site))
        yield site


@pytest.fixture(scope="module")
def hostile(site, tmp_path_factory):
    """The escaping process and the forgers, each followed by a blank or a good notebook, graded in one call; then
    torchrun left hanging, alone at a 60 s limit (lesson 00 may need more on a busy machine); the grades by name."""
    folder = tmp_path_factory.mktemp("class")
    solution, blank = ROOT / "solutions" / LESSON, ROOT / "exercises" / LESSON
    kinds = {"escape": _notebook(folder / "escape" / LESSON, ESCAPE, base=solution),
             "blank_after_escape": _notebook(folder / "blank" / LESSON, base=blank),
             "torchrun": _notebook(folder / "torchrun" / "07_multi_gpu.ipynb", TORCHRUN)}
    kinds |= {name: _notebook(folder / name / LESSON, source, base=blank) for name, source in FORGERS.items()}
    kinds["good"] = _notebook(folder / "good" / LESSON, base=solution)
    others = [path for name, path in kinds.items() if name != "torchrun"]
    grades = pd.concat([grade(others), grade([kinds["torchrun"]], time_limit=60)])
    return {name: grades[grades["notebook"] == str(path)] for name, path in kinds.items()}


@pytest.mark.parametrize("kind, reason", [
    ("escape", "the notebook left processes running detached from its kernel"),
    ("blank_after_escape", "not attempted"),
    ("torchrun", "ran past the time limit of 60 s"),
    *((name, "not attempted") for name in FORGERS),
])
def test_a_hostile_notebook_gets_zero_and_its_reason(hostile, kind, reason):
    rows = hostile[kind]
    assert len(rows) >= 3 and (rows["points"] == 0).all(), rows.to_string()
    assert rows["message"].str.startswith(reason).all(), rows["message"].tolist()


def test_the_good_notebook_among_them_gets_full_marks_and_nothing_is_left(hostile):
    assert hostile["good"]["passed"].all(), hostile["good"].to_string()
    assert _leftovers() == []


def test_without_a_cgroup_the_sweep_ends_a_detached_process(site, tmp_path, monkeypatch):
    monkeypatch.setattr(execute, "_new_cgroup", lambda: None)
    escape = _notebook(tmp_path / LESSON, ESCAPE)
    grades = grade([escape])
    assert grades["message"].str.startswith("the notebook left processes running detached").all(), grades.to_string()
    assert _leftovers() == []


def test_an_edited_file_of_another_package_zeroes_it_and_stops_grading(site, tmp_path):
    edited = site / "ipykernel" / "__init__.py"
    original = edited.read_bytes()
    tamper = _notebook(tmp_path / "tamper" / LESSON, "import ipykernel\nopen(ipykernel.__file__, 'a').write('\\n# edited\\n')")
    good = _notebook(tmp_path / "good" / LESSON, base=ROOT / "solutions" / LESSON)
    after = _notebook(tmp_path / "after" / LESSON, base=ROOT / "solutions" / LESSON)
    try:
        grades = grade([good, tamper, after])
        with pytest.raises(GradingError, match="ipykernel/__init__.py.*--force-reinstall ipykernel"):
            grade([after])  # the next run refuses an installation that differs from what was installed
    finally:
        edited.write_bytes(original)
    by = {path: grades[grades["notebook"] == str(path)] for path in (good, tamper, after)}
    assert by[good]["passed"].all(), by[good].to_string()
    assert by[tamper]["message"].str.startswith(f"installed files changed while this notebook ran ({edited}").all()
    assert by[after]["message"].str.startswith("not graded: installed files changed while").all()
    assert (by[tamper]["points"] == 0).all() and (by[after]["points"] == 0).all()
    assert grades.attrs["installation_seconds"] > 0
