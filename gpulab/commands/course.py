"""`gpulab course` (`make course`): run every lesson headless, keep the executed notebooks and HTML pages."""

import os
import time
from pathlib import Path

import nbformat
import pandas as pd
from nbconvert import HTMLExporter
from tqdm.auto import tqdm

from ..grader.execute import Stopped, clear_leftovers, notebook_problem, run_contained

COLUMNS = ["lesson", "status", "seconds", "error"]


def run_course(notebooks: list[Path], out_dir: Path = Path("build"), cell_timeout: int = 900,
               env: dict | None = None) -> pd.DataFrame:
    """Execute each notebook in a fresh kernel (with environment ``env``, default: this process's), in a worker
    process whose processes are all ended afterwards; write ``out_dir``/NAME.ipynb and NAME.html for each, even a
    failed one (it shows where it stopped). Returns a table of lesson, status, seconds, error, also written to
    ``out_dir``/summary.csv. Ctrl-C (or SIGTERM, raised as KeyboardInterrupt) ends the lesson that runs and raises
    ``Stopped`` with the table of the lessons that finished."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        clear_leftovers()
        progress = tqdm(notebooks, desc="lessons", unit="notebook")
        for path in progress:
            progress.set_postfix_str(path.name)
            rows.append(_run_lesson(Path(path), out_dir, cell_timeout, env))
            progress.write(f"{path.stem}: {rows[-1]['status']} in {rows[-1]['seconds']:.1f} s {rows[-1]['error']}")
    except KeyboardInterrupt as stop:
        raise Stopped(_summary(rows, out_dir), str(stop) or "Ctrl-C") from None
    return _summary(rows, out_dir)


def _run_lesson(path: Path, out_dir: Path, cell_timeout: int, env: dict | None) -> dict:
    """Run one lesson; its row of the summary."""
    start = time.perf_counter()
    row = {"lesson": path.stem, "status": "FAILED", "seconds": 0.0, "error": ""}
    try:
        problem = notebook_problem(path.read_bytes())
    except OSError as err:
        problem = err.strerror or str(err)
    if problem:
        return {**row, "error": f"not a readable notebook: {problem}"}
    kernel_log = out_dir.resolve() / f"{path.stem}.kernel.log"  # the kernel process's own messages, off the terminal
    job = {"notebook": path.read_text(encoding="utf-8"), "cell_timeout": cell_timeout, "kernel_log": str(kernel_log)}
    answer, failure = run_contained(job, cwd=path.parent.resolve(), env=dict(env or os.environ))
    error = failure or answer.get("error")
    if error and kernel_log.exists() and kernel_log.stat().st_size:
        error += f" (the kernel's own messages: {kernel_log})"
    html_error = None
    if answer.get("notebook"):
        nb = nbformat.reads(answer["notebook"], as_version=4)
        (out_dir / path.name).write_text(nbformat.writes(nb))
        html_error = _write_html(nb, out_dir / path.with_suffix(".html").name)
    seconds = answer.get("seconds", time.perf_counter() - start)
    return {**row, "status": "FAILED" if error else "passed", "seconds": round(seconds, 1),
            "error": error or html_error or ""}


def _summary(rows: list[dict], out_dir: Path) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.to_csv(out_dir / "summary.csv", index=False)
    return table


def _write_html(nb, target: Path) -> str | None:
    """Write the HTML page; a failure here is reported, and the executed notebook is kept all the same."""
    try:
        html, _ = HTMLExporter().from_notebook_node(nb)
    except Exception as err:  # nbconvert's template lookup can fail on odd installs
        return f"HTML page not written: {err}"
    target.write_text(html)
    return None
