"""The package's layering, read from its imports: ucm/store knows nothing of models, ucm/sparse
nothing of vLLM, imports flow one way (integration -> sparse -> store), the Blend forward does not
import the connector, and no module-level import cycle exists."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "ucm"
# Each area may import only areas of a lower or equal rank.
RANKS = {"ucm.cpus": 0, "ucm.argparse_help": 0, "ucm.models": 0, "ucm.store": 1, "ucm.sparse": 2,
         "ucm.config": 3, "ucm.integration": 4, "ucm.eval": 5}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "ucm" or m.startswith("ucm.")}


def _area(module: str) -> str:
    return ".".join(module.split(".")[:2])


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def test_every_area_has_a_rank():
    assert {_area(m) for m in MODULES if m != "ucm"} <= set(RANKS), "a new top-level area needs a rank here"


def test_imports_flow_one_way():
    upward = [f"{m} imports {i}" for m, p in MODULES.items() if m != "ucm" for i in _imports(p, False)
              if i != "ucm" and RANKS[_area(i)] > RANKS[_area(m)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_forward_does_not_import_the_connector():
    bad = [f"{m} imports {i}" for m, p in MODULES.items() if m.startswith("ucm.integration.vllm.blend")
           for i in _imports(p, False) if i.startswith("ucm.integration.vllm.connector")]
    assert not bad, "\n".join(bad)


def test_no_module_level_import_cycles():
    graph = {m: {i for i in _imports(p, True) if i in MODULES and i != m} for m, p in MODULES.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for i in sorted(graph[m]):
            visit(i)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


# A module past this has grown more than one responsibility: split it (docs/design.md, "The modules and a request's path").
MAX_MODULE_LINES = 400


def test_no_module_outgrows_one_responsibility():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
