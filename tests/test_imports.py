"""The package's import graph: no cycles (lazy imports inside functions count), and the kernels
import nothing above them."""

from pathlib import Path

from tests.scripts_support import load_script

ROOT = Path(__file__).resolve().parent.parent


def _import_cycles():
    return load_script("import_cycles")


def test_no_import_cycles():
    ic = _import_cycles()
    graph = ic.import_graph(ROOT)
    assert "pagedattn.api" in graph and graph["pagedattn.api"]  # the graph was read
    assert ic.cycles(graph) == []


def test_the_detector_finds_a_lazy_cycle(tmp_path):
    ic = _import_cycles()
    pkg = tmp_path / "pagedattn"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pagedattn.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pagedattn.a import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = ic.import_graph(tmp_path)
    assert graph["pagedattn.c"] == {"pagedattn.a"}
    assert ic.cycles(graph) == [["pagedattn.a", "pagedattn.sub.b"]]


def test_kernels_import_nothing_above_them():
    graph = _import_cycles().import_graph(ROOT)
    upward = {m: sorted(t for t in targets if not t.startswith("pagedattn.ops"))
              for m, targets in graph.items() if m.startswith("pagedattn.ops")}
    assert {m: t for m, t in upward.items() if t} == {}
