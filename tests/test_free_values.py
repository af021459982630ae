"""The plain values a graphed function's code reads from its globals and closure are part of each
call's key (tree/reach.py, FreeValues): a graph holds them as constants, so ``x * SCALE`` recorded
with ``SCALE = 2.0`` must not be replayed after ``SCALE = 3.0``."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import types

import pytest
import torch
import torch.nn.functional as F

from graphtree.tree.node import signature
from graphtree.tree.reach import FreeValues

SCALE = 2.0
FLAG = True
NAME = "relu"
W = torch.ones(3)  # (a tensor: read in place as an external, keyed by identity)


def _helper(x):
    return x + OFFSET  # (defined below the function: read at the first call)


def scaled(x):
    y = _helper(x) * SCALE
    return y if FLAG else -y


OFFSET = 1


def _values(part):
    """The plain values of a part (what is keyed by identity, a function or a model, left out)."""
    return {n: v for n, t, v in part[1] if t not in _BY_IDENTITY}


def _identities(part):
    """The names keyed by identity (functions and models the code calls by name)."""
    return {n for n, t, _ in part[1] if t in _BY_IDENTITY}


_BY_IDENTITY = (type(scaled), type(torch.sin), functools.partial)


def test_a_global_read_by_the_code_or_a_helper_it_calls_is_keyed_by_type_and_value(monkeypatch):
    free = FreeValues(scaled)
    first = free.part()
    assert _values(first) == {"SCALE": 2.0, "FLAG": True, "OFFSET": 1}  # (not W, F or the helper)
    assert free.part() is first  # nothing changed: the same part, one identity check per value
    monkeypatch.setitem(globals(), "SCALE", 3.0)
    assert _values(free.part())["SCALE"] == 3.0
    monkeypatch.setitem(globals(), "OFFSET", True)  # equal to 1 in Python, not in a graph
    part = free.part()
    assert ("OFFSET", bool, True) in part[1] and part != first
    monkeypatch.setitem(globals(), "OFFSET", torch.zeros(()))  # rebound to an object: by identity
    assert any(n == "OFFSET" and t is torch.Tensor for n, t, _ in free.part()[1])


def test_closure_cells_lambdas_and_module_forwards_are_followed():
    k = 3

    def f(x):
        return [x * k for _ in range(2)]

    free = FreeValues(f)
    assert _values(free.part()) == {"k": 3}
    k = 4  # (the cell is rebound: the next call reads 4)
    assert _values(free.part()) == {"k": 4}

    class Net(torch.nn.Module):
        def forward(self, x):
            return getattr(F, NAME)(x) * SCALE

    assert set(_values(FreeValues(Net()).part())) == {"NAME", "SCALE"}
    assert set(_values(FreeValues(functools.partial(scaled, 1)).part())) == {"SCALE", "FLAG", "OFFSET"}


def test_library_code_and_code_without_plain_reads_cost_nothing():
    assert FreeValues(torch.nn.Linear(2, 2)).part() is None  # (torch's own forward)
    assert FreeValues(torch.sin).part() is None
    assert FreeValues(functools.partial(functools.reduce, max)).part() is None  # (the standard library's)


def test_a_global_tensor_is_keyed_by_identity_rebound_while_the_old_one_lives():
    # `W = W * 2` between calls while the old tensor is still held elsewhere: its storage neither
    # freed nor moved, the recording made with the old one replayed it (README said so; nineteenth
    # session). A closure's tensors are followed by Reach, not keyed.
    global W
    free = FreeValues(lambda x: x * W)
    before = free.part()
    assert [(n, t) for n, t, _ in before[1]] == [("W", torch.Tensor)]
    assert free.part() is before  # (unchanged: the same part)
    old = W
    try:
        W = W * 2
        assert free.part() != before
    finally:
        W = old
    assert free.part() == before
    cell = torch.ones(3)
    assert FreeValues(lambda x: x * cell).part() is None


def test_a_compiled_helper_is_read_through_to_its_own_code():
    # torch.compile(h) is dynamo's wrapper (its globals are torch's), with h as __wrapped__: dynamo
    # guards on SCALE and recompiles when it changes; a graph around the compiled kernels must not
    # replay the old constant either (issue 46, "never a stale kernel replayed")
    helper = torch.compile(_helper_scaled, backend="eager")

    def calls_it(x):
        return helper(x) + 1

    assert set(_values(FreeValues(helper).part())) == {"SCALE"}
    assert set(_values(FreeValues(calls_it).part())) == {"SCALE"}


def _helper_scaled(x):
    return x * SCALE


def _tanh_scaled(x):
    return torch.tanh(x) * OTHER


OTHER = 5.0


def test_a_function_the_code_calls_by_name_is_keyed_by_identity_and_followed_anew_when_rebound(monkeypatch):
    """A notebook cell run again defines the helper anew: eager calls the new one, and a replay of
    the old recording would compute the old one (found reading the code)."""
    free = FreeValues(scaled)
    first = free.part()
    assert "_helper" in _identities(first)
    monkeypatch.setitem(globals(), "_helper", _tanh_scaled)  # (rebound: its reads are followed too)
    now = free.part()
    assert now != first and _values(now)["OTHER"] == 5.0 and "OFFSET" not in _values(now)
    monkeypatch.setitem(globals(), "OTHER", 6.0)
    assert _values(free.part())["OTHER"] == 6.0


def test_a_function_made_again_from_the_same_code_keeps_the_key_and_its_closure_is_read_anew():
    """A lambda made in a loop is a new object each time, with the same code: the same recording
    fits it, and what its new closure holds is read (not the old closure's)."""

    def make(s):
        return lambda x: x * s

    def step(x):
        return current(x)

    current = make(2.0)
    free = FreeValues(step)
    first = free.part()
    current = make(2.0)  # made again: same code, the same value in its cell
    assert free.part() == first
    current = make(3.0)  # same code, another value in its cell: read anew
    third = free.part()
    assert third != first and ("s", float, 3.0) in third[1], third
    current = lambda x: x - 1  # noqa: E731 - defined anew: other code
    assert free.part() not in (first, third)


def test_a_recordings_signature_shows_the_values_it_was_recorded_with():
    class _Node:
        name = "scaled"
        key = (0, (((4,), torch.float32, (1,)), FreeValues(scaled).part()))

    assert signature(_Node()) == "scaled(float32[4]) [FLAG=True, SCALE=2.0, OFFSET=1]"  # type: ignore[arg-type]


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = 1.0
        self.proj = torch.nn.Linear(2, 2)  # (torch's class: its attributes are not followed)

    def forward(self, x):
        return self.proj(x) / self.temperature


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2
        self.calls = 0
        self.head = _Head()

    def forward(self, x):
        self.calls += 1  # (its own state: a recording of it fails, with the reason)
        return self.head(x) * self.scale


def test_a_user_modules_plain_attributes_are_keyed_but_those_the_call_changes():
    model = _Model()
    free = FreeValues(model, model)
    values = _values(free.part())
    assert values == {"self.scale": 2, "self.calls": 0, "self.head.temperature": 1.0}  # (modes: keyed apart)
    model.head.temperature = 0.5  # a setting changed between calls: a new signature
    assert _values(free.part())["self.head.temperature"] == 0.5
    model(torch.ones(1, 2))  # the call changes `calls`: its state, no longer followed
    free.after_call()
    assert "self.calls" not in _values(free.part()) and free.follows_modules
    free.after_call()  # (nothing changed since: nothing dropped)
    assert set(_values(free.part())) == {"self.scale", "self.head.temperature"}
    assert FreeValues(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).part() is None


def test_a_library_modules_settings_its_code_reads_are_keyed():
    # `model.drop.p = 0.0` between calls: torch's classes were not followed at all, so a recording
    # made with p=0.1 replayed p=0.1. What their code reads is keyed; nn.Linear reads none.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Conv1d(2, 2, 1))
    free = FreeValues(model, model)
    values = _values(free.part())
    settings = {"self.1.p": 0.1, "self.1.inplace": False, "self.2.groups": 1, "self.2.padding_mode": "zeros"}
    one, zero = ((int, 1),), ((int, 0),)  # (a tuple of plain values: by its items' types and values)
    tuples = {"self.2.stride": one, "self.2.padding": zero, "self.2.dilation": one}
    tuples["self.2._reversed_padding_repeated_twice"] = zero * 2
    assert values == {**settings, **tuples, "self.1.training": True}  # (Dropout's code reads its mode too)
    model[1].p = 0.0
    assert _values(free.part())["self.1.p"] == 0.0
    assert not free.follows_modules  # (settings: not scanned after each call, a library's forward changes none)
    free.after_call()
    assert len(_values(free.part())) == 9


class _Sampler:
    def __init__(self):
        self.temperature = 1.0
        self.name = "greedy"
        self.vocab = torch.arange(4)  # (a tensor: read in place, keyed by identity)

    def sample(self, logits):
        return logits / self.temperature


def test_the_object_a_graphed_method_is_bound_to_is_read_too():
    sampler = _Sampler()
    free = FreeValues(sampler.sample)
    assert _values(free.part()) == {"self.temperature": 1.0, "self.name": "greedy", "self.vocab": id(sampler.vocab)}
    sampler.temperature = 0.7
    assert _values(free.part())["self.temperature"] == 0.7
    assert FreeValues(torch.Generator().manual_seed).part() is None  # (a method of torch's class)


def test_a_bound_objects_attribute_the_call_changes_stays_keyed():
    class Counter:
        def __init__(self):
            self.calls = 0

        def step(self, x):
            self.calls += 1
            return x * self.calls

    counter = Counter()
    free = FreeValues(counter.step)
    assert _values(free.part()) == {"self.calls": 0}
    counter.step(1)
    free.after_call()  # (not a module: kept, each value its own signature, churn names it)
    assert _values(free.part()) == {"self.calls": 1} and not free.follows_modules


LOSSES: list = []
CACHE: dict = {}


def _logs_its_loss(x):
    loss = x.sum()
    LOSSES.append(loss)  # (a replay would not append)
    return loss


def test_containers_the_code_reads_are_watched_for_changes_a_replay_would_not_make():
    free = FreeValues(_logs_its_loss)
    watched = free.containers()
    assert watched is not None and watched.changed() == ""
    _logs_its_loss(torch.ones(2))
    assert "the list `LOSSES`" in watched.changed()
    again = free.containers()
    CACHE["k"] = 1  # (not read by this function's code: not watched)
    assert again.changed() == ""
    assert FreeValues(lambda x: x + 1).containers() is None
    LOSSES.clear()


def test_a_containers_bound_method_read_by_name_is_watched_as_the_container():
    """``log = LOSSES.append`` then ``log(loss)`` grows the list as ``LOSSES.append(loss)`` does: a
    replay would not (found reading the code: the list was not watched through its method)."""
    grown: list[float] = []
    log = grown.append

    def step(x):
        log(float(x.sum()))
        return x + 1

    watched = FreeValues(step).containers()
    assert watched is not None and watched.changed() == ""
    step(torch.ones(2))
    assert "the list `log`" in watched.changed(), watched.changed()


def test_what_a_part_marked_eager_reads_is_not_watched_it_runs_on_every_replay():
    """A logging part marked ``graphtree.eager`` appends on every replay as eager does: the list it
    grows is not a change a replay would miss (on the H100 the step ran eagerly for good)."""
    import graphtree

    seen: list[float] = []

    @graphtree.eager
    def log(loss):
        seen.append(float(loss))

    def step(x):
        log(x.sum())
        return x + SCALE

    free = FreeValues(step)
    watched = free.containers()
    step(torch.ones(2))
    assert watched is None or watched.changed() == "", watched.changed()
    assert ("SCALE", float, SCALE) in free.part()[1], free.part()  # (the step's own reads still keyed)


def test_a_warm_up_that_keeps_changing_a_container_gives_that_as_its_reason():
    from graphtree.tree.recorder import WarmUp

    done = WarmUp(None, None, 0, {}, mutated="the list `LOSSES` (a global or closure variable its code reads)")
    assert "`f` changes the list `LOSSES`" in done.again_reason("f")
    assert "keeps tensors it allocates" in WarmUp(None, None, 1, {}).again_reason("f")


MODEL = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
WRAPPED = torch.nn.Linear(2, 2)
WRAPPED.require_backward_grad_sync = True  # (as DistributedDataParallel has it; no_sync() turns it off)


def _predict(x):
    return MODEL(x) + WRAPPED(x)


def test_the_mode_of_a_model_the_code_calls_and_ddps_sync_flag_are_keyed():
    # model.eval() between calls of a function that calls a global model: its recording made in
    # train mode (dropout) must not be replayed; nor one made with gradient sync under no_sync()
    global MODEL
    free = FreeValues(_predict)
    want = {"MODEL.training": True, "WRAPPED.training": True, "WRAPPED.require_backward_grad_sync": True}
    assert want.items() <= _values(free.part()).items()
    assert _values(free.part())["MODEL"] == id(MODEL)  # (a model by its identity: rebound, it is followed anew)
    MODEL.eval()
    WRAPPED.require_backward_grad_sync = False
    values = _values(free.part())
    assert values["MODEL.training"] is False and values["WRAPPED.require_backward_grad_sync"] is False
    MODEL.train()
    WRAPPED.require_backward_grad_sync = True
    old, MODEL = MODEL, torch.nn.Sequential(torch.nn.Linear(2, 2)).eval()
    try:
        values = _values(free.part())
        assert values["MODEL"] == id(MODEL) and values["MODEL.training"] is False
    finally:
        MODEL = old


def test_a_ddp_model_the_code_calls_warms_up_until_ddp_has_timed_its_first_iterations(tmp_path):
    # PyTorch's notes ask for 11 eager DDP iterations before a capture. They were counted per
    # signature, and only warm-ups that kept no memory counted: a step whose first call makes the
    # optimizer's state and whose second rebuilds DDP's buckets warmed up 13 times (four H100
    # runs, 26 of 40 steps replayed). DDP's own count is read now: iterations run under another
    # signature, or before the model was graphed, count.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from graphtree.tree.reach import DDP_WARMUPS

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))

        def step(x):
            loss = ddp(x).sum()
            loss.backward()
            return loss

        free = FreeValues(step)
        free.part()
        assert free.warms_up(0) and not free.warms_up(DDP_WARMUPS)  # (at most 11 per signature)
        x = torch.ones(1, 2)
        for i in range(DDP_WARMUPS):
            assert free.warms_up(1), i  # (a signature warmed up once: DDP has not timed its 10 yet)
            step(x)
        assert not free.warms_up(0)  # 11 iterations run: a new signature needs its own warm-up only
        again = _values(FreeValues(step).part())  # (DDP's own settings its code reads are keyed...)
        assert again["ddp.static_graph"] is False and type(ddp.require_forward_param_sync) is bool
        assert "ddp.require_forward_param_sync" not in again  # (...not the flag each forward derives)
        assert "ddp.require_backward_grad_sync" in _values(free.part())
        with ddp.no_sync():  # (gradient accumulation: a recording of its own)
            assert _values(free.part())["ddp.require_backward_grad_sync"] is False
        plain = FreeValues(_predict)
        plain.part()
        assert not plain.warms_up(0)
    finally:
        dist.destroy_process_group()


def test_a_step_over_an_fsdp2_model_names_fsdp2_when_it_runs_eagerly(tmp_path):
    # On four H200s a step over a fully_shard model ran eagerly with the generic "keeps tensors it
    # allocates ... allocate that state before the first call and pass it in", a fix no FSDP2 user has
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from graphtree.tree.recorder import WarmUp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        sharded = torch.nn.Sequential(torch.nn.Linear(2, 2))
        fully_shard(sharded)

        def step(x):
            return sharded(x).sum()

        free = FreeValues(step)
        free.part()
        reason = WarmUp(None, None, 1, {}).again_reason("step", free.kept_hint)
        assert "FSDP2 (`fully_shard`) all-gathers" in reason and "pass it in" not in reason, reason
        plain = FreeValues(_predict)
        plain.part()
        assert plain.kept_hint == ""
        assert "pass it in" in WarmUp(None, None, 1, {}).again_reason("f", plain.kept_hint)
    finally:
        dist.destroy_process_group()


class _Config:
    def __init__(self):
        self.scale = 2.0
        self.unused = 1  # (not read by the code below: not keyed)
        self.name = "relu"


CFG = _Config()


def _configured(x):
    return x * CFG.scale if CFG.name == "relu" else x


def test_an_object_of_settings_read_by_name_keys_the_attributes_the_code_reads():
    """``x * CFG.scale`` recorded with ``CFG.scale = 2.0`` must not replay after ``CFG.scale = 3.0``
    (found reading the code: a global config object's attributes were not followed)."""
    from dataclasses import dataclass

    free = FreeValues(_configured)
    values = _values(free.part())
    assert values["CFG.scale"] == 2.0 and values["CFG.name"] == "relu" and "CFG.unused" not in values
    first = free.part()
    CFG.scale = 3.0
    try:
        assert free.part() != first and _values(free.part())["CFG.scale"] == 3.0
    finally:
        CFG.scale = 2.0
    assert free.part() == first

    @dataclass
    class Sampling:
        temperature: float = 0.7

    settings = Sampling()

    def sample(logits):
        return logits / settings.temperature

    closure = FreeValues(sample)
    assert _values(closure.part())["settings.temperature"] == 0.7
    settings.temperature = 0.9
    assert _values(closure.part())["settings.temperature"] == 0.9

    import threading

    class Flags(threading.local):  # (each thread's own: not keyed)
        def __init__(self):
            self.armed = False

    flags = Flags()
    assert FreeValues(lambda x: x + 1 if flags.armed else x).part() is None


class _Scaler:
    def __init__(self):
        self.factor = 2.0

    def __call__(self, x):
        return x * self.factor + OFFSET


def test_a_callable_object_is_read_through_its_call_and_its_attributes():
    scaler = _Scaler()
    free = FreeValues(scaler)
    assert _values(free.part()) == {"self.factor": 2.0, "OFFSET": 1}
    scaler.factor = 3.0
    assert _values(free.part())["self.factor"] == 3.0


def test_an_object_of_settings_a_module_holds_is_keyed_once_for_all_its_holders():
    # `model.config.output_hidden_states = True` between calls: an HF model's config (an object,
    # not a plain value) was not keyed, so a recording made without hidden states replayed without
    # them (found reading the code after the seventeenth session)
    transformers = pytest.importorskip("transformers")
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "vocab_size": 32}
    config = transformers.LlamaConfig(**sizes, num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    free = FreeValues(model, model)
    values = _values(free.part())
    held = [k for k in values if ".config." in k]
    assert "self.config.output_hidden_states" in held and "self.config.return_dict" in held
    assert len(held) == len({k.rsplit(".", 1)[1] for k in held})  # (one config, read once)
    assert not any(k.startswith("self.generation_config") for k in values)  # (its forward does not read it)
    before = free.part()
    model.config.output_hidden_states = True
    assert free.part() != before and _values(free.part())["self.config.output_hidden_states"] is True


@dataclasses.dataclass
class _Settings:
    scale: float = 2.0
    name: str = "a"


class _Configured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Settings()
        self.log = print  # (callable: not an object of settings)

    def forward(self, x):
        return x * self.cfg.scale


def test_a_user_modules_dataclass_of_settings_is_keyed_and_dropped_once_the_call_changes_it():
    model = _Configured()
    free = FreeValues(model, model)
    assert _values(free.part()) == {"self.cfg.scale": 2.0, "self.cfg.name": "a"}
    model.cfg.scale = 3.0
    assert _values(free.part())["self.cfg.scale"] == 3.0
    model.cfg.name = "b"  # (as a call that changed it would: its state, no longer followed)
    free.after_call()
    assert _values(free.part()) == {"self.cfg.scale": 3.0}


GEN = None  # a library's object of settings, read by name (set in the test)


def _tempered(logits):
    return logits / GEN.temperature


def test_a_library_object_of_settings_read_by_name_is_keyed_by_what_the_code_reads():
    # `GEN.temperature = 0.5` between calls, GEN an argparse Namespace (a library's class): only
    # the user's classes' objects were keyed, so the recording made at 1.0 replayed 1.0
    global GEN
    GEN = argparse.Namespace(temperature=1.0, top_k=50)
    free = FreeValues(_tempered)
    assert _values(free.part()) == {"GEN": id(GEN), "GEN.temperature": 1.0}  # (top_k: not read by the code)
    GEN.temperature = 0.5
    assert _values(free.part())["GEN.temperature"] == 0.5


class _Scaled(torch.nn.Module):
    scale = 2.0  # a class attribute, read as self.scale

    def forward(self, x):
        return x * self.scale


class _Defaults:
    eps = 1e-5  # a class attribute of a settings object's class


class _Namespace:
    lr = 0.1  # a class used as a namespace of settings


DEFAULTS = _Defaults()


def _uses_class_level_settings(x):
    return x * _Namespace.lr + DEFAULTS.eps


def test_class_attributes_the_code_reads_are_keyed_once_for_all_instances():
    # `_Scaled.scale = 3.0` between calls: only instances' attributes were keyed, so the recording
    # made at 2.0 replayed 2.0 (found reading the code, eighteenth session)
    model = torch.nn.Sequential(_Scaled(), _Scaled())
    free = FreeValues(model, model)
    assert _values(free.part()) == {"self.0.scale": 2.0}  # (one class attribute, read by both layers)
    _Scaled.scale = 3.0
    try:
        assert _values(free.part()) == {"self.0.scale": 3.0}
        model[1].scale = 4.0  # (an instance's own attribute set later is not followed: resolved once)
    finally:
        _Scaled.scale = 2.0
    free = FreeValues(_uses_class_level_settings)
    values = _values(free.part())  # (with the object's and the class's identities)
    assert {k: v for k, v in values.items() if "." in k} == {"DEFAULTS.eps": 1e-5, "_Namespace.lr": 0.1}
    _Namespace.lr = 0.2
    try:
        assert _values(free.part())["_Namespace.lr"] == 0.2
    finally:
        _Namespace.lr = 0.1


def test_a_submodules_own_mode_is_keyed_where_its_code_reads_it():
    # MC dropout (`model.eval()`, then the dropout layers back to train()) and a frozen batch norm
    # (`model.train(); model.bn.eval()`): only the graphed module's own mode was keyed, so a
    # recording made with the layer in one mode replayed it in the other (found by a CPU hunt for
    # keying gaps, eighteenth session)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    free = FreeValues(model, model)
    model.eval()
    before = free.part()
    model[2].train()
    assert free.part() != before and _values(free.part())["self.2.training"] is True
    model.train()
    model[1].eval()
    assert _values(free.part())["self.1.training"] is False
    assert "self.0.training" not in _values(free.part())  # (nn.Linear's code does not read it)


class _Predictor:
    """A model held by an object of the user's class, graphed as ``predictor.predict``."""

    def __init__(self):
        self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))

    def predict(self, x):
        return self.model(x)


def test_the_models_a_graphed_methods_object_holds_are_keyed_as_models_read_by_name():
    # `predictor.model.eval()` between calls of `graphed(predictor.predict)`: no module was found,
    # so neither its mode nor its settings were keyed (found by a CPU hunt for keying gaps,
    # eighteenth session)
    predictor = _Predictor()
    free = FreeValues(predictor.predict)
    assert "self.model" in {n for n, _, _ in free.part()[1]}  # (the model, by its identity)
    predictor.model.eval()
    assert _values(free.part())["self.model.training"] is False
    predictor.model[1].p = 0.5
    assert _values(free.part())["self.model.1.p"] == 0.5
    predictor.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))  # (rebound: followed anew)
    assert _values(free.part())["self.model.1.p"] == 0.2


class _Mode(enum.Enum):
    SUM = 1
    MEAN = 2


class _Pooled(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.act = torch.relu  # a function held as an attribute
        self.mode = _Mode.SUM
        self.scale = scale  # (1 / np.sqrt(d): a numpy scalar, not a float)
        self.size = (2,)

    def forward(self, x):
        y = F.adaptive_avg_pool1d(self.act(x), self.size) * self.scale
        return y.sum(-1) if self.mode is _Mode.SUM else y.mean(-1)


SIZE = (2,)
MODE = _Mode.SUM


def _global_settings(x):
    return F.adaptive_avg_pool1d(x, SIZE) if MODE is _Mode.SUM else x


def test_functions_enums_numpy_scalars_and_tuples_of_settings_are_keyed():
    # `m.act = torch.tanh`, `m.mode = Mode.MEAN`, `m.scale = np.float64(0.25)`, `m.size = (1,)`
    # between calls: only values of Python's plain types were keyed (found by a CPU hunt for keying
    # gaps, eighteenth session); so were a convolution's stride and padding, tuples
    np = pytest.importorskip("numpy")
    model = _Pooled(np.float64(0.5))
    free = FreeValues(model, model)
    before = free.part()
    for name, value in (("act", torch.tanh), ("mode", _Mode.MEAN), ("scale", np.float64(0.25)), ("size", (1,))):
        old = getattr(model, name)
        setattr(model, name, value)
        assert free.part() != before, name
        setattr(model, name, old)
        assert free.part() == before, name  # (the same values: the same key)
    model.scale = np.float64(0.5)  # (another object of the same value: the same key)
    assert free.part() == before
    free = FreeValues(_global_settings)
    before = free.part()
    global SIZE, MODE
    SIZE, MODE = (1,), _Mode.MEAN
    try:
        assert {n for n, _, _ in free.part()[1]} >= {"SIZE", "MODE"} and free.part() != before
    finally:
        SIZE, MODE = (2,), _Mode.SUM


USE_GELU = True
EPS = 1e-6
TEMP = 1.0


class _Block(torch.nn.Module):
    def forward(self, x):
        x = F.gelu(x) if USE_GELU else F.relu(x)  # a global read in a submodule's forward
        return self._norm(x) / self.temperature

    def _norm(self, x):
        return x / (x.pow(2).mean() + EPS).sqrt()  # a global read in a method it calls

    @property
    def temperature(self):
        return TEMP  # a global read in a property it reads


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x)


def test_globals_read_in_submodules_forwards_methods_and_properties_are_keyed():
    # `USE_GELU = False` between calls of a graphed `_Net`: only the graphed function's code (and
    # the functions it calls by global name) was walked, not a submodule's forward, a method it
    # calls or a property (found by a CPU hunt for keying gaps, eighteenth session)
    model = _Net()
    free = FreeValues(model, model)
    assert {"USE_GELU", "EPS", "TEMP"} <= set(_values(free.part()))
    for name, value in (("USE_GELU", False), ("EPS", 1e-5), ("TEMP", 0.5)):
        before = free.part()
        old = globals()[name]
        globals()[name] = value
        try:
            assert free.part() != before, name
        finally:
            globals()[name] = old


class _Tempered:
    """A callable object of the user's class, with a setting its ``__call__`` reads."""

    def __init__(self):
        self.temperature = 1.0

    def __call__(self, logits):
        return logits / self.temperature


class _Sampling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sampler = _Tempered()
        self.log = print  # (a builtin: keyed by identity, not read into)

    def forward(self, x):
        return torch.softmax(self.sampler(x), -1)


def test_the_settings_of_a_callable_object_a_module_holds_are_keyed():
    # `m.sampler.temperature = 0.5` between calls: objects held by a module were read into only
    # when not callable (found by a CPU hunt for keying gaps, eighteenth session)
    model = _Sampling()
    free = FreeValues(model, model)
    assert _values(free.part())["self.sampler.temperature"] == 1.0
    model.sampler.temperature = 0.5
    assert _values(free.part())["self.sampler.temperature"] == 0.5


def test_an_hf_attentions_setting_its_attention_function_reads_is_keyed():
    # `layer.self_attn.is_causal = False` on every layer (a bidirectional encoder made of a Llama,
    # LLM2Vec-style): HF's sdpa_attention_forward reads it from the module it is passed, outside
    # the class's own code, so it was not keyed (found by a CPU hunt for keying gaps, eighteenth session)
    transformers = pytest.importorskip("transformers")
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "vocab_size": 32}
    model = transformers.LlamaModel(transformers.LlamaConfig(**sizes, num_attention_heads=2, num_key_value_heads=1))
    free = FreeValues(model, model)
    before = free.part()
    assert "self.layers.0.self_attn.is_causal" in _values(before)
    for layer in model.layers:
        layer.self_attn.is_causal = False
    assert free.part() != before


CONFIG = {"temperature": 1.0, "name": "x", "weights": None}
settings_module = types.ModuleType("settings_module")  # (a config.py of the user's, imported)
settings_module.__file__ = "/home/user/project/settings_module.py"
settings_module.SCALE = 2.0


def _reads_dict_and_module_settings(x):
    return x / CONFIG["temperature"] * settings_module.SCALE


def test_a_dicts_settings_and_a_config_modules_the_code_names_are_keyed():
    # `CONFIG["temperature"] = 0.5` or `settings.SCALE = 3.0` between calls: a dict's items were
    # watched for its length in warm-ups only, a module's attributes not at all (found by a CPU hunt
    # for keying gaps, eighteenth session)
    free = FreeValues(_reads_dict_and_module_settings)
    values = _values(free.part())
    assert values["CONFIG['temperature']"] == 1.0 and values["settings_module.SCALE"] == 2.0
    assert "CONFIG['name']" not in values  # (a key the code does not name)
    CONFIG["temperature"] = 0.5
    settings_module.SCALE = 3.0
    try:
        values = _values(free.part())
        assert values["CONFIG['temperature']"] == 0.5 and values["settings_module.SCALE"] == 3.0
    finally:
        CONFIG["temperature"], settings_module.SCALE = 1.0, 2.0
    assert FreeValues(_uses_torch).part() is None  # (torch: an installed module, not read)


def _uses_torch(x):
    return torch.relu(x) * torch.pi


def test_a_submodule_replaced_between_calls_changes_the_key_and_its_settings_are_followed():
    # `model[1] = nn.Tanh()` or `nn.LeakyReLU(0.3)` in place of `nn.LeakyReLU(0.1)`: modules
    # without parameters, which no address check sees; the reads pointed at the old one (found by a
    # CPU hunt for keying gaps, eighteenth session)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LeakyReLU(0.1))
    free = FreeValues(model, model)
    assert free.active
    before = free.part()
    assert free.part() is before  # (nothing registered: one comparison of the epoch)
    model[1] = torch.nn.LeakyReLU(0.3)
    after = free.part()
    assert after != before and _values(after)["self.1.negative_slope"] == 0.3
    model[1].negative_slope = 0.5  # (the new one's settings are followed)
    assert _values(free.part())["self.1.negative_slope"] == 0.5
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    free = FreeValues(plain, plain)
    assert free.active and free.part() is None  # (nothing read: no key part)
    plain[1] = torch.nn.Sigmoid()
    assert free.part() is not None  # (another module: no recording of the old one fits)
    torch.nn.Linear(2, 2)  # (a module made elsewhere: the epoch moves, the structure is the same)
    assert free.part() == free.part()


def test_the_settings_of_a_module_passed_as_an_argument_are_keyed():
    # `step(model, x)` with `model.drop.p = 0.0` between calls: a module argument was keyed by its
    # type, identity and mode only (found by a CPU hunt for keying gaps, eighteenth session)
    from graphtree.tree.reach import ModuleArguments

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    args = ModuleArguments()
    x = torch.ones(1, 2)
    assert args.part((x,), {}) is None  # (no module among the arguments: nothing to key)
    before, readers = args.part((model, x), {})
    model[1].p = 0.0
    after, _ = args.part((model,), {"x": x})
    assert after != before and len(readers) == 1
    ModuleArguments.after_call((after, readers))  # (a library's settings: nothing dropped)
    assert args.part((model, x), {})[0] == after


class _Probing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        y = self.lin(x) * getattr(self, "scale", 1.0)
        if not hasattr(self, "_calls"):  # (lazy state the call sets: no setting)
            self._calls = 0
        return y + self._shift() if hasattr(self, "shift") else y

    def _shift(self):
        return self.shift


class _ProbingSampler:
    def sample(self, logits):
        return logits / getattr(self, "temperature", 1.0)


def test_an_attribute_the_code_probes_with_a_default_is_keyed_absent_and_set_later():
    # `getattr(self, "scale", 1.0)` with `model.scale = 2.0` set after the first call: absent at the
    # first call, the attribute was not keyed, and the recording made without it replayed
    model = _Probing()
    free = FreeValues(model, model)
    absent = {name: t for name, t, _ in free.part()[1]}
    assert absent == {"self.scale": object, "self.shift": object, "self._calls": object}  # (keyed as absent)
    model(torch.ones(1, 2))  # the call sets `_calls`: its own state, no longer followed
    free.after_call()
    assert "self._calls" not in _values(free.part())
    model.scale = 2.0
    assert _values(free.part())["self.scale"] == 2.0
    model.shift = 0.5  # (probed in forward, read in a method it calls)
    assert _values(free.part())["self.shift"] == 0.5
    del model.scale
    assert {name: t for name, t, _ in free.part()[1]}["self.scale"] is object  # absent again
    sampler = _ProbingSampler()
    free = FreeValues(sampler.sample)
    before = free.part()
    sampler.temperature = 0.7
    assert free.part() != before and _values(free.part())["self.temperature"] == 0.7


STEP = 0
COUNTS = [0, 0]


def _counts_its_calls(x):
    global STEP
    STEP += 1  # (a replay would not count)
    COUNTS[0] += 1  # (an item written in place: the list's length stays)
    return x * 2


def test_items_and_values_a_call_changes_are_seen_by_its_warm_up_and_leave_the_key():
    # `calls["n"] += 1` in a closure dict, `counts[0] += 1`, `STEP += 1`: a replay runs no Python,
    # so it would not count; keyed (the dict's entry, the global) each call was a new signature
    global STEP
    free = FreeValues(_counts_its_calls)
    assert _values(free.part()) == {"STEP": 0}
    watched = free.containers()
    _counts_its_calls(torch.ones(2))
    assert watched.changed() == "the list `COUNTS` (a global or closure variable its code reads)"
    assert free.after_warm_up(watched) == watched.changed()
    assert free.part() is None  # `STEP` is its state now: no longer keyed
    calls = {"n": 0, "scale": 2.0}

    def counted(x):
        calls["n"] += 1
        return x * calls["scale"]

    free = FreeValues(counted)
    assert _values(free.part()) == {"calls['n']": 0, "calls['scale']": 2.0}
    watched = free.containers()
    counted(torch.ones(2))
    assert watched.changed() == "the dict `calls` (a global or closure variable its code reads)"
    free.after_warm_up(watched)
    assert _values(free.part()) == {"calls['scale']": 2.0}  # the setting stays keyed
    watched = free.containers()
    calls["scale"] = float("2.0")  # (the same value written again: no change)
    assert watched.changed() == ""
    STEP = 0
    COUNTS[0] = 0


def test_a_value_rebound_by_the_call_alone_is_named():
    free = FreeValues(_bumps)
    watched = free.containers()
    _bumps(1)
    assert watched.changed() == "`_BUMPED` (a value its code reads)"
    free.after_warm_up(watched)
    assert free.part() is None
    # no longer keyed but still watched: the next warm-up sees it change again (on the H100 the
    # second warm-up, not seeing it, let the signature record, and replays skipped the count)
    watched = free.containers()
    _bumps(1)
    assert free.after_warm_up(watched) == "`_BUMPED` (a value its code reads)"
    watched = free.containers()
    assert watched.changed() == ""  # (nothing ran)


_BUMPED = 0


def _bumps(x):
    global _BUMPED
    _BUMPED = _BUMPED + x
    return x
