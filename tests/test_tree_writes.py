"""``graphtree.tree.writes``: the plain values a call writes into its object arguments, noted at
recording and written again after each replay (a replay runs no Python). The replay itself is
tested on a GPU: ``tests/gpu/test_real_paths_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from graphtree.tree import writes


class Layer:
    def __init__(self) -> None:
        self.length = 0  # a Python int a cache keeps (transformers' cumulative_length_int)
        self.keys = torch.zeros(2)


class Cache:
    def __init__(self) -> None:
        self.layers = [Layer(), Layer()]
        self.seen = {"steps": 0}
        self.window = (4, 8)


def _step(cache: Cache) -> None:
    for layer in cache.layers:
        layer.length += 1
    cache.seen["steps"] += 1
    cache.window = (cache.window[0], cache.window[1] + 1)


def test_the_values_a_call_changed_are_written_into_another_call_from_the_same_values():
    recorded = Cache()
    before = writes.values([torch.ones(1), recorded, 3])
    _step(recorded)
    changed = writes.changes(before, writes.values([torch.ones(1), recorded, 3]), "step")
    assert len(changed) == 4  # two lengths, the dict item, the tuple of plain values
    replayed = Cache()  # a later call from the same values (the key saw to that)
    writes.apply([torch.ones(1), replayed, 3], changed)
    assert [layer.length for layer in replayed.layers] == [1, 1]
    assert replayed.seen == {"steps": 1} and replayed.window == (4, 9)
    assert writes.changes(before, before, "step") == ()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: c.layers.append(Layer()), "resizes or rebuilds argument 0.layers"),
        (lambda c: setattr(c.layers[0], "extra", 1), "adds argument 0.layers[0].extra"),
        (lambda c: delattr(c.layers[1], "length"), "deletes argument 0.layers[1].length"),
        (lambda c: setattr(c.layers[0], "keys", torch.ones(2)), "rebinds argument 0.layers[0].keys"),
        (lambda c: c.seen.pop("steps"), "argument 0.seen"),
    ],
)
def test_what_a_replay_cannot_repeat_is_named(change, says):
    cache = Cache()
    before = writes.values([cache])
    change(cache)
    with pytest.raises(writes.Unrepeatable, match="a replay runs no Python") as info:
        writes.changes(before, writes.values([cache]), "step")
    assert says in str(info.value) and str(info.value).startswith("`step` "), str(info.value)


def test_a_call_of_tensors_and_plain_values_has_nothing_to_write():
    assert writes.values([torch.ones(2), 1, "s", None]) == {}


def test_modules_of_code_among_the_attributes_are_not_walked():
    import json

    holder = Cache()
    holder.codec = json  # a Python module kept on an object: code, not state
    snap = writes.values([holder])
    assert not any(step == ("a", "dumps") for path in snap for step in path[1:]), "json's insides were walked"


class Stepper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.calls = 0  # Python state of a module: not part of its key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_a_module_that_changes_its_own_python_attribute_cannot_be_replayed():
    model = Stepper()
    before = writes.module_values([model, None])
    model(torch.ones(2))
    with pytest.raises(writes.Unrepeatable, match="changes the Python attribute `calls` of its module") as info:
        writes.module_changes(before, writes.module_values([model, None]), "Stepper")
    assert "(0 -> 1)" in str(info.value) and "keep such state in a buffer" in str(info.value)
    unchanged = writes.module_values([model])
    writes.module_changes(unchanged, writes.module_values([model]), "Stepper")  # nothing changed: no error
    assert any(path[2] == ("a", "training") for path in unchanged)
