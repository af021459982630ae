"""Layers point one way, no module imports itself back, none is over 700 lines (issue 25; the
native sources neither), no class over 250, and only ``graphtree._torch`` touches torch's private
APIs (the house's rules).

Read from the sources with ``ast`` (imports inside functions and under ``TYPE_CHECKING`` count: a
reader follows them too): the bottom (``_torch``, ``_native``, ``_events``, ``_streams``) and the core
(``graphtree.tree``) never import a tool (``debug``, ``profile``, ``share``, ``bench``, ``demo``,
``cli``) nor the package root; the bottom never imports the core; and there is no import
cycle anywhere in ``graphtree/`` (``KNOWN_CYCLES`` is empty, and may only shrink).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "graphtree"

KNOWN_CYCLES: set[frozenset[str]] = set()  # none left; a cycle found later goes here only with a reason

BOTTOM = ("graphtree._torch", "graphtree._native", "graphtree._events", "graphtree._after_import", "graphtree._streams")
CORE = ("graphtree.tree",)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _cycles(edges: dict[str, set[str]], names: list[str]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in names:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_core_and_the_bottom_never_import_upwards():
    modules = _modules()
    edges = _imports(modules)
    upward = []
    for name, targets in edges.items():
        for t in targets:
            below = BOTTOM if _within(name, BOTTOM) else (*BOTTOM, *CORE) if _within(name, CORE) else None
            if below is not None and not _within(t, below):
                upward.append(f"{name} -> {t}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_but_the_known_ones():
    modules = _modules()
    cycles = _cycles(_imports(modules), sorted(modules))
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"new import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"cycles that no longer exist: remove them from KNOWN_CYCLES: {gone}"


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "graphtree"
    (pkg / "tree").mkdir(parents=True)
    (pkg / "debug").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tree" / "__init__.py").write_text("")
    (pkg / "debug" / "__init__.py").write_text("")
    (pkg / "tree" / "a.py").write_text("from graphtree.tree import b\n")
    (pkg / "tree" / "b.py").write_text(
        "def f():\n    from graphtree.tree.a import x\n    from graphtree.debug import d\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    edges = _imports(_modules())
    assert edges["graphtree.tree.b"] == {"graphtree.tree.a", "graphtree.debug"}
    assert _cycles(edges, sorted(_modules())) == [frozenset({"graphtree.tree.a", "graphtree.tree.b"})]


MAX_LINES = 700


MAX_CLASS_LINES = 250


def _too_long(root: Path) -> dict[str, int]:
    sources = [p for pattern in ("*.py", "*.cpp", "*.h") for p in root.rglob(pattern)]
    sizes = {str(p.relative_to(root.parent)): len(p.read_text().splitlines()) for p in sources}
    return {name: n for name, n in sizes.items() if n > MAX_LINES}


def _long_classes(root: Path) -> dict[str, int]:
    """``file:Class`` -> lines, for each class over MAX_CLASS_LINES (its decorators left out)."""
    found = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    found[f"{path.relative_to(root.parent)}:{node.name}"] = lines
    return found


def test_no_module_is_over_700_lines_and_no_developer_tools_ship():
    assert _too_long(ROOT) == {}, "split where the jobs are (issue 25)"
    assert not (ROOT / "_dev").exists(), "developer tools live in tools/, outside the package"


def test_the_size_check_sees_a_long_module(tmp_path):
    (tmp_path / "graphtree").mkdir()
    (tmp_path / "graphtree" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "graphtree" / "big.cpp").write_text("int x;\n" * (MAX_LINES + 1))
    (tmp_path / "graphtree" / "small.h").write_text("int y;\n" * MAX_LINES)
    assert _too_long(tmp_path / "graphtree") == {"graphtree/big.py": MAX_LINES + 1, "graphtree/big.cpp": MAX_LINES + 1}


def test_no_class_is_over_250_lines():
    assert _long_classes(ROOT) == {}, "split where the jobs are (the house's rule: no class over 250 lines)"


def test_the_class_check_sees_a_long_class(tmp_path):
    (tmp_path / "graphtree").mkdir()
    body = "    x = 1\n" * MAX_CLASS_LINES  # (with its `class` line: one over)
    (tmp_path / "graphtree" / "big.py").write_text(f"class Big:\n{body}\nclass Small:\n    x = 1\n")
    assert _long_classes(tmp_path / "graphtree") == {"graphtree/big.py:Big": MAX_CLASS_LINES + 1}


def test_the_tools_are_reachable_from_the_package_and_share_costs_nothing_until_used():
    import subprocess
    import sys

    code = (
        "import sys, graphtree\n"
        "print('share' in sys.modules.get('graphtree').__dict__, 'graphtree.share' in sys.modules)\n"
        "print(graphtree.share.attach.__module__, graphtree.debug.dump_on_error.__module__,\n"
        "      callable(graphtree.profile))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split("\n")[0] == "False False", out  # not imported by import graphtree
    assert out.split("\n")[1] == "graphtree.share.consumer graphtree.debug.dump True", out


PUBLIC_UNDERSCORED = {"torch._dynamo.mark_dynamic"}  # (documented: torch.compile's dynamic shapes)
"""Names with an underscore that torch documents for users. (``torch.ops.*`` names operators, such
as ``aten._local_scalar_dense``, not Python APIs: never counted.)"""


def _private_uses(root: Path) -> list[str]:
    """Each place outside ``_torch/`` that reads a private name of torch's: an attribute chain from
    ``torch`` with a name that starts with one underscore (``torch._C.f``, ``torch.cuda._sleep``), a
    tensor's ``_cdata``, a private module imported (``from torch._C import ...``), by file and line."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "_torch":
            continue
        tree = ast.parse(path.read_text())
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # (part of a longer chain)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and node.attr == "_cdata":
                names = ["._cdata"]
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                chain, v = [node.attr], node.value
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id == "torch":
                    names = [".".join(["torch", *reversed(chain)])]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                underscored = any(p[:1] == "_" and p[:2] != "__" for p in parts[1:])
                private = name == "._cdata" or (parts[0] == "torch" and parts[1:2] != ["ops"] and underscored)
                if private and name not in PUBLIC_UNDERSCORED:
                    found.append((str(path.relative_to(root.parent)), node.lineno, name))
    return [f"{path}:{line}: {name}" for path, line, name in sorted(found)]


def test_only_the_torch_package_touches_torchs_private_apis():
    assert _private_uses(ROOT) == [], "go through graphtree._torch: version-gated, one place to fix on an upgrade"


def test_the_private_api_check_sees_each_kind_of_use(tmp_path):
    (tmp_path / "graphtree" / "_torch").mkdir(parents=True)
    (tmp_path / "graphtree" / "_torch" / "ok.py").write_text("import torch\nf = torch._C._get_tracing_state\n")
    (tmp_path / "graphtree" / "user.py").write_text(
        "import torch\nfrom torch._C import _cuda_getDevice\n"
        "a = torch._C.is_grad_enabled\nb = x._cdata\nc = torch.cuda._sleep\nd = torch._dynamo.mark_dynamic\n"
        "e = torch.is_grad_enabled\nf = torch.ops.aten._local_scalar_dense.default\nimport torch.nn, torch._C\n"
    )
    assert _private_uses(tmp_path / "graphtree") == [
        "graphtree/user.py:2: torch._C",
        "graphtree/user.py:3: torch._C.is_grad_enabled",
        "graphtree/user.py:4: ._cdata",
        "graphtree/user.py:5: torch.cuda._sleep",
        "graphtree/user.py:9: torch._C",
    ]
