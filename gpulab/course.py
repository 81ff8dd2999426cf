"""`gpulab course` (`make course`): run every lesson headless, keep the executed notebooks and HTML pages."""

from pathlib import Path

import nbformat
import pandas as pd
from nbconvert import HTMLExporter
from tqdm.auto import tqdm

from .execute import run_notebook


def run_course(notebooks: list[Path], out_dir: Path = Path("build"), cell_timeout: int = 900,
               env: dict | None = None) -> pd.DataFrame:
    """Execute each notebook in a fresh kernel (with environment ``env``, default: this process's); write
    ``out_dir``/NAME.ipynb and NAME.html for each, even a failed one (it shows where it stopped).
    Returns a table of lesson, status, seconds, error."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    progress = tqdm(notebooks, desc="lessons", unit="notebook")
    for path in progress:
        progress.set_postfix_str(path.name)
        kernel_log = out_dir / f"{path.stem}.kernel.log"  # the kernel process's own messages, off the terminal
        run = run_notebook(path, cell_timeout=cell_timeout, env=env, kernel_log=kernel_log)
        (out_dir / path.name).write_text(nbformat.writes(run.notebook))
        html_error = _write_html(run.notebook, out_dir / path.with_suffix(".html").name)
        error = run.error or html_error
        if run.error and kernel_log.stat().st_size:
            error += f" (the kernel's own messages: {kernel_log})"
        rows.append({"lesson": path.stem, "status": "passed" if run.ok else "FAILED",
                     "seconds": round(run.seconds, 1), "error": error or ""})
        progress.write(f"{path.stem}: {rows[-1]['status']} in {run.seconds:.1f} s {error or ''}")
    table = pd.DataFrame(rows, columns=["lesson", "status", "seconds", "error"])
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
