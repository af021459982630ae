"""A whole training step inside one recording: the parameters and optimizers a function reaches,
what of them keys its recordings, and gradients kept out of the tree's pool.

A step function — ``zero_grad``, forward, ``backward()``, ``optimizer.step()`` — computes under
autograd, but nothing of its autograd graph leaves the call: it returns ``loss.detach()``. Such a
call is recorded like any other, backward and optimizer kernels included. Three things make
its replays equal to eager steps:

- **Gradients stay the caller's.** ``zero_grad(set_to_none=True)`` (the default) makes the
  backward allocate new ``.grad`` tensors, inside the capture from the tree's pool, where a
  later recording may reuse the memory. At the end of the capture, each such gradient is copied
  (inside the graph) into the ``.grad`` tensor the parameter had before the call, which a
  warm-up allocated outside the pool, and ``.grad`` is set back to it. Every replay computes the
  gradients, copies them there and sets ``.grad`` again, so after a step ``p.grad`` holds that
  step's gradient, as eager leaves it — on the same tensor each step, where eager makes a new one.
- **What the step's kernels depend on is in the key.** Whether each parameter's ``.grad`` is
  None decides what the backward captures (a new gradient, or one added in place: accumulation
  across calls), and an optimizer's hyperparameters that are Python values (``lr``, ``betas``,
  ``weight_decay``) are baked into its kernels. Both are part of the signature: a learning-rate
  scheduler's new ``lr`` is a new recording (re-records are limited; an ``lr`` held in a CUDA
  tensor, ``AdamW(lr=torch.tensor(1e-3, device="cuda"), capturable=True)``, is read in place and
  needs none).
- **Optimizers that cannot be captured are named.** ``Adam``/``AdamW`` and friends keep their
  step count on the host unless ``capturable=True``; torch refuses to capture them. The
  signature then runs eagerly with that reason and its fix.

Parameters and optimizers are found in the function's closure, in the globals its code names,
in the object a bound method belongs to, and among the call's arguments.

Example::

    opt = torch.optim.AdamW(model.parameters(), capturable=True)

    @graphtree.graphed
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.state_epoch import param_epoch, watch_parameter_changes

NOT_CAPTURABLE = (
    "`{name}` steps {opt} with capturable=False: it keeps its step count on the host, and a graph "
    "cannot hold that. Make it with capturable=True ({opt}(params, ..., capturable=True)) to graph "
    "the step, or step the optimizer outside the graphed function"
)


class TrainingStep:
    """The modules and optimizers a function reaches outside its arguments, found once.

    ``key(leaves)`` is what of them a recording depends on; ``params(leaves)`` the parameters
    whose gradients the call may make; ``refusal(leaves)`` why no capture can hold the step.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        modules: list[torch.nn.Module] = []
        optimizers: list[torch.optim.Optimizer] = []
        for v in _reached(fn):
            if isinstance(v, torch.nn.Module) and all(v is not m for m in modules):
                modules.append(v)
            elif isinstance(v, torch.optim.Optimizer) and all(v is not o for o in optimizers):
                optimizers.append(v)
        self.modules = modules
        self.optimizers = optimizers
        self.trains = False  # a warm-up changed a parameter or a gradient: key() is part of its signature
        self._stamp: Any = None  # what the cached parameter list was read under (see _unique)
        self._cached: list[torch.Tensor] = []
        if modules:
            watch_parameter_changes()

    def before(self, leaves: Sequence[Any] = ()) -> list[tuple[int, int, int]]:
        """What a warm-up's :meth:`after` compares: each parameter's version and its gradient's."""
        return [_versions(p) for p in self.params(leaves)]

    def after(self, before: list[tuple[int, int, int]], leaves: Sequence[Any] = ()) -> None:
        """Note that the call trains (from now on) when it changed a parameter or a gradient."""
        if not self.trains and before != [_versions(p) for p in self.params(leaves)]:
            self.trains = True

    def __bool__(self) -> bool:
        return bool(self.modules or self.optimizers)

    def _all(self, leaves: Sequence[Any]) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
        mods, opts = self.modules, self.optimizers
        extra = [x for x in leaves if isinstance(x, (torch.nn.Module, torch.optim.Optimizer))]
        if extra:
            mods = [*mods, *(x for x in extra if isinstance(x, torch.nn.Module))]
            opts = [*opts, *(x for x in extra if isinstance(x, torch.optim.Optimizer))]
        return mods, opts

    def params(self, leaves: Sequence[Any] = ()) -> list[torch.Tensor]:
        """Parameters that require grad, each once: of the modules, then of the optimizers."""
        return [p for p in self._unique(*self._all(leaves)) if p.requires_grad]

    def _unique(self, mods: list[torch.nn.Module], opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
        """The parameters, each once; walked again only when a module registered one (the
        epoch of :func:`~graphtree.tree.state_epoch.param_epoch`) or an optimizer's groups changed:
        walking a ResNet's modules on every call cost more than its replay's other checks."""
        own = mods is self.modules and opts is self.optimizers  # (no module or optimizer among the arguments)
        stamp = (param_epoch(), tuple(id(g["params"]) for o in opts for g in o.param_groups)) if own else None
        if own and stamp == self._stamp:
            return self._cached
        seen: set[int] = set()
        out = []
        for p in _params(mods, opts):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        if own:
            self._stamp, self._cached = stamp, out
        return out

    def key(self, leaves: Sequence[Any] = ()) -> tuple[Any, ...]:
        """Which parameters have a ``.grad``, and the optimizers' hyperparameters that are Python values."""
        mods, opts = self._all(leaves)
        has_grad = tuple(p.grad is not None for p in self._unique(mods, opts) if p.requires_grad)
        hyper = tuple(_hyper(o) for o in opts)
        return ("grads", has_grad, hyper)

    def refusal(self, name: str, leaves: Sequence[Any] = ()) -> str | None:
        """Why a capture cannot hold the call's optimizer steps (one not capturable), or None."""
        for opt in self._all(leaves)[1]:
            if any(g.get("capturable") is False for g in opt.param_groups):
                return NOT_CAPTURABLE.format(name=name, opt=type(opt).__name__)
        return None


def is_forward(fn: Callable[..., Any], module: torch.nn.Module | None) -> bool:
    """Whether ``fn`` is ``module`` itself or its ``forward`` (or ``__call__``): a call whose
    autograd graph its caller needs, which no whole-step recording applies to."""
    if module is None:
        return False
    if fn is module:
        return True
    return getattr(fn, "__self__", None) is module and getattr(fn, "__name__", "") in ("forward", "__call__")


def _reached(fn: Any) -> Iterable[Any]:
    """What a function can reach besides its arguments: its closure, the globals its code names,
    and the object a bound method belongs to (its attributes)."""
    if isinstance(fn, torch.nn.Module):
        return [fn]
    out: list[Any] = []
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        out.append(owner)
        out.extend(getattr(owner, "__dict__", {}).values())
    f = getattr(fn, "__func__", fn)
    f = getattr(f, "func", f)  # functools.partial
    for cell in getattr(f, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    code, env = getattr(f, "__code__", None), getattr(f, "__globals__", None)
    if code is not None and env is not None:
        out.extend(env[n] for n in code.co_names if n in env)
    return out


def _versions(p: torch.Tensor) -> tuple[int, int, int]:
    g = p.grad
    return (p._version, id(g), g._version if g is not None else -1)


def _params(mods: Sequence[torch.nn.Module], opts: Sequence[torch.optim.Optimizer]) -> Iterable[torch.Tensor]:
    for m in mods:
        yield from m.parameters()
    for o in opts:
        for g in o.param_groups:
            yield from g["params"]


def _hyper(opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    return tuple(
        tuple((k, v) for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor))
        for g in opt.param_groups
    )


def grad_targets(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Before a capture (outside the pool): where :func:`keep_out_of_pool` copies each new
    gradient to. A parameter's ``.grad``, or, where it has none (``zero_grad`` before the call),
    a new tensor like the parameter, as autograd would make it."""
    return [p.grad if p.grad is not None else torch.empty_like(p, memory_format=torch.preserve_format) for p in params]


def keep_out_of_pool(
    params: Sequence[torch.Tensor], before: Sequence[torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inside a capture, after the function: each gradient the call made anew is copied (a
    captured copy) into its tensor of ``before`` (:func:`grad_targets`), and ``.grad`` is set
    to that tensor. Returns the (parameter, gradient tensor) pairs a replay sets again; a new
    gradient with nothing to copy into is left, and the capture counts it as state the call keeps."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for p, old in zip(params, before):
        new = p.grad
        if new is None or new is old or old is None:
            continue
        if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
            continue
        dst.append(old)
        src.append(new)
        pairs.append((p, old))
    if dst:
        _torch.foreach_copy(dst, src)
        for p, old in pairs:
            p.grad = old
    return pairs


def set_grads(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """After a replay: each parameter's ``.grad`` is the tensor the graph wrote its gradient into."""
    for p, g in pairs:
        if p.grad is not g:
            p.grad = g
