"""Stopping a long run cleanly: Ctrl-C and SIGTERM both raise ``KeyboardInterrupt`` in the main thread, so that
``gpulab course``, ``gpulab grade`` and the GPU verification end what they started and keep what finished."""

import signal
import threading


def signals_raise():
    """Make SIGTERM raise KeyboardInterrupt("SIGTERM") and Ctrl-C raise KeyboardInterrupt, so that runs clean up, even
    where this process started with SIGINT ignored or blocked (inherited from the process that started it); returns
    the SIGTERM handler it replaced (None where it can't: outside the main thread)."""
    def stop(*_):
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        return None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return signal.signal(signal.SIGTERM, stop) or signal.SIG_DFL


def stopped_status(signal_name: str) -> int:
    """The exit status of a run stopped by ``signal_name`` ("SIGTERM", else Ctrl-C's SIGINT), as a shell reports it."""
    return 128 + (signal.SIGTERM if signal_name == "SIGTERM" else signal.SIGINT)
