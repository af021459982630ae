"""A graphed callable whose signatures keep changing costs what eager costs (issue 27): after a run
of warm-ups without a recording, new signatures run plain eager, with the reason; shapes that
settle are recorded and replayed again."""

from __future__ import annotations

import pytest
import torch

import graphtree
from graphtree.tree.churn import LIMIT

DEV = "cuda"


@pytest.mark.parametrize("host_read", [False, True])
def test_a_new_batch_size_on_every_call_runs_eagerly_then_settles(host_read):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(DEV).eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = net(x)
        if host_read and y.sum().item() > 1e9:  # a host sync inside: the signature gives up
            y = y + 1
        return y

    g = graphtree.graphed(f, max_break_values=0)  # with a read: a sync, never graphed
    with torch.inference_mode():
        for n in range(1, 41):  # a new batch size every call
            graphtree.mark_step()
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), f(x))
        s = graphtree.stats()
        # then no more warm-ups: plain eager (issue 45, item 6: after 8 at most; 16 before)
        assert s.warmups == LIMIT <= 8 and sum(s.eager.values()) >= 40 - LIMIT, s
        assert any("new signature on almost every call" in r for r in s.eager), s
        x = torch.randn(7, 64, device=DEV)  # shapes settle on one met before
        for _ in range(4):
            graphtree.mark_step()
            torch.testing.assert_close(g(x), f(x))
    s = graphtree.stats()
    if host_read:
        assert s.replays == 0, s  # it cannot be graphed: eager, as before
    else:
        assert s.recordings == 1 and s.replays >= 1, s


def test_a_bounded_set_of_six_signatures_is_not_taken_for_churn():
    """Issue 45, item 6: a bounded set of signatures met in turn is warmed up, recorded and replayed
    (only warm-ups of never-met signatures count toward the limit)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(DEV).eval()
    settled = graphtree.graphed(net, name="settled")
    with torch.inference_mode():
        for _ in range(4):  # six sizes in turn: warmed up, recorded, then replayed
            for n in (3, 5, 7, 9, 11, 13):
                graphtree.mark_step()
                x = torch.randn(n, 64, device=DEV)
                torch.testing.assert_close(settled(x), net(x))
    s = graphtree.stats()
    assert s.recordings == 6 and s.replays == 12 and not s.eager, s


def test_a_churning_callables_new_shapes_skip_its_tree_and_one_met_again_is_recorded(monkeypatch):
    """Issue 45, item 6: once churning, a call of tensors never met runs eagerly before graphtree
    reads, keys or takes it to its tree (``_eager_now`` in tree/graphed.py, tree/churn.py); a shape met that way and met
    again is warmed up, recorded and replayed, as shapes that settle are."""
    from graphtree.tree.manager import TreeManager

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(DEV).eval()
    g = graphtree.graphed(net, name="churning")
    reached: list[int] = []
    real = TreeManager.call

    def counted(tree, gc, call):
        reached.append(call.leaves[0].shape[0])
        return real(tree, gc, call)

    monkeypatch.setattr(TreeManager, "call", counted)
    with torch.inference_mode():
        for n in range(1, 41):  # a new batch size every call
            graphtree.mark_step()
            x = torch.randn(n, 64, device=DEV)
            torch.testing.assert_close(g(x), net(x), rtol=0, atol=0)
        assert reached == list(range(1, LIMIT + 1)), "past the warm-ups, new shapes never reach the tree"
        x = torch.randn(30, 64, device=DEV)  # met once, run early: now met again
        for _ in range(4):
            graphtree.mark_step()
            torch.testing.assert_close(g(x), net(x), rtol=0, atol=0)
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 2, s
    assert sum(n for r, n in s.eager.items() if "new signature on almost every call" in r) == 40 - LIMIT, s
