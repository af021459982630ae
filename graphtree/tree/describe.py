"""Render the trees as text or Graphviz dot, for :func:`graphtree.describe`."""

from __future__ import annotations

from collections.abc import Iterable

from graphtree.tree.manager import TreeManager, managers
from graphtree.tree.node import Node, Root, below, signature
from graphtree.tree.numbers import describe_numbers


def _label(node: Node) -> str:
    return (
        f"{signature(node)} [{node.id}] replays={node.replays} "
        f"outputs={node.outputs.nbytes / 2**20:.2f} MiB capture={node.capture_seconds * 1e3:.1f} ms"
        + "".join(f" | {brk}" for brk in node.reads)
    )


def _callables(root: Root) -> dict[int, str]:
    """The graphed callables recorded in a tree: id -> name, in the order met."""
    found: dict[int, str] = {}
    todo: list[Node | Root] = [root]
    while todo:
        for k in below(todo.pop()):
            found.setdefault(k.key[0], k.name)
            todo.append(k)
    return found


def render(managers: Iterable[TreeManager], format: str) -> str:
    managers = sorted(managers, key=lambda m: (m.thread, m.device))
    if format == "dot":
        lines = ["digraph graphtree {", "  node [shape=box, fontname=monospace];"]
        for i, m in enumerate(managers):
            root = f"t{i}_root"
            lines.append(f'  {root} [label="cuda:{m.device} ({m.thread})", shape=ellipse];')
            stack: list[tuple[str, Node | Root]] = [(root, m.walk.root)]
            while stack:
                parent_id, node = stack.pop()
                for k in below(node):
                    kid = f"t{i}_{k.id}"
                    lines.append(f'  {kid} [label="{_label(k)}"];')
                    lines.append(f"  {parent_id} -> {kid};")
                    stack.append((kid, k))
        lines.append("}")
        return "\n".join(lines)
    if not managers:
        return "graphtree: no trees yet (no graphed call has reached a GPU)"
    out = []
    for m in managers:
        pool = m.pool_bytes() / 2**20
        out.append(f"tree cuda:{m.device} (thread {m.thread}): pool {pool:.1f} MiB, step {m.walk.generation}")
        where = m.pool_breakdown()
        if where:
            out.append(f"  pool: {where}")

        def walk(node: Node | Root, prefix: str) -> None:
            kids = below(node)
            for j, k in enumerate(kids):
                last = j == len(kids) - 1
                out.append(prefix + ("└─ " if last else "├─ ") + _label(k))
                walk(k, prefix + ("   " if last else "│  "))

        walk(m.walk.root, "")
        for gc_id, name in _callables(m.walk.root).items():  # their Python numbers: device scalars or values, why
            out.extend(f"  {name}: {line}" for line in describe_numbers(gc_id))
    return "\n".join(out)


def describe(format: str = "text") -> str:
    """The trees as text (default) or as Graphviz ``dot`` (``format="dot"``).

    Example::

        print(graphtree.describe())
    """
    if format not in ("text", "dot"):
        raise ValueError(f"describe(format=...) takes 'text' or 'dot', not {format!r}")
    return render(managers(), format)
