"""Stack capture of graphtree.profile: user frames kept, torch/graphtree/stdlib frames dropped."""

from __future__ import annotations

import json
import os

import graphtree
from graphtree.profile._attribution import StackTable, capture_stack, format_frame, is_user_file


def test_user_files_and_internal_files():
    import torch

    assert is_user_file(__file__)
    assert is_user_file("<string>") and not is_user_file("<frozen importlib._bootstrap>")
    assert not is_user_file(json.__file__)
    assert not is_user_file(torch.nn.modules.module.__file__)
    assert not is_user_file(graphtree.__file__)
    # graphtree's dispatch mode runs every captured operation: its frame is never the call site
    # (the GPU profile tests named StateWatch.__torch_dispatch__ once _torch.py became a package)
    from graphtree import _native
    from graphtree._torch import capture

    assert not is_user_file(capture.__file__) and not is_user_file(_native.__file__)


def _inner(table):
    return capture_stack(table)


def _outer(table):
    return _inner(table)


def test_stack_is_outermost_first_and_ends_at_the_caller():
    t = StackTable()
    frames = t.get(_outer(t))
    assert [f[2] for f in frames[-3:]] == ["test_stack_is_outermost_first_and_ends_at_the_caller", "_outer", "_inner"]
    assert all(os.path.isabs(f[0]) or f[0].startswith("<") for f in frames)


def test_torch_frames_are_skipped_but_user_code_inside_modules_is_kept():
    import torch

    t = StackTable()
    got = []

    class M(torch.nn.Module):
        def forward(self, x):
            got.append(capture_stack(t))
            return x

    M()(torch.zeros(1))  # through torch.nn.Module.__call__
    frames = t.get(got[0])
    assert frames[-1][2] == "forward"
    assert frames[-2][2] == "test_torch_frames_are_skipped_but_user_code_inside_modules_is_kept"
    assert not any("torch" + os.sep + "nn" in f[0] for f in frames)


def test_interning_and_depth_limit():
    t = StackTable()
    a = [_inner(t) for _ in range(3)]
    assert len(set(a)) == 1 and len(t) == 2
    assert capture_stack(t, depth=1) != 0  # only this frame walked
    assert len(t.get(capture_stack(t, depth=1))) == 1


def test_flagged_modules_are_internal():
    ns = {"__graphtree_profile_internal__": True, "capture_stack": capture_stack}
    exec(compile("def hidden(t):\n    return capture_stack(t)\n", "/virtual/flagged_module.py", "exec"), ns)
    t = StackTable()
    frames = t.get(ns["hidden"](t))
    assert frames[-1][2] == "test_flagged_modules_are_internal"


def test_format_frame():
    assert format_frame(("/a/b/c.py", 3, "f"), base="/a") == "b/c.py:3 f"
    assert format_frame(("<string>", 1, "<module>")) == "<string>:1 <module>"
    assert format_frame(None) == "<no Python frames>"


def test_graphtree_machinery_is_internal_but_its_demo_model_is_user_code():
    import graphtree
    import graphtree.cli
    import graphtree.demo
    import graphtree.demo.gpt
    import graphtree.tree.node
    from graphtree.profile import _attribution

    assert _attribution.is_user_file(graphtree.demo.gpt.__file__)  # the demo's captured lines show
    assert _attribution.is_user_file(graphtree.demo.__file__)
    assert _attribution.is_user_file(graphtree.cli.__file__)
    assert not _attribution.is_user_file(graphtree.__file__)
    assert not _attribution.is_user_file(graphtree.tree.node.__file__)
    assert not _attribution.is_user_file(_attribution.__file__)
