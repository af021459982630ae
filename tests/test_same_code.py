"""tools/same_code.py tells a change to graphtree/'s code from one to its docstrings and comments alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from same_code import code_of  # tools/ is on the path (conftest.py)

BEFORE = '''
"""A module."""

X = 1
"""X's docstring."""


def f(a):
    """f's docstring."""
    # a comment
    return a + X
'''


def test_docstrings_and_comments_do_not_count_as_code() -> None:
    after = BEFORE.replace("f's docstring.", "f, said again.").replace("# a comment", "# another")
    after = after.replace('"""X\'s docstring."""\n', "")
    assert code_of(after) == code_of(BEFORE)


@pytest.mark.parametrize(
    "change",
    [("return a + X", "return a - X"), ("X = 1", "X = 2"), ('"""f\'s docstring."""', "a = -a")],
)
def test_a_change_to_the_code_counts(change: tuple[str, str]) -> None:
    assert code_of(BEFORE.replace(*change)) != code_of(BEFORE)


def test_a_function_left_with_its_docstring_alone_is_still_told_from_one_with_code() -> None:
    only_doc = 'def f():\n    """Nothing."""\n'
    assert code_of(only_doc) == code_of("def f():\n    pass\n")
    assert code_of(only_doc) != code_of("def f():\n    return 1\n")


def test_the_command_names_the_files_whose_code_differs(tmp_path: Path) -> None:
    tool = Path(__file__).resolve().parents[1] / "tools" / "same_code.py"

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    pkg = tmp_path / "graphtree"
    pkg.mkdir()
    (pkg / "a.py").write_text(BEFORE)
    (pkg / "b.py").write_text(BEFORE)
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "base")
    (pkg / "a.py").write_text(BEFORE.replace("f's docstring.", "Changed words."))
    run = [sys.executable, str(tool), "HEAD"]
    same = subprocess.run(run, check=False, cwd=tmp_path, capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "only: graphtree/a.py" in same.stdout
    (pkg / "b.py").write_text(BEFORE.replace("a + X", "a * X"))
    differs = subprocess.run(run, check=False, cwd=tmp_path, capture_output=True, text=True)
    assert differs.returncode == 1
    assert "code differs from HEAD: graphtree/b.py" in differs.stdout
