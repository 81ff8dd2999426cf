"""What `make verify-gpu` leaves in its output folder: at most ``MAX_FILES`` files of at most ``FILE_LIMIT`` bytes,
each rewritten whole (then moved into place) as soon as a part ends, so that a run cut off keeps what finished:

- ``verify-gpu.tar.gz``: the bundle, to unpack at the repository's root: the reference results shipped
  (``gpulab/reference/``), and under ``build/verify-gpu/`` the summary, the monitor log, the executed notebooks,
  the logs (their last MiB) and the results the lessons wrote; what would not fit is named in ``left-out.txt``;
- ``summary.txt``: what ran, how each part ended, the warnings a learner would see;
- ``monitor.csv``: the GPU sampled every second through the run (gpulab's NVML monitor), appended as it goes.
"""

import csv
import tarfile
import threading
import time
from datetime import datetime, timezone
from io import BytesIO
from pathlib import Path

BUNDLE, SUMMARY, MONITOR = "verify-gpu.tar.gz", "summary.txt", "monitor.csv"
MAX_FILES = 8
FILE_LIMIT = 16 * 2**20
LOG_TAIL = 2**20  # bytes of a log kept in the bundle: its end, where it says what went wrong
ROOT = "build/verify-gpu"  # where the run's own files go in the bundle (a smoke run's: build/verify-gpu-smoke)
STOP_S = 5.0  # how long the run waits for the monitor to stop
_MARGIN = 64 * 2**10  # the tar's end blocks and padding, the list of what was left out, gzip's worst case


def write_bundle(path: Path, members: list[tuple[str, Path | bytes]], limit: int = FILE_LIMIT,
                 root: str = ROOT) -> list[str]:
    """Write ``members`` (name in the archive, a file or its bytes), in their order, to the .tar.gz ``path``,
    leaving out each that would take the archive past ``limit`` bytes; then ``root/left-out.txt`` naming those.
    The size is bounded before compression (a tar member takes its 512-byte blocks; gzip adds at most 0.1 %), so
    the archive stays under ``limit`` whatever its files hold. Written whole, then moved into place. Returns the
    names left out."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    room, left_out = limit / 1.001 - _MARGIN, []
    with tarfile.open(partial, "w:gz") as tar:
        for name, source in members:
            size = len(source) if isinstance(source, bytes) else _size(source)
            if size is not None and _cost(size) <= room and not isinstance(source, bytes):
                source = _read(source)  # read once: a file that grows meanwhile cannot break the bound
                size = None if source is None else len(source)
            if size is None:
                continue
            if _cost(size) > room:
                left_out.append(f"{name} ({size / 2**20:.1f} MiB)")
                continue
            _add(tar, name, source)
            room -= _cost(size)
        if left_out:
            note = ("Left out of this bundle to keep it under "
                    f"{limit / 2**20:g} MiB:\n" + "\n".join(left_out) + "\n").encode()[:_MARGIN // 2]
            _add(tar, f"{root}/left-out.txt", note)
    partial.replace(path)
    return left_out


def log_tail(path: Path, keep: int = LOG_TAIL) -> bytes:
    """The last ``keep`` bytes of a log, after a line saying how much was left out before them."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - keep))
        data = f.read(keep)
    if size <= keep:
        return data
    return f"[the first {size - keep} bytes of this log are left out]\n".encode() + data


def write_text(path: Path, text: str) -> None:
    """Write ``text`` whole, then move it into place (a run cut off leaves the previous version, never half)."""
    partial = Path(path).with_name(Path(path).name + ".partial")
    partial.write_bytes(text.encode()[:FILE_LIMIT])
    partial.replace(path)


class MonitorLog:
    """gpulab's NVML monitor through a run: its samples appended to ``path`` every ``every`` seconds (a run cut off
    keeps all but the last few), with the UTC time of each; ``mark(phase)`` labels the samples that follow. Stops
    within ``stop_s`` seconds even when the monitor does not."""

    def __init__(self, path: Path, monitor, every: float = 2.0, limit: int = FILE_LIMIT):
        self.path, self.monitor, self.every, self.limit = Path(path), monitor, every, limit
        self.written, self.note = 0, ""
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "MonitorLog":
        self._t0 = time.time()
        self.monitor.start()
        if not getattr(self.monitor, "available", True):
            self.note = f"no GPU samples: {getattr(self.monitor, 'reason', 'NVML is not available')}"
        with self._lock:
            columns = list(self.monitor.frame().columns)
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(["utc", *columns])
        self._thread = threading.Thread(target=self._run, name="gpulab-verify-monitor-log", daemon=True)
        self._thread.start()
        return self

    def mark(self, phase: str) -> None:
        self.monitor.mark(phase)

    def flush(self) -> None:
        """Append the samples taken since the last flush (up to the file's size limit)."""
        with self._lock:
            frame = self.monitor.frame()
            rows = frame.iloc[self.written:]
            if rows.empty or not self.path.exists() or self.path.stat().st_size > self.limit - 4096:
                return
            with self.path.open("a", newline="") as f:
                writer = csv.writer(f)
                for row in rows.itertuples(index=False):
                    stamp = datetime.fromtimestamp(self._t0 + row[0], timezone.utc).isoformat(timespec="seconds")
                    writer.writerow([stamp, *row])
            self.written += len(rows)

    def stop(self, stop_s: float | None = None) -> str:
        """Stop sampling and write the last samples; a note when the monitor did not stop within ``stop_s``
        (default ``STOP_S``)."""
        stop_s = STOP_S if stop_s is None else stop_s
        self._stop.set()
        stopper = threading.Thread(target=self.monitor.stop, name="gpulab-verify-monitor-stop", daemon=True)
        stopper.start()
        stopper.join(stop_s)
        if stopper.is_alive():
            self.note = (f"{self.note}; " if self.note else "") + (
                f"the monitor did not stop within {stop_s:g} s: its log ends at the run's end")
        self.flush()
        return self.note

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.flush()


def _size(path: Path) -> int | None:
    try:
        return Path(path).stat().st_size
    except OSError:
        return None


def _read(path: Path) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


def _cost(size: int) -> int:
    """Bytes a member of ``size`` bytes takes in a tar: its header and its data in 512-byte blocks."""
    return 512 + -(-size // 512) * 512


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, BytesIO(data))
