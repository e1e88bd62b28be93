"""The package's layering, read from the source's imports (every ``import``, module level or inside a
function): each layer imports only layers below it, the packages of one layer not each other, and no
two modules import each other round a loop. The layers are README's "Layout"."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cat"

# Lowest first. A top-level module or subpackage of cat sits in exactly one layer.
LAYERS = [
    {"errors", "paper", "ops"},
    {"layers", "runtime"},
    {"data", "models"},
    {"export", "timm"},
    {"flops"},
    {"classification", "mm"},
    {"toolkit"},
]
LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The cat modules ``path`` imports, relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return {name for name in found if name == "cat" or name.startswith("cat.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target in _imports(path):
            while target not in modules and "." in target:  # `from cat.x import name`: the module is cat.x
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(m) for m in _graph()} - {"", "configs"}
    assert parts <= LAYER_OF.keys(), sorted(parts - LAYER_OF.keys())


def test_each_layer_imports_only_the_layers_below_it():
    upward = [
        f"{source} -> {target}"
        for source, targets in _graph().items()
        for target in targets
        if _part(source) in LAYER_OF
        and _part(target) != _part(source)
        and _part(target)  # the package's face, cat/__init__.py, imports nothing cat's modules import back
        and LAYER_OF[_part(target)] >= LAYER_OF[_part(source)]
    ]
    assert upward == []


def test_no_modules_import_each_other_round_a_loop():
    graph, state, loops = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                loops.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert loops == []


def test_the_reader_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    """What the checks above read: a relative and an absolute import of an upper layer (so they can fail)."""
    source = tmp_path / "cat" / "ops" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("from ..toolkit import timing\nimport cat.mm.runner\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "cat")
    assert _imports(source) >= {"cat.toolkit", "cat.toolkit.timing", "cat.mm.runner"}
