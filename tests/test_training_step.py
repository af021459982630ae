"""A training step's parameters and optimizers as graphtree finds and keys them (tree/training_step.py).
The recording itself needs a GPU: tests/gpu/test_train_step_gpu.py."""

from __future__ import annotations

import torch
from torch import nn

from graphtree.tree.training_step import NOT_CAPTURABLE, TrainingStep, grad_targets, keep_out_of_pool, set_grads

MODEL = nn.Linear(4, 2)
OPT = torch.optim.SGD(MODEL.parameters(), lr=0.1)


def _global_step(x):
    OPT.zero_grad()
    MODEL(x).sum().backward()
    OPT.step()


def test_modules_and_optimizers_are_found_in_closures_globals_and_bound_objects():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), capturable=True)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    found = TrainingStep(step)
    assert found.modules == [model] and found.optimizers == [opt]
    assert len(found.params()) == 4  # each parameter once, though the optimizer lists them too

    g = TrainingStep(_global_step)
    assert g.modules == [MODEL] and g.optimizers == [OPT]

    class Trainer:
        def __init__(self) -> None:
            self.model, self.opt = model, opt

        def step(self, x):
            return self.model(x)

    t = TrainingStep(Trainer().step)
    assert t.modules == [model] and t.optimizers == [opt]
    assert not TrainingStep(lambda x: x * 2)


def test_the_key_changes_with_gradients_present_and_with_the_learning_rate():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainingStep(lambda x: opt.step() or model(x))
    k0 = step.key()
    model(torch.ones(2, 4)).sum().backward()
    k1 = step.key()
    assert k1 != k0  # .grad None -> present: another backward (a new gradient, or one added in place)
    opt.param_groups[0]["lr"] = 0.05  # what a scheduler does
    assert step.key() != k1
    opt.param_groups[0]["lr"] = 0.1
    assert step.key() == k1
    lr = torch.tensor(0.1)
    opt.param_groups[0]["lr"] = lr  # a tensor learning rate is read in place: not in the key
    k2 = step.key()
    lr.fill_(0.2)
    assert step.key() == k2


def test_a_warm_up_that_changes_parameters_or_gradients_marks_the_function_as_training():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward(x):
        return model(x)

    step = TrainingStep(forward)
    before = step.before()
    with torch.no_grad():
        model(torch.ones(1, 4))
    step.after(before)
    assert not step.trains  # a forward under no_grad changes nothing
    before = step.before()
    model(torch.ones(1, 4)).sum().backward()
    step.after(before)
    assert step.trains

    def opt_step():
        opt.step()

    only_opt = TrainingStep(opt_step)
    before = only_opt.before()
    opt.step()  # the gradients exist: the parameters change in place
    only_opt.after(before)
    assert only_opt.trains


def test_an_optimizer_that_is_not_capturable_is_refused_with_the_fix():
    model = nn.Linear(4, 1)
    adam = torch.optim.Adam(model.parameters())
    capturable = torch.optim.Adam(model.parameters(), capturable=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps(opt):
        def step():
            opt.step()

        return step

    refusal = TrainingStep(steps(adam)).refusal("step")
    assert refusal == NOT_CAPTURABLE.format(name="step", opt="Adam") and "capturable=True" in refusal
    assert TrainingStep(steps(capturable)).refusal("step") is None
    assert TrainingStep(steps(sgd)).refusal("step") is None  # SGD keeps no step count


def test_new_gradients_are_copied_into_the_ones_before_and_set_back():
    model = nn.Linear(4, 2)
    model(torch.ones(1, 4)).sum().backward()  # gradients a warm-up made
    params = list(model.parameters())
    before = [p.grad for p in params]
    assert all(g is not None for g in before)
    for p in params:
        p.grad = None  # zero_grad(set_to_none=True) inside the call
    model(torch.full((1, 4), 2.0)).sum().backward()
    fresh = [p.grad.clone() for p in params]
    pairs = keep_out_of_pool(params, before)
    assert [p for p, _ in pairs] == params
    for p, g, want, old in zip(params, [g for _, g in pairs], fresh, before):
        assert p.grad is old and g is old  # the tensor from before, holding the new gradient
        assert torch.equal(p.grad, want)
    for p in params:
        p.grad = None  # what the user may do between steps
    set_grads(pairs)
    assert all(p.grad is g for p, g in pairs)


def test_a_new_gradient_with_nothing_to_copy_into_is_left_alone():
    model = nn.Linear(4, 2)
    params = list(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    made = [p.grad for p in params]
    assert keep_out_of_pool(params, [None, None]) == []  # the capture counts these as kept state
    assert all(p.grad is g for p, g in zip(params, made))


def test_a_parameter_without_a_gradient_gets_a_target_like_itself():
    model = nn.Linear(4, 2)
    params = list(model.parameters())
    targets = grad_targets(params)  # zero_grad(set_to_none=True) before the call: no .grad yet
    assert all(t.shape == p.shape and t.dtype == p.dtype for t, p in zip(targets, params))
    model(torch.ones(1, 4)).sum().backward()
    want = [p.grad.clone() for p in params]
    pairs = keep_out_of_pool(params, targets)
    assert all(p.grad is t and torch.equal(p.grad, w) for p, t, w in zip(params, targets, want))
    assert len(pairs) == 2


def test_the_parameter_list_is_walked_again_only_when_it_can_have_changed():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.step()
        return model(x)

    found = TrainingStep(step)
    first = found.params()
    assert found.params() == first and found._unique(*found._all(())) is found._unique(*found._all(()))  # cached
    model.append(nn.Linear(4, 2))  # registers a submodule: the epoch moves
    assert len(found.params()) == 4
    model[1].weight.requires_grad_(False)  # frozen: read on every call, no walk needed
    assert len(found.params()) == 3
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    assert len(found.params()) == 4
