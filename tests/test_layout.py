"""The house rules of docs/ARCHITECTURE.md ("Rules"), checked on the package's source.

No import cycles between onnxdiag modules, no import of another module's ``_private`` name,
no module over 400 lines and no function over 60 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "onnxdiag"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(modules: dict[str, Path]) -> dict[str, set[tuple[str, str | None, int]]]:
    """module -> {(imported module, imported name or None, line)} within onnxdiag."""
    graph: dict[str, set] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {(a.name, None, node.lineno) for a in node.names
                          if a.name.startswith("onnxdiag")}
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_package, node)
                if not target.startswith("onnxdiag"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add((sub, None, node.lineno) if sub in modules
                              else (target, alias.name, node.lineno))
        graph[name] = found
    return graph


def test_no_import_cycles():
    """Lazy imports inside functions count too: a cycle hidden in a function is still one."""
    modules = _modules()
    edges = {m: {t for t, _, _ in deps if t in modules and t != m}
             for m, deps in _imports(modules).items()}
    # A package's __init__ importing its own submodules is not a cycle through the package.
    for m in edges:
        edges[m] = {t for t in edges[m] if not (m.startswith(t + ".") and modules[t].name
                                                == "__init__.py")}
    colour: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        colour[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if colour.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in colour:
                visit(t, stack)
        stack.pop()
        colour[m] = 2

    for m in sorted(edges):
        if m not in colour:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_no_private_names_imported_across_modules():
    modules = _modules()
    bad = []
    for m, deps in _imports(modules).items():
        for target, name, line in deps:
            leaf = (name or target.rsplit(".", 1)[-1])
            private = leaf.startswith("_") and not leaf.startswith("__")
            same_package = target.rsplit(".", 1)[0] == m.rsplit(".", 1)[0]
            if private and target != m and not (name is None and same_package):
                bad.append(f"{modules[m].relative_to(PACKAGE.parent)}:{line} imports "
                           f"{target}{'.' + name if name else ''}")
    assert not bad, "private imports:\n" + "\n".join(bad)


def test_module_and_function_sizes():
    too_long = []
    for path in _modules().values():
        text = path.read_text()
        lines = text.count("\n")
        rel = path.relative_to(PACKAGE.parent)
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{rel}: module of {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}() of {n} lines")
    assert not too_long, "over the size rules:\n" + "\n".join(too_long)


def test_architecture_module_list_matches_the_tree():
    """docs/ARCHITECTURE.md's "Modules" block names every module of the package, and only those."""
    import re

    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    block = text[text.index("```\nonnxdiag/") + 4:]
    block = block[:block.index("\n```")]
    listed, package = set(), ""
    for line in block.splitlines()[1:]:
        if re.fullmatch(r"  [a-z_]+/", line):
            package = line.strip()
            continue
        m = re.match(r"( +)(\S+\.py)\b", line)
        if m:
            listed.add((package if len(m.group(1)) == 4 else "") + m.group(2))
    actual = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    missing = sorted(actual - listed)
    assert not missing, f"modules missing from docs/ARCHITECTURE.md: {missing}"
    assert not listed - actual, f"listed but not in the tree: {sorted(listed - actual)}"
