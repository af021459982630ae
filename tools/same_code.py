"""Whether graphtree/'s code is the same at a revision as in the working tree, docstrings and comments aside.

A change to ``graphtree/`` needs the GPU suites, ``own`` and the OpInfo sweep again before an issue
that touches the core is resolved (``docs/gpu-notes.md``). A change to its docstrings, comments or
design notes alone does not: this tells the two apart. It compares each Python file's syntax tree
with every string statement (module, class, function and attribute docstrings) taken out, and any
other file (the C++ sources, the build) byte for byte; ``.md`` files are listed, not compared.

Exit status 0 where the code is the same, 1 where it differs (the files are named).

Example::

    python tools/same_code.py f807070
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import subprocess
import sys

_BODIES = ("body", "orelse", "finalbody")


def _is_string_statement(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def code_of(source: str) -> str:
    """The syntax tree of ``source`` without its string statements, dumped."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in _BODIES:
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                kept = [s for s in body if not _is_string_statement(s)]
                setattr(node, field, kept or [ast.Pass()])
    return ast.dump(tree)


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], capture_output=True, check=True).stdout


def _same_code(path: str, old: bytes | None, new: bytes | None) -> bool:
    if path.endswith(".md"):
        return True
    if not path.endswith(".py") or old is None or new is None:
        return False
    return code_of(old.decode()) == code_of(new.decode())


def differing(rev: str, root: str = "graphtree") -> tuple[list[str], list[str]]:
    """(files whose code differs, files that differ in docstrings, comments or notes only): the
    tracked files under ``root`` that git finds changed between ``rev`` and the working tree."""
    top = pathlib.Path(_git("rev-parse", "--show-toplevel").decode().strip())
    changed = _git("-C", str(top), "diff", "--name-only", "--no-renames", rev, "--", root).decode().split()
    code, words = [], []
    for path in changed:
        new = (top / path).read_bytes() if (top / path).exists() else None
        old = _git("-C", str(top), "show", f"{rev}:{path}") if _in(rev, path, top) else None
        (words if _same_code(path, old, new) else code).append(path)
    return code, words


def _in(rev: str, path: str, top: pathlib.Path) -> bool:
    return bool(_git("-C", str(top), "ls-tree", "--name-only", rev, "--", path).strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the revision to compare with (a commit, a tag, a branch)")
    parser.add_argument("--root", default="graphtree", help="the folder compared (default: graphtree)")
    args = parser.parse_args()
    code, words = differing(args.rev, args.root)
    for path in words:
        print(f"docstrings, comments or notes only: {path}")
    if code:
        print(f"code differs from {args.rev}:", *code)
        return 1
    print(f"the code of {args.root}/ is the same as at {args.rev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
