"""Run one submission for `gpulab grade`: execute it in a fresh kernel, with the grader's own last cell.

Started as a script (``python .../grade_worker.py``) so that it starts without importing torch. It reads
its job as JSON on stdin: ``notebook`` (a path), ``cell`` (the grader's last cell), ``tag`` (what that
cell's report lines start with), ``answer_tag`` and ``cell_timeout``. It prints one line,
``<answer_tag>{"error": ..., "lines": [...]}``: the first error (or null) and the report lines.
"""

import sys


def main() -> int:
    import importlib.util
    import json
    import warnings
    from pathlib import Path

    import nbformat

    spec = importlib.util.spec_from_file_location("gpulab_execute", Path(__file__).with_name("execute.py"))
    execute = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = execute
    spec.loader.exec_module(execute)

    job = json.loads(sys.stdin.read())
    notebook = Path(job["notebook"])
    with warnings.catch_warnings():  # cells without ids (older Jupyter) are fine to run
        warnings.simplefilter("ignore")
        nb = nbformat.reads(notebook.read_text(encoding="utf-8"), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(job["cell"]))
    run = execute.run(nb, notebook.parent, cell_timeout=job["cell_timeout"], quiet_kernel=True)
    last = nb.cells[-1]
    printed = "".join(o.get("text", "") for o in last.get("outputs", [])
                      if o.get("output_type") == "stream" and o.get("name") == "stdout")
    lines = [line for line in printed.splitlines() if line.startswith(job["tag"])]
    error = run.error
    failed = [o for o in last.get("outputs", []) if o.get("output_type") == "error"]
    if failed:
        error = (f"the grader's last cell failed in this notebook's kernel ({failed[0].get('ename')}: "
                 f"{failed[0].get('evalue')}): did the notebook change gpulab or Python itself?")
    sys.stdout.write(job["answer_tag"] + json.dumps({"error": error, "lines": lines}) + "\n")
    return 0


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: gpulab's own modules must not shadow top-level ones
    sys.exit(main())
