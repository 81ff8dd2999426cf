"""Benchmark records, each with the environment it was measured in.

Rows are appended to ``results/<name>.csv`` as soon as they are measured, so an interrupted
sweep keeps every finished point. Each row also records the machine's state when it was measured
(``gpulab.conditions``: load average and CPU cores, on a GPU its SM clock, throttle reasons, temperature
and power) and a ``caveat`` column that says, in words, when the CPU was oversubscribed or the GPU
throttled (empty when neither). Reference results measured on real GPUs ship in ``gpulab/reference/``
with their provenance.
"""

import csv
import json
import math
import os
import socket
import sys
from datetime import datetime, timezone
from functools import cache
from pathlib import Path

import pandas as pd

from .conditions import Conditions, snapshot
from .device import device_info
from .mode import quick_mode

SCHEMA = 1
REFERENCE_DIR = Path(__file__).parent / "reference"
ENV_COLUMNS = ("schema", "recorded_at", "host", "device", "device_name", "driver", "torch", "cuda", "quick")
# Written with every row since these columns came (older files gain them, empty, with their next row).
CONDITION_COLUMNS = ("load_avg", "cpu_cores", "sm_clock_mhz", "sm_clock_low_mhz", "sm_clock_high_mhz",
                     "sm_clock_max_mhz", "gpu_temp_c", "gpu_power_w", "gpu_power_limit_w", "throttle",
                     "caveat")  # the GPU's only on rows whose measurement watched the GPU

_OURS = b"schema,"  # how every results file written by ResultLog starts


class ResultsFileError(RuntimeError):
    """A results file cannot be read or extended; the message says what to do. The file is left as it was."""


def results_dir() -> Path:
    """Where results are written: ``$GPULAB_RESULTS`` or ``results/`` at the repository root (or here)."""
    if os.environ.get("GPULAB_RESULTS"):
        return Path(os.environ["GPULAB_RESULTS"])
    here = Path.cwd()
    root = next((p for p in (here, *here.parents) if (p / "pyproject.toml").exists() and (p / "gpulab").is_dir()), here)
    return root / "results"


@cache
def environment(device: str | None = None) -> dict:
    """The columns that say where a result was measured."""
    info = device_info(device)
    return {
        "schema": SCHEMA,
        "host": socket.gethostname(),
        "device": info.device,
        "device_name": info.name,
        "driver": info.driver_version or "",
        "torch": info.torch_version,
        "cuda": info.cuda_version or "",
        "quick": quick_mode(),
    }


class ResultLog:
    """An append-only CSV of one experiment's results: ``log.add(size=..., seconds=...)``."""

    def __init__(self, name: str, directory: str | Path | None = None, device: str | None = None):
        self.path = Path(directory or results_dir()) / f"{_plain_name(name)}.csv"
        self.device = device
        self._announced: set[str] = set()
        _set_aside_torn_row(self.path)
        if self.path.exists():
            self._check_header(self._header())

    def add(self, *, conditions: Conditions | None = None, **fields) -> dict:
        """Append one row (the fields, the environment and the machine's state) to the file at once; returns it.

        ``conditions`` is the state while the row was measured (a ``conditions.Watch`` over the measurement;
        ``bench`` and ``compare`` keep theirs in their results, and ``Comparison.row()`` carries it). Without it
        the row records the CPU's load now and no GPU state: the GPU's clocks when a row is written belong to
        whatever ran last, not to the row. A field of the same name as a condition column wins over it.
        """
        state = conditions if conditions is not None else snapshot("cpu")
        row = {**environment(self.device), "recorded_at": _now(), **fields}
        row.update({k: v for k, v in state.row().items() if k not in fields})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _set_aside_torn_row(self.path)
        header = self._header() if self.path.exists() else None
        if header is None:
            _write(self.path, list(row), [row])
        elif set(row) <= set(header):
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, header).writerow(row)
        else:  # new columns: rewrite the file with the union of columns, atomically
            columns = header + [c for c in row if c not in header]
            _write(self.path, columns, [*_rows(self.path), row])
        self._announce(state)
        return row

    def add_measurement(self, measurement, **params) -> dict:
        """Append a timing.Measurement with the parameters it was measured at (and its ``conditions`` if it
        carries them, else the state now)."""
        state = getattr(measurement, "conditions", None)
        return self.add(
            conditions=state if isinstance(state, Conditions) else None,
            **params,
            label=measurement.label,
            median_s=measurement.median,
            iqr_s=measurement.iqr,
            runs=measurement.runs,
            threads=measurement.threads,
            cache=measurement.cache,
        )

    def frame(self) -> pd.DataFrame:
        """All rows so far (an empty frame when nothing was recorded yet)."""
        return load(self.path) if self.path.exists() else pd.DataFrame()

    def _announce(self, state: Conditions) -> None:
        """Say on stderr, once per kind for this log, that a row was measured in suspect conditions."""
        for caveat in state.caveats():
            kind = caveat.split(" (")[0]
            if kind not in self._announced:
                self._announced.add(kind)
                print(f"note: a row of {self.path.name} was measured while {caveat}; its 'caveat' column says so "
                      "(later rows of this log are not announced again)", file=sys.stderr)

    def _header(self) -> list[str]:
        try:
            with self.path.open(newline="") as f:
                return next(csv.reader(f), [])
        except (OSError, UnicodeDecodeError, csv.Error) as err:
            raise _unreadable(self.path, err) from None

    def _check_header(self, header: list[str]) -> None:
        missing = [c for c in ENV_COLUMNS if c not in header]
        if missing:
            raise ResultsFileError(
                f"{self.path} was not written by this version of gpulab (no {', '.join(missing)} column). "
                f"Nothing was changed: move it aside (e.g. rename it to {self.path.name}.old) and run again."
            )
        schemas = set(load(self.path)["schema"].astype(str))
        if schemas != {str(SCHEMA)}:
            raise ResultsFileError(
                f"{self.path} holds results of schema {', '.join(sorted(schemas))}; this gpulab writes schema "
                f"{SCHEMA}. Nothing was changed: move it aside (rename it to {self.path.name}.old) and run again."
            )


def load(path: str | Path) -> pd.DataFrame:
    """Read a results CSV; a missing or corrupt file gives a ResultsFileError saying what to do."""
    path = Path(path)
    if not path.is_file():
        raise ResultsFileError(f"{path}: no such file")
    try:
        return pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as err:
        raise _unreadable(path, err) from None


def reference(name: str) -> pd.DataFrame:
    """Reference results shipped with the course for experiment ``name`` (empty when none exist yet).

    Each row carries the environment it was measured in; ``reference_provenance(name)`` says how.
    """
    path = REFERENCE_DIR / f"{name}.csv"
    return load(path) if path.exists() else pd.DataFrame()


def reference_provenance(name: str) -> dict:
    """The machine, versions, date and command that produced reference ``name`` ({} if none)."""
    path = REFERENCE_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def reference_for(name: str) -> pd.DataFrame:
    """``reference(name)``, after one line saying which GPUs, torch versions, dates and command produced it.

    The one way every lesson shows "this experiment on real GPUs" next to the learner's own results;
    ``plots.overlay_reference`` draws the rows on a figure.
    """
    ref = reference(name)
    if ref.empty:
        print(f"No reference results for '{name}' ship with the course yet: a full run on a GPU records them in "
              f"results/{name}.csv, and `gpulab reference add results/{name}.csv --command ...` ships them.")
        return ref
    meta = reference_provenance(name)
    devices = ", ".join(meta.get("devices") or ref["device_name"].astype(str).unique())
    torches = ", ".join(meta.get("torch") or ref["torch"].astype(str).unique())
    dates = sorted({str(d)[:10] for d in meta.get("measured", [])})
    command = meta.get("command")
    print(f"Reference results for '{name}': {devices}, torch {torches}"
          + (f", measured {' to '.join(dates)}" if dates else "")
          + (f", by `{command}`" if command else "") + ".")
    note = caveat_note(ref)
    if note:
        print(note)
    return ref


def caveats(frame: pd.DataFrame) -> pd.Series:
    """Each row's caveat as text ('' when it has none, or was recorded before rows carried one)."""
    if "caveat" not in frame:
        return pd.Series("", index=frame.index, dtype=object)
    return frame["caveat"].map(lambda v: v if isinstance(v, str) else "").astype(object)


def caveat_note(frame: pd.DataFrame) -> str:
    """One line saying how many rows were measured in suspect conditions, and which ('' when none were)."""
    noted = caveats(frame)
    noted = noted[noted != ""]
    if noted.empty:
        return ""
    kinds = sorted({c.split(" (")[0] for text in noted for c in text.split("; ")})
    return (f"{len(noted)} of {len(frame)} rows were measured while {' or '.join(kinds)}: "
            "read them with care (their 'caveat' column says more).")


def add_reference(csv_path: str | Path, command: str, name: str | None = None) -> Path:
    """Ship a measured results CSV as reference results, with its provenance beside it.

    Rows already shipped for other GPUs are kept, so each GPU class adds its own; rows of the same GPU are replaced.
    """
    frame = load(csv_path)
    if frame.empty or "device_name" not in frame:
        raise ResultsFileError(f"{csv_path} has no measured rows to ship as a reference")
    if frame["quick"].astype(str).str.lower().ne("false").any():
        raise ResultsFileError(f"{csv_path} holds quick-mode rows; reference results come from full runs only")
    on_cpu = ~frame["device"].astype(str).str.startswith("cuda")
    if on_cpu.any():
        raise ResultsFileError(f"{csv_path} holds {on_cpu.sum()} row(s) not measured on a GPU (device "
                               f"{frame.loc[on_cpu, 'device'].iloc[0]!r}); reference results come from real GPUs only")
    note = caveat_note(frame)
    if note:  # shipped all the same, with the caveat beside them; a rerun on a quiet machine replaces them
        noted = " ".join(caveats(frame))
        advice = ("Re-record them on an idle, cool machine for cleaner reference results." if
                  "oversubscribed" in noted or "slowed down" in noted else
                  "A GPU at its power limit under long, dense work is normal: nothing to re-record for that.")
        print(f"note: {csv_path}: {note} {advice}", file=sys.stderr)
    name = name or Path(csv_path).stem
    REFERENCE_DIR.mkdir(exist_ok=True)
    target = REFERENCE_DIR / f"{name}.csv"
    if target.exists():  # other GPUs' rows stay; this GPU's earlier rows are replaced
        shipped = load(target)
        frame = pd.concat([shipped[~shipped["device_name"].isin(frame["device_name"])], frame], ignore_index=True)
    frame.to_csv(target, index=False)
    measured = frame["recorded_at"].dropna().astype(str) if "recorded_at" in frame else pd.Series(dtype=str)
    provenance = {
        "devices": _values(frame, "device_name"),
        "drivers": _values(frame, "driver"),
        "torch": _values(frame, "torch"),
        "measured": [measured.min(), measured.max()] if len(measured) else [],
        "command": command,
    }
    (REFERENCE_DIR / f"{name}.json").write_text(json.dumps(provenance, indent=2, allow_nan=False) + "\n")
    return target


def _values(frame: pd.DataFrame, column: str) -> list[str]:
    """The distinct values of a column as text, empty cells left out (JSON has no NaN)."""
    if column not in frame:
        return []
    return sorted({str(v) for v in frame[column] if not (isinstance(v, float) and math.isnan(v))})


def _plain_name(name: str) -> str:
    """``name`` when it is a plain file name (no folders, no '..'), else ValueError."""
    if (not isinstance(name, str) or not name.strip() or name in (".", "..") or "\0" in name
            or any(sep in name for sep in ("/", "\\", os.sep))):
        raise ValueError(f"a results name is a plain name such as 'matmul_sweep' (no folders, no '..'), got {name!r}; "
                         "pass directory=... to write elsewhere")
    return name


def _set_aside_torn_row(path: Path) -> None:
    """A file of ours cut off mid-row (an interrupted write) loses that partial row to ``<file>.torn`` before
    the next append, so the new row starts on a line of its own; says so on stderr. Other files are left as
    they are (reading them says what is wrong)."""
    try:
        with path.open("rb") as f:
            if not f.read(len(_OURS)) == _OURS:
                return
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read()
    except OSError:
        return  # missing, or unreadable: reading the header says so
    if not tail or tail.endswith(b"\n"):
        return
    cut = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else (0 if size <= len(tail) else size)
    if cut == size:
        return  # one row longer than 64 KiB: leave it to the reader
    side = path.with_name(path.name + ".torn")
    with path.open("r+b") as f:
        f.seek(cut)
        torn = f.read()
        with side.open("ab") as out:
            out.write(torn + b"\n")
        f.truncate(cut)
    if cut == 0:  # the header itself was cut off: start a new file
        path.unlink()
    print(f"note: {path} ended in a cut-off row (an interrupted write); it was moved to {side} and the file "
          "goes on from its last whole row", file=sys.stderr)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _write(path: Path, columns: list[str], rows: list[dict]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def _unreadable(path: Path, err: Exception) -> ResultsFileError:
    return ResultsFileError(
        f"cannot read {path} ({err}). It was left untouched: move it aside (rename it to "
        f"{path.name}.broken) to start a new file, or repair it by hand."
    )
