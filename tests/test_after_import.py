"""``graphtree._after_import``: torch._dynamo is imported by the program, never by graphtree, and
graphtree's compile break is ready the moment it is."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

from graphtree._after_import import call_after_import


def _module(tmp_path, monkeypatch, name, body="VALUE = 42\n"):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_function_runs_once_right_after_the_module_is_executed(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "gt_after_a")
    seen = []
    call_after_import("gt_after_a", lambda: seen.append(sys.modules["gt_after_a"].VALUE))
    assert seen == []  # not imported by call_after_import
    import gt_after_a

    assert seen == [42]
    monkeypatch.delitem(sys.modules, "gt_after_a")
    import gt_after_a  # noqa: F401, F811 - imported again: the hook is gone

    assert seen == [42]


def test_an_imported_module_gets_the_call_at_once():
    seen = []
    call_after_import("json", lambda: seen.append(1))
    assert seen == [1]


def test_a_failing_function_is_logged_and_the_import_still_works(tmp_path, monkeypatch, caplog):
    _module(tmp_path, monkeypatch, "gt_after_b")

    def broken() -> None:
        raise RuntimeError("boom")

    call_after_import("gt_after_b", broken)
    with caplog.at_level(logging.ERROR, logger="graphtree"):
        import gt_after_b

    assert gt_after_b.VALUE == 42
    assert "preparing for gt_after_b failed" in caplog.text


LAZY = textwrap.dedent(
    """
    import sys, torch, graphtree
    from graphtree.tree import graphed as g_mod
    g = graphtree.graphed(lambda x: x * 3, name="inner")
    print("DYNAMO_AFTER_GRAPHED", "torch._dynamo" in sys.modules)
    import torch._dynamo
    print("WRAPPED", bool(getattr(g_mod._outside_compile, "_torchdynamo_disable", False)))
    def outer(x):
        return g(x + 1) - 1
    print("BREAKS", torch._dynamo.explain(outer)(torch.ones(4)).graph_break_count)
    print("RESULT", torch.compile(outer, backend="eager")(torch.ones(4)).tolist())
    """
)


def test_graphed_does_not_import_dynamo_and_compiled_code_still_breaks_at_a_graphed_call():
    proc = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "DYNAMO_AFTER_GRAPHED False" in out, out
    assert "WRAPPED True" in out, out
    assert "RESULT [5.0, 5.0, 5.0, 5.0]" in out, out
    breaks = int(out.split("BREAKS ")[1].split()[0])
    assert breaks >= 1, out
