"""The import layers, checked: every import points down the stack (or within its layer), and no
two files or packages import each other, however indirectly. docs/ARCHITECTURE.md draws it.

    python scripts/check_layers.py        # prints each violation; exit status 1 if any
"""

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("workers", "speculative", "deployments")
# bottom to top: a module belongs to the layer of its longest matching package
LAYERS = (
    ("workers.layers", "TP layers, RoPE, attention and its kernels, KV cache addressing"),
    ("workers.models", "model config, the shared decoder, one file per family, weights"),
    ("speculative", "speculation algorithms over tensors; shared types (config, plan)"),
    ("workers", "the per-rank step: runner, verifier, graphs, worker actor"),
    ("speculative.engine", "requests, scheduler, block manager, coordinator, executor"),
    ("speculative.train", "drafter training (the engine writes its data)"),
    ("deployments", "HTTP, Ray Serve, the CLI, bench"),
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    where: str  # path:line


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages under root."""
    names = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def package_of(module: str, names: dict[str, Path]) -> str:
    """A package is itself; a plain module belongs to the package that holds it."""
    is_package = names[module].name == "__init__.py"
    return module if is_package else module.rpartition(".")[0]


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, (prefix, _) in enumerate(LAYERS)
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1]  # every module is under a root, and every root is a layer


def imports(root: Path, names: dict[str, Path]) -> list[Import]:
    """Every import of a project module, at any depth of the file (lazy imports included)."""
    found = []
    for source, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            for target in imported(node, names):
                if target != source:
                    found.append(Import(source, target, where))
    return found


def imported(node: ast.AST, names: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in names]
    if not isinstance(node, ast.ImportFrom) or node.level or node.module not in names:
        return []
    # `from package import module` imports the module; `from module import name` the module
    submodules = [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in submodules if m in names] or [node.module]


def upward(found: list[Import]) -> list[str]:
    errors = []
    for imp in found:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if dst > src:
            errors.append(
                f"{imp.where}: {imp.source} ({LAYERS[src][0]}) imports {imp.target}, "
                f"which is above it ({LAYERS[dst][0]})"
            )
    return errors


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def violations(root: Path) -> list[str]:
    names = module_names(root)
    found = imports(root, names)
    errors = upward(found)
    files, packages = {}, {}
    for imp in found:
        files.setdefault(imp.source, set()).add(imp.target)
        src, dst = package_of(imp.source, names), package_of(imp.target, names)
        if src != dst:
            packages.setdefault(src, set()).add(dst)
    errors += [f"files import each other: {' -> '.join(c)}" for c in cycles(files)]
    errors += [f"packages import each other: {' -> '.join(c)}" for c in cycles(packages)]
    return errors


def main() -> int:
    errors = violations(Path(__file__).resolve().parent.parent)
    for error in errors:
        print(error)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
