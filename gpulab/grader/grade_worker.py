"""Run one notebook in a fresh kernel, in a worker process of its own (``execute.run_contained`` starts it).

Started as a script (``python .../grade_worker.py``) so that it starts without importing torch, in a session and
(where the machine allows) a cgroup of its own, which the parent ends as a whole. It reads its job as JSON on
stdin, the notebook's text included (so no file that another process could rewrite): ``notebook``, ``cwd``,
``kernel_folder``, ``cell_timeout``, ``kernel_log`` (a path, or null for none), ``answer_tag``, ``group`` (see
``execute.Group.where``) and, to grade, ``report``: ``tag``, ``lesson``, ``modules`` and ``integrity`` (the
installed gpulab's integrity.py, whose ``serve_report`` the kernel runs). It prints one line,
``<answer_tag>{...}``: the first error (or null), the seconds, and either the executed notebook or, to grade, the
report lines and the processes that had detached from the kernel when the last cell ended.

To grade, the kernel starts with ``integrity.serve_report`` (before any cell of the notebook), holding one end of
a socket pair: the worker sends the run's tag through it, appends the grader's last cell
(``integrity.REPORT_CELL``) and keeps the lines that come back with the tag.
"""

import sys


def main() -> int:
    import json
    import warnings
    from pathlib import Path

    _without_iri_checker()
    import nbformat

    _end_with_parent()
    execute = _load(Path(__file__).with_name("execute.py"))
    job = json.loads(sys.stdin.buffer.read())
    with warnings.catch_warnings():  # cells without ids (older Jupyter) are fine to run
        warnings.simplefilter("ignore")
        nb = nbformat.reads(job["notebook"], as_version=4)
    options, channel, escaped = {}, None, []
    if job.get("report"):
        channel = Channel(job["report"])
        nb.cells.append(nbformat.v4.new_code_cell(_load(job["report"]["integrity"]).REPORT_CELL))
        options = {"extra_arguments": [channel.boot], "pass_fds": (channel.kernel_end,),
                   "at_end": lambda: escaped.extend(execute.detached(**job["group"]))}
    log = job.get("kernel_log")
    run = execute.run(nb, job["cwd"], cell_timeout=job["cell_timeout"], quiet_kernel=log is None, kernel_log=log,
                      kernel_folder=job["kernel_folder"], **options)
    answer = {"error": run.error, "seconds": run.seconds}
    if channel:
        answer.update(lines=channel.lines(), escaped=escaped)
    else:
        answer["notebook"] = nbformat.writes(nb)
    sys.stdout.write(job["answer_tag"] + json.dumps(answer) + "\n")
    return 0


class Channel:
    """The grader's report channel: a socket pair whose ``kernel_end`` only the kernel inherits; ``boot`` is the
    kernel's start-up line that runs ``serve_report`` on it, from the installed integrity.py, in a namespace of its
    own."""

    LIMIT = 16 * 2**20  # bytes kept: a report is well under 1 MB

    def __init__(self, report: dict):
        import socket
        import threading

        ours, theirs = socket.socketpair()
        ours.sendall(report["tag"].encode() + b"\n")
        self.kernel_end = theirs.detach()  # passed to the kernel's process alone (pass_fds)
        self.tag, self.chunks, self._ours = report["tag"], [], ours
        source = report["integrity"]
        self.boot = ("--IPKernelApp.exec_lines="
                     f"exec(compile(__import__('pathlib').Path({source!r}).read_text(), {source!r}, 'exec'), _gpulab := "
                     "{'__name__': 'gpulab_report', '__builtins__': dict(vars(__import__('builtins')))}); "
                     f"_gpulab['serve_report']({self.kernel_end}, {report['lesson']!r}, {report['modules']!r}); "
                     "del _gpulab")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def lines(self) -> list[str]:
        """The lines that carry the tag, once the kernel is gone (a process it forked may still hold the socket:
        what it wrote by then counts)."""
        import os

        os.close(self.kernel_end)
        self._reader.join(timeout=2)
        text = b"".join(self.chunks).decode(errors="replace")
        return [line for line in text.splitlines() if line.startswith(self.tag)]

    def _read(self) -> None:
        kept = 0
        while chunk := self._ours.recv(65536):
            if kept < self.LIMIT:
                self.chunks.append(chunk)
                kept += len(chunk)


def _load(path):
    """The module in the file ``path`` (one of gpulab's), without importing the package (and torch)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"gpulab_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _without_iri_checker() -> None:
    """Keep jsonschema (which nbformat imports) from loading rfc3987_syntax, its optional IRI checker, which builds
    its Earley parsers on import: about 1.5 s of CPU in every worker (python-jsonschema/jsonschema#1428). jsonschema
    skips a checker whose import fails; nbformat checks no formats, so nothing that runs here changes."""
    sys.modules.setdefault("rfc3987_syntax", None)  # None in sys.modules: importing it raises ImportError


def _end_with_parent() -> None:
    """Be killed when the parent dies (Linux): the parent ends the worker's group, and must not leave a worker."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):  # not Linux
        pass


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: gpulab's own modules must not shadow top-level ones
    sys.exit(main())
