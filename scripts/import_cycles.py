"""Import cycles among pagedattn's modules, read from the source (nothing is imported).

Every import counts, the ones inside functions too: a lazy import still ties two modules
together. An edge goes to the module named (``from pagedattn.bench.peers import flashinfer``
-> ``pagedattn.bench.peers.flashinfer``; ``from pagedattn import write_kv`` -> ``pagedattn``);
the parent packages a dotted import runs on the way are not edges. A cycle is a strongly
connected component of two or more modules.

    python scripts/import_cycles.py [ROOT]     # prints each cycle; exits 1 if there is one
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path, package: str = "pagedattn") -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package under ``root``."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from package import submodule" names the submodule; anything else names base
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            # "import pagedattn.x.y" and "from pagedattn.x.y import f" tie to the deepest known module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with two or more modules (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    graph = import_graph(root)
    found = cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(found)} import cycles")
    for component in found:
        inside = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & inside)]
        print(f"  {len(component)} modules: " + "; ".join(edges))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
