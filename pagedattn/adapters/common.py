"""Import and device gates shared by the adapters (they import no outside library)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch


class NotApplicable(ValueError):
    """The library cannot compute this call as asked (a feature, dtype or shape it lacks).

    Raised before anything launches; the message says what is missing.
    """


def module_status(name: str) -> tuple[bool, str]:
    """(importable, why not) for an optional top-level package."""
    try:
        missing = importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # already in sys.modules without a spec
        missing = name not in sys.modules
    if missing:
        return False, f"{name} is not installed"
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure makes the library unavailable
        return False, f"{name} does not import ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return True, ""


def gpu_status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False, "TRITON_INTERPRET=1 (CPU run)"
    return True, ""


def first_failure(*statuses) -> tuple[bool, str]:
    """The first ``(False, why)`` of the status functions, called in order, or ``(True, "")``."""
    for status in statuses:
        ok, why = status()
        if not ok:
            return ok, why
    return True, ""


def query_lens_of(query_start_loc: list[int]) -> list[int]:
    return [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
