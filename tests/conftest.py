"""Test set-up: without a GPU the kernels run in Triton's interpreter (set before any import).

With pytest-xdist, a line says what each worker does before its first result (it imports the
test modules, torch, triton, transformers and helion among them, and collects the tests) and
another when it is done, so the run is not silent meanwhile. At the end of a run, a line says
why tests were skipped and how many for each reason.
"""

import os
import re
import time
from collections import Counter

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

if DEVICE == "cuda":
    from pagedattn.testing import use_scratch_allocator_when_instrumented

    use_scratch_allocator_when_instrumented()  # ConSan runs (TRITON_INSTRUMENTATION_MODE=consan)

GPU_SKIP_REASON = "needs a GPU (on a GPU machine, without TRITON_INTERPRET: pytest -m gpu)"
SHOWN_REASONS = 8  # the most frequent skip reasons listed by name; the rest are counted together


_STARTED = time.perf_counter()


def pytest_sessionstart(session):
    config = session.config
    workers = config.getoption("numprocesses", None) if not hasattr(config, "workerinput") else None
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if workers and reporter is not None:
        reporter.write_line(f"each of the {workers} workers imports the test modules (torch and triton; transformers "
                            "and helion for their files) and collects the tests before its first result")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{node.gateway.id}: {len(ids)} tests collected, "
                            f"{time.perf_counter() - _STARTED:.0f} s after the start")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords and DEVICE != "cuda":
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


# Triton 3.6's interpreter patches triton.language's builtins and tensor methods for each
# interpreted kernel, and when a kernel calls a @triton.jit helper it patches them again without
# undoing it (InterpretedFunction.__call__ drops its patch scope). A later compile in the same
# process (the Gluon kernels' compile tests compile for sm90 in-process) then meets the
# interpreter's methods: "'ir.value' object has no attribute 'dtype'". The state below is taken
# before any test runs a kernel and put back before each test.
import triton.language as _tl  # noqa: E402

_LANG_OBJECTS = (_tl, _tl.core, _tl.math, _tl.core.tensor, _tl.core.dtype, _tl.core.tensor_descriptor_base)
_PRISTINE = [(obj, dict(vars(obj))) for obj in _LANG_OBJECTS]


@pytest.fixture(autouse=True)
def _pristine_triton_language():
    for obj, saved in _PRISTINE:
        current = vars(obj)
        for name in [n for n in current if n not in saved]:
            delattr(obj, name)
        for name, value in saved.items():
            if current.get(name) is not value:
                setattr(obj, name, value)
    yield


def skip_reason(report) -> str:
    """The reason of a skipped test's report, short and without the per-test details."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ").strip()
    missing = re.match(r"could not import '([^']+)'", reason)
    if missing:
        return f"{missing.group(1)} not installed"
    return reason if len(reason) <= 100 else reason[:97] + "..."


def summarize_skips(reports) -> str | None:
    """``"209 skipped: needs a GPU (...): 180; matplotlib not installed: 20; ..."``, or None."""
    if not reports:
        return None
    counts = Counter(skip_reason(r) for r in reports)
    parts = [f"{reason}: {n}" for reason, n in counts.most_common(SHOWN_REASONS)]
    rest = sum(n for _, n in counts.most_common()[SHOWN_REASONS:])
    if rest:
        parts.append(f"{len(counts) - SHOWN_REASONS} other reasons: {rest} (pytest -rs lists each)")
    return f"{len(reports)} skipped: " + "; ".join(parts)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    line = summarize_skips(skipped)
    if line:
        terminalreporter.write_sep("-", "why tests were skipped")
        terminalreporter.write_line(line)
