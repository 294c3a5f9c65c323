"""The import-layer check: every module imports only from its own phase or the phases below.

    python -m graphpipe.tools.deps          # prints the layers; exits 1 on a violation

The layers, lowest first (a module may import from its own layer and any lower one):

    core        errors, _units, _torch (the one adapter over torch's private APIs)
    ir          the plain data every phase shares: Plan, Schedule, Action, Timeline, CostModel
    tracing     nn.Module -> annotated fx.GraphModule
    scheduling  Plan -> Schedule -> Program; the simulator and the dry run (IR only)
    planning    fx.GraphModule -> Plan (compares candidates with the simulator)
    runtime     one process per device: stages, transport, executor, policies, checkpoints
    compile     the entry point that wires the phases
    tools       render, timeline, report, calibrate, workload, train, cli, deps
    graphpipe   the package's public names (`graphpipe/__init__.py`)

Every import counts, at module level or inside a function, `TYPE_CHECKING` ones too: a
lazy import is still an arrow between phases. Two modules that import each other, directly
or through others, are a cycle, reported even within one layer.

Private torch. Outside `graphpipe/_torch.py` no module imports a private torch module or
name (a component with a leading underscore: `torch._C`, `torch.distributed._tools`) or
reads one (`torch._C._autograd._profiler_enabled()`): each use is a function of the
adapter, with its test. Exempt: operators (`torch.ops.aten._assert_async`, names in a
schema registry, not Python API) and dunders (`torch.__version__`). torch's pytree API is
re-exported by `_torch` (`_torch.PYTREE`) and imported from there.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

__all__ = ["LAYERS", "Violation", "check", "import_graph", "layer_of", "private_torch"]

ADAPTER = "graphpipe._torch"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("graphpipe.errors", "graphpipe._units", "graphpipe._torch")),
    ("ir", ("graphpipe.ir",)),
    ("tracing", ("graphpipe.tracing",)),
    ("scheduling", ("graphpipe.scheduling",)),
    ("planning", ("graphpipe.planning",)),
    ("runtime", ("graphpipe.runtime",)),
    ("compile", ("graphpipe.compile",)),
    ("tools", ("graphpipe.tools",)),
    ("graphpipe", ("graphpipe",)),
)


@dataclass(frozen=True)
class Violation:
    """One broken rule: an import up the layers, or a cycle of modules."""

    kind: str  # "upward", "cycle" or "private"
    modules: tuple[str, ...]  # importer, imported (upward); the modules of the cycle
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def layer_of(module: str) -> int:
    """The index in `LAYERS` of a graphpipe module (the longest matching prefix).

    Raises:
        ValueError: `module` is not in any layer.
    """
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    if best is None:
        raise ValueError(f"module {module!r} is in no layer of graphpipe.tools.deps.LAYERS")
    return best[0]


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file under the package directory `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(module or module.name, line) for every import in `tree`, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")
                parent = parent if is_package else parent[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno
            yield base, node.lineno


def import_graph(root: Path) -> nx.DiGraph:
    """Modules of the package at `root` and their imports of each other; each edge carries
    the line of its first import (`line`)."""
    modules = _modules(root)
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for target, line in _imported(tree, name, path.name == "__init__.py"):
            if target in modules and target != name and not g.has_edge(name, target):
                g.add_edge(name, target, line=line)
    return g


def _private(dotted: str) -> bool:
    """Whether a torch name (`torch.a._b.c`) has a private component, operators and dunders
    aside."""
    parts = dotted.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"]:
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    """`torch.a.b` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _torch_uses(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(torch name, line) of every private torch import or attribute read in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
        else:
            continue
        for name in names:
            if _private(name):
                yield name, node.lineno


def private_torch(root: Path) -> list[Violation]:
    """Every use of a private torch name outside the adapter, in the package at `root`."""
    found: dict[tuple[str, str], int] = {}
    for module, path in _modules(root).items():
        if module == ADAPTER:
            continue
        uses = list(_torch_uses(ast.parse(path.read_text(), str(path))))
        for name, line in uses:  # a chain's longest name only (torch._C._a, not torch._C)
            if not any(n.startswith(name + ".") and at == line for n, at in uses):
                found.setdefault((module, name), line)
    return [
        Violation(
            "private",
            (module, name),
            f"{module} (line {line}) uses {name}, a private torch name: make it a function "
            "of graphpipe/_torch.py, with its test",
        )
        for (module, name), line in sorted(found.items())
    ]


def check(root: Path | None = None) -> list[Violation]:
    """Every upward import, every import cycle and every private torch name outside the
    adapter in the package at `root` (graphpipe's own by default)."""
    package = root or Path(__file__).resolve().parents[1]
    g = import_graph(package)
    problems = private_torch(package)
    for a, b, line in sorted(g.edges(data="line")):
        if layer_of(b) > layer_of(a):
            problems.append(
                Violation(
                    "upward",
                    (a, b),
                    f"{a} (layer {LAYERS[layer_of(a)][0]}, line {line}) imports {b} "
                    f"(layer {LAYERS[layer_of(b)][0]})",
                )
            )
    for component in nx.strongly_connected_components(g):
        if len(component) > 1:
            cycle = nx.find_cycle(g.subgraph(component))
            path = " -> ".join([cycle[0][0], *(b for _, b in cycle)])
            problems.append(Violation("cycle", tuple(sorted(component)), path))
    return problems


def main() -> int:
    """Print the layers and every violation; 1 when there is one."""
    problems = check()
    for name, prefixes in LAYERS:
        print(f"  {name:<11} {', '.join(prefixes)}")
    for p in problems:
        print(p)
    clean = "no upward import, no cycle, no private torch name outside _torch"
    print(f"{len(problems)} violation(s)" if problems else clean)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
