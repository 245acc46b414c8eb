"""Terminal helpers the commands share (``pagedattn check``, ``bench``, ``generate``).

A progress display that redraws one line on a terminal and prints plain lines otherwise (logs
get one line per finished step, never a stream of carriage returns), and the banner a
benchmark prints when it runs in Triton's interpreter. Nothing here imports torch at import time.
"""

from __future__ import annotations

import os
import sys
import time


def gpu_present() -> bool:
    """A CUDA/ROCm GPU that the kernels will use (not forced into the interpreter)."""
    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


INTERPRETER_BANNER = (
    "No GPU: this is a correctness run in Triton's interpreter on small shapes. Each case is checked "
    "against the reference (pass/fail); timings are interpreter timings and mean nothing about speed."
)
ENGINE_INTERPRETER_BANNER = (
    "No GPU: the engine runs in Triton's interpreter on a tiny model. Nothing is compared with a "
    "reference; timings are interpreter wall times and mean nothing about speed."
)


def interpreter_banner(stream=None, *, checked: bool = True) -> None:
    """The banner of a run in the interpreter; ``checked``: its rows are compared with a reference."""
    print(INTERPRETER_BANNER if checked else ENGINE_INTERPRETER_BANNER, file=stream or sys.stderr, flush=True)


class Progress:
    """Rows printed as they finish, with the count and the elapsed time.

    On a terminal a status line (the running step, elapsed time, estimated time left) is redrawn
    below the rows; elsewhere (a log file, CI) only the finished rows are printed, one line each.
    ``weights``: relative cost of each step, for the time-left estimate.
    """

    def __init__(self, total: int, *, weights=None, stream=None, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)()) if live is None else live
        self.total = total
        self.weights = list(weights) if weights is not None else [1.0] * total
        self.count = 0
        self._t0 = time.perf_counter()
        self._drawn = False

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def _left(self) -> str:
        done = sum(self.weights[: self.count])
        if self.count == 0 or done <= 0:
            return ""
        left = self.elapsed * sum(self.weights[self.count:]) / done
        return f", about {left:.0f} s left"

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self._drawn = False

    def start(self, label: str) -> None:
        """A step begins (shown only on a terminal)."""
        if not self.live:
            return
        self._clear()
        width = 100
        line = f"[{self.count + 1}/{self.total}] {self.elapsed:.0f} s{self._left()}: {label}"
        self.stream.write(line[:width])
        self.stream.flush()
        self._drawn = True

    def done(self, text: str) -> None:
        """A step finished: print its row."""
        self.count += 1
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        """A step finished, with a short label: ``[i/n] label (elapsed)``."""
        self.done(f"[{self.count + 1}/{self.total}] {label} ({self.elapsed:.0f} s)")

    def close(self) -> None:
        self._clear()
        self.stream.flush()


def missing_packages(prog: str, extra: str, packages: dict) -> str | None:
    """A message saying what to install when any of ``packages`` (name -> what it is used for) is
    not importable, else None. ``extra``: the optional-dependency group of pyproject.toml that
    provides them."""
    import importlib.util

    def importable(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    missing = [name for name in packages if not importable(name)]
    if not missing:
        return None
    needs = ", ".join(f"{name} ({packages[name]})" for name in missing)
    return (f"{prog} needs {needs}, not installed here. From the pagedattn checkout: "
            f"pip install -e \".[{extra}]\"")
