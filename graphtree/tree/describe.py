"""Render the trees as text or Graphviz dot, for :func:`graphtree.describe`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from graphtree.tree.inputs import PLAIN_TYPES

if TYPE_CHECKING:
    from graphtree.tree.manager import TreeManager
    from graphtree.tree.node import Node, Root


def _sig(node: Node) -> str:
    parts = []
    for p in node.key[1]:
        if len(p) == 3 and isinstance(p[0], int):  # the ambient state (tree/ambient.py): not shown
            continue
        if len(p) == 3:  # tensor: (shape, dtype, stride)
            parts.append(f"{str(p[1]).replace('torch.', '')}{list(p[0])}")
        elif p[0] == "training":  # a graphed module's mode
            parts.append("train" if p[1] else "eval")
        elif p[0] == "keywords":  # the last len(names) leaves were passed by keyword
            k = len(p[1])
            parts[len(parts) - k :] = [f"{n}={v}" for n, v in zip(p[1], parts[len(parts) - k :], strict=True)]
        elif p[0] == "structure":  # containers among the arguments: their leaves are shown flat
            continue
        elif isinstance(p[0], type) and p[0] in PLAIN_TYPES:  # a plain value
            parts.append(repr(p[1]))
        else:  # an object argument: its type (its state is in the key, too long to show)
            parts.append(p[0].__name__ if isinstance(p[0], type) else "?")
    return "(" + ", ".join(parts) + ")"


def signature(node: Node) -> str:
    """A recording as people read it: its function and the call's signature, e.g. ``step(float32[4, 8], 2)``."""
    return f"{node.name}{_sig(node)}"


def _label(node: Node) -> str:
    return (
        f"{node.name}{_sig(node)} [{node.id}] replays={node.replays} "
        f"outputs={node.outputs.nbytes / 2**20:.2f} MiB capture={node.capture_seconds * 1e3:.1f} ms"
    )


def _children(node: Node | Root) -> list[Node]:
    return [k for kids in node.children.values() for k in kids]


def render(managers: Iterable[TreeManager], format: str) -> str:
    managers = sorted(managers, key=lambda m: (m.thread, m.device))
    if format == "dot":
        lines = ["digraph graphtree {", "  node [shape=box, fontname=monospace];"]
        for i, m in enumerate(managers):
            root = f"t{i}_root"
            lines.append(f'  {root} [label="cuda:{m.device} ({m.thread})", shape=ellipse];')
            stack: list[tuple[str, Node | Root]] = [(root, m.root)]
            while stack:
                parent_id, node = stack.pop()
                for k in _children(node):
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
        out.append(f"tree cuda:{m.device} (thread {m.thread}): pool {pool:.1f} MiB, step {m.generation}")

        def walk(node: Node | Root, prefix: str) -> None:
            kids = _children(node)
            for j, k in enumerate(kids):
                last = j == len(kids) - 1
                out.append(prefix + ("└─ " if last else "├─ ") + _label(k))
                walk(k, prefix + ("   " if last else "│  "))

        walk(m.root, "")
    return "\n".join(out)
