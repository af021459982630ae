"""Module hooks on a graphed module's submodules (graphtree/tree/hooks.py): a replay runs none of
their Python, so a call that would run one runs eagerly, in parts, and equals eager's; once the
hook is gone, calls replay again. Before the nineteenth session a hook registered after a recording
was skipped by its replays, one removed was still replayed, and one present while recording ran
its Python on the recording only."""

import torch
from torch import nn

import graphtree

DEV = "cuda"


def _model() -> nn.Module:
    """Three blocks of six linear layers: each block is worth a part (tree/parts.py)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU())]) for _ in range(3)]
    )


def _calls(g, model, x, n, seen=None, per_call=0):
    """``n`` graphed calls, each equal to eager's; ``seen`` grows by ``per_call`` for each pair."""
    with torch.no_grad():
        for _ in range(n):
            graphtree.mark_step()
            before = len(seen) if seen is not None else 0
            out = g(x)
            torch.testing.assert_close(out, model(x), rtol=0, atol=0)
            if seen is not None:
                assert len(seen) - before == per_call, (len(seen) - before, per_call)


def test_a_hook_registered_after_recording_runs_on_every_call_and_replays_resume_once_removed():
    model = _model().to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(8, 64, device=DEV)
    _calls(g, model, x, 4)
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 2, s
    seen = []

    def double(m, i, o):
        seen.append(o.shape)
        return o * 2  # a replay recorded without it would return the undoubled output

    handle = model[1][2].register_forward_hook(double)
    _calls(g, model, x, 3, seen, per_call=2)  # the graphed call ran it, and the eager one
    assert any("holds a forward hook" in r and "double" in r for r in graphtree.stats().eager), graphtree.stats()
    handle.remove()
    replays = graphtree.stats().replays
    _calls(g, model, x, 3)
    assert graphtree.stats().replays >= replays + 3, graphtree.stats()


def test_a_hook_present_while_recording_runs_its_python_on_every_call():
    model = _model().to(DEV)
    seen = []
    model[1][4].register_forward_hook(lambda m, i, o: seen.append(float(o.float().norm())))
    g = graphtree.graphed(model)
    x = torch.randn(8, 64, device=DEV)
    _calls(g, model, x, 5, seen, per_call=2)


def test_a_hook_removed_after_the_first_calls_is_never_replayed():
    model = _model().to(DEV)
    handle = model[0][0].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
    g = graphtree.graphed(model)
    x = torch.randn(8, 64, device=DEV)
    _calls(g, model, x, 3)
    handle.remove()
    _calls(g, model, x, 4)  # a replay of a capture made with the hook would add 1 to the input
    s = graphtree.stats()
    assert s.recordings >= 1 and s.replays >= 2, s


def test_a_hooked_models_other_parts_still_replay():
    # A hook on one layer (Grad-CAM, feature extraction): the call runs eagerly with the model's
    # other parts graphed, the hooked layer's own hook running around its part
    model = _model().to(DEV)
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    g = graphtree.graphed(model)
    x = torch.randn(8, 64, device=DEV)
    _calls(g, model, x, 6, seen, per_call=2)
    assert graphtree.stats().replays >= 3, graphtree.stats()


def test_transformers_output_recorders_left_by_a_hidden_states_call_do_not_stop_replays():
    # transformers 5 installs its output recorders on every layer the first time a call asks for
    # output_hidden_states and keeps them (idle unless a call collects, into its own output)
    from _tiny_hf import tiny_model

    model = tiny_model("llama", attn_implementation="eager")
    ids = torch.randint(1, 255, (1, 12), device=DEV)
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules())
    g = graphtree.graphed(model)
    with torch.no_grad():
        for _ in range(5):
            graphtree.mark_step()
            assert torch.equal(g(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
            out = g(ids, use_cache=False, output_hidden_states=True)
            assert len(out.hidden_states) == len(full.hidden_states)
            for a, b in zip(out.hidden_states, full.hidden_states):
                assert torch.equal(a, b)
    s = graphtree.stats()
    assert s.replays >= 4 and not any("hook" in r for r in s.eager), s


_BY_NAME = None


def _calls_by_name(x):
    return _BY_NAME(x) + 1


def test_a_hook_on_a_model_the_function_calls_by_name_runs_on_every_call():
    # `graphed(step)` where step calls a global model: its hooks were not watched (only the graphed
    # callable's own module's), so one registered after the recording was skipped by replays
    # (nineteenth session, cf8821c; CPU-tested there)
    global _BY_NAME
    _BY_NAME = _model().to(DEV)
    g = graphtree.graphed(_calls_by_name)
    x = torch.randn(8, 64, device=DEV)
    try:
        with torch.no_grad():
            for _ in range(4):
                graphtree.mark_step()
                torch.testing.assert_close(g(x), _calls_by_name(x), rtol=0, atol=0)
        assert graphtree.stats().replays >= 2, graphtree.stats()
        handle = _BY_NAME[2][0].register_forward_hook(lambda m, i, o: o * 2)
        with torch.no_grad():
            for _ in range(3):
                graphtree.mark_step()
                torch.testing.assert_close(g(x), _calls_by_name(x), rtol=0, atol=0)
        assert any("holds a forward hook" in r for r in graphtree.stats().eager), graphtree.stats()
        handle.remove()
    finally:
        _BY_NAME = None
