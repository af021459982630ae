"""A call under autograd as two graphs: the forward replayed when it is called, the backward when
autograd reaches it (what ``graphed(module)`` runs under grad: :mod:`graphtree.tree.module_training`).

``TrainingRecording.capture`` warms the function up (on a side stream, with module buffers such as
BatchNorm's running statistics put back after: warm-ups are not steps), captures its forward, and
then the gradient of its outputs with respect to its inputs and parameters that require grad, in
the same memory pool. :func:`apply` runs a call through :class:`_Replay`, an autograd ``Function``
whose ``forward`` replays the first graph and whose ``backward`` replays the second, so that
autograd routes the gradients like any other operation's:

- **Gradients land as eager's do.** ``backward`` returns copies of the graph's gradient buffers,
  never the buffers: autograd's ``AccumulateGrad`` may keep the tensor it is handed as ``.grad``
  (when ``.grad`` is None), and a buffer kept there would be overwritten by the next backward
  replay, so accumulation across micro-batches would add the last micro-batch's gradient to
  itself (the bug cudagraph trees have, roboflow/rf-detr#1479). ``zero_grad(set_to_none=True)``
  needs nothing more: ``.grad`` is then a fresh copy again.
- **Outputs are the caller's.** The forward returns copies of its output buffers, so an output
  kept across steps (a list of losses) keeps its values.
- **One forward, then its backward.** The graph's saved activations are those of its last forward
  replay: the backward of an earlier forward (two forwards, then one backward through both) raises
  instead of computing with another call's activations. A second backward of the same forward
  (``retain_graph=True``) replays it again, right; a double backward (``create_graph=True``) raises.

Example::

    rec = TrainingRecording.capture(model, (x,), list(model.parameters()))
    loss = apply(rec, (x,))[0].sum()
    loss.backward()                     # replays the backward graph; grads in p.grad
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from graphtree import _streams, _torch
from graphtree.tree import draws as _draws

STALE_BACKWARD = (
    "graphtree: the backward of an earlier call of `{name}` ran after a later call's forward replay: "
    "the graph holds only the last forward's activations. Call backward before the next forward, "
    "or run such steps eagerly"
)


class _Replay(torch.autograd.Function):
    """Autograd's view of one graphed call: its forward and backward are replays."""

    @staticmethod
    def forward(ctx: Any, recording: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.recording = recording
        ctx.generation = recording.run_forward(tensors)
        ctx.pending = recording.pending()  # alive while autograd can still reach this call's backward
        outs: tuple[torch.Tensor, ...] = recording.outputs()
        ctx.mark_non_differentiable(*(o for o, g in zip(outs, recording.static_grad_outputs) if g is None))
        return outs

    @staticmethod
    @once_differentiable  # a double backward raises: the graph holds no graph of its own gradient
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        recording = ctx.recording
        if ctx.generation != recording.generation:
            raise RuntimeError(STALE_BACKWARD.format(name=recording.name))
        return (None, *recording.run_backward(grads))


def apply(recording: Any, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run one call of ``recording`` (a :class:`TrainingRecording`, or anything with its methods)
    on ``inputs`` under autograd; returns its outputs, which require grad where the function's did."""
    return _Replay.apply(recording, *inputs, *recording.params)  # type: ignore[no-any-return]


class WarmUpFailed(RuntimeError):
    """The function raised in the warm-up of :meth:`TrainingRecording.capture` (its exception is the cause)."""


class _Pending:
    """Held by the autograd node of one forward replay: while it is alive, that call's backward may come."""


class TrainingRecording:
    """The forward and backward graphs of one signature of a function under autograd.

    Built by :meth:`capture`. ``params`` are read in place (a module's parameters); the other
    inputs are copied into the graph's own tensors on every call. ``run_forward`` and
    ``run_backward`` are what :class:`_Replay` calls.
    """

    def __init__(
        self,
        name: str,
        static_inputs: list[torch.Tensor],
        params: list[torch.Tensor],
        static_outputs: list[torch.Tensor],
        static_grad_outputs: list[torch.Tensor | None],
        static_grads: list[torch.Tensor | None],
        forward_graph: Any,
        backward_graph: Any,
        single: bool = False,
        spec: Any = None,
    ) -> None:
        self.name = name
        self.static_inputs = static_inputs
        self.params = params
        self.static_outputs = static_outputs
        self.static_grad_outputs = static_grad_outputs  # None where an output needs no grad
        self.static_grads = static_grads  # per input, then per parameter: None where none flows
        self.forward_graph = forward_graph
        self.backward_graph = backward_graph
        self.generation = 0  # forward replays so far: a backward belongs to the last one
        self.single = single  # the function returned one tensor, not a tuple or list
        self.spec = spec  # how to rebuild what it returned (see _structure); None: one tensor or a plain tuple
        self.open = False  # a forward replayed whose backward has not run
        self._pending: Callable[[], _Pending | None] = lambda: None  # (a weak reference to the last forward's)
        self._param_ptrs = [p.data_ptr() for p in params]

    def pending(self) -> _Pending:
        """A new token for the forward replayed now, for its autograd node to hold (see :meth:`backward_may_come`)."""
        token = _Pending()
        self._pending = weakref.ref(token)
        return token

    def backward_may_come(self) -> bool:
        """Whether the last forward replay's backward has not run and still can: its autograd node is
        alive (a loss computed from its output, even once the output itself is gone). A forward
        replayed now would leave that backward nothing but the new call's activations."""
        return self.open and self._pending() is not None

    def params_moved(self) -> bool:
        """Whether a parameter was replaced (not updated in place) since the recording: it must be made again."""
        return any(p.data_ptr() != ptr for p, ptr in zip(self.params, self._param_ptrs))

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> int:
        """Check the call against the recording, copy its inputs in and replay the forward; the
        generation the backward must match. ``ValueError`` for inputs the graph was not recorded for
        (number, shape, dtype, device, ``requires_grad``), ``RuntimeError`` for a parameter replaced
        rather than updated in place (the graph would read the old one)."""
        n = len(self.static_inputs)
        if len(tensors) != n + len(self.params):
            got = len(tensors) - len(self.params)
            raise ValueError(f"`{self.name}` was recorded with {n} tensor inputs, called with {got}")
        for i, (static, t) in enumerate(zip(self.static_inputs, tensors)):
            if (t.shape, t.dtype, t.device, t.requires_grad) != (
                static.shape,
                static.dtype,
                static.device,
                static.requires_grad,
            ):
                raise ValueError(
                    f"`{self.name}` input {i}: recorded as {tuple(static.shape)} {static.dtype} on {static.device}"
                    f" (requires_grad={static.requires_grad}), called with {tuple(t.shape)} {t.dtype} on {t.device}"
                    f" (requires_grad={t.requires_grad}): record this signature on its own"
                )
            if static.data_ptr() != t.data_ptr():
                static.detach().copy_(t.detach())
        if self.params_moved():
            raise RuntimeError(
                f"`{self.name}`: a parameter moved since it was recorded (replaced, not updated in place): "
                "record it again"
            )
        _draws.replay(self.forward_graph)
        self.generation += 1
        self.open = True
        return self.generation

    def returned(self, outs: tuple[torch.Tensor, ...]) -> Any:
        """``outs`` (what :func:`apply` returned) as the function returned them: one tensor, a tuple, or
        the list, namedtuple or structseq (``torch.return_types.sort``) it returned."""
        if self.single:
            return outs[0]
        return outs if self.spec is None else _torch.tree_unflatten(list(outs), self.spec)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """Copies of the forward's outputs (the caller's to keep)."""
        return tuple(o.detach().clone() for o in self.static_outputs)

    def run_backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """Copy the outputs' gradients in, replay the backward; copies of the inputs' and parameters'
        gradients (None where none flows)."""
        for static, g in zip(self.static_grad_outputs, grads):
            if static is None:
                continue
            if g is None:  # (autograd materializes unused outputs' gradients as zeros; None if told not to)
                static.zero_()
            else:
                static.copy_(g)
        self.open = False
        if self.backward_graph is not None:
            _draws.replay(self.backward_graph)
        # copies in one call: a clone() each cost ~16 µs of CPU (ResNet-18: 1 ms a step, on the H100)
        copies = iter(_torch.copies([g for g in self.static_grads if g is not None]))
        return tuple(next(copies) if g is not None else None for g in self.static_grads)

    @classmethod
    def capture(
        cls,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor] | None = None,
        name: str | None = None,
        warmup: int = 3,
        pool: tuple[int, int] | None = None,
        module: torch.nn.Module | None = None,
    ) -> TrainingRecording:
        """Warm ``fn`` up ``warmup`` times on a side stream (``buffers`` put back after: warm-ups are
        not steps; by default a module's own buffers), then capture its forward on copies of
        ``inputs`` and the gradient of its outputs that require grad with respect to the inputs and
        ``params`` (each once) that require grad. ``fn`` must return a tensor or a tuple or list of
        tensors. ``pool``: a memory pool for both graphs (default: a new one; share one only among
        recordings whose replays do not interleave). CUDA only.

        ``module`` (``fn`` itself when it is one): the module ``fn`` runs, whose parameters are then
        ``params``. It is called through ``torch.func.functional_call`` with fresh leaf aliases of
        its parameters (their storage), whose gradients the backward graph computes: a parameter's
        own gradient accumulator, made on another stream by an eager call whose autograd graph is
        still alive, would tie the captured backward to that stream ("operation would make the
        legacy stream depend on a capturing blocking stream", on the H100).

        Random operations draw what eager draws: the warm-ups' draws are taken back (the device's
        generator is forked around them), and each forward replay hands its generator's seed and
        offset to the capture's stand-in (:mod:`graphtree.tree.draws`). Limits: BatchNorm with
        ``momentum=None`` reads a count on the host and cannot be captured. Autocast's cache is off
        during the captures, as ``make_graphed_callables`` asks of its users."""
        from graphtree.tree.recorder import capture_isolated, user_code_section  # (it imports nothing of this module)

        name = str(name or getattr(fn, "__qualname__", type(fn).__name__))
        module = module if module is not None else (fn if isinstance(fn, torch.nn.Module) else None)
        if buffers is None:
            buffers = list(module.buffers()) if module is not None else []
        if module is not None:  # (named_parameters lists a tied weight once)
            named = dict(module.named_parameters())
            params = list(named.values())
            aliases = {k: p.detach().requires_grad_(p.requires_grad) for k, p in named.items()}
            leaves = list(aliases.values())

            def run(*a: Any) -> Any:
                return torch.func.functional_call(module, aliases, a)
        else:
            params = list({id(p): p for p in params}.values())  # a tied weight listed twice: one gradient
            leaves, run = params, fn
        static_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        wrt = [t for t in (*static_inputs, *leaves) if t.requires_grad]
        # Warm-ups and captures write into the buffers (BatchNorm's statistics) and bump their autograd
        # versions: the values are put back (warm-ups are not steps) and so are the versions, or an eager
        # call's pending backward that saved a buffer (cuDNN's batch norm does) would raise.
        state = [*params, *buffers]
        versions = [t._version for t in state]
        kept = [b.detach().clone() for b in buffers]
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        # one stream for all (autograd runs a backward on its forward's stream), graphtree's alone
        side = _streams.own_stream(torch.cuda.current_device())  # (the device's own, as the forks below)
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        device = torch.cuda.current_device()
        try:
            # (warm-ups are not calls: the random numbers they draw are drawn again by the replay)
            with torch.cuda.stream(side), user_code_section(), torch.random.fork_rng(devices=[device]):
                try:
                    for _ in range(warmup):
                        try:
                            out = run(*static_inputs)
                        except Exception as e:
                            raise WarmUpFailed(f"`{name}` raised in its warm-up") from e
                        needs = [o for o in _tensors(out) if o.requires_grad]
                        _check_leaves(needs, wrt, name)
                        if needs and wrt:
                            grad_outputs = [torch.ones_like(o) for o in needs]
                            torch.autograd.grad(needs, wrt, grad_outputs=grad_outputs, allow_unused=True)
                finally:
                    with torch.no_grad():
                        for b, k in zip(buffers, kept):
                            b.data.copy_(k)
                    current.wait_stream(side)
            forward_graph = torch.cuda.CUDAGraph()
            returned: list[Any] = []  # what the function returned (one tensor, or several)

            def forward() -> list[torch.Tensor]:
                returned.append(run(*static_inputs))
                return _tensors(returned[0])

            static_outputs = capture_isolated(forward_graph, pool, side, forward)
            _check_aliases(static_outputs, static_inputs, name)
            needs = [o for o in static_outputs if o.requires_grad]
            static_grad_outputs: list[torch.Tensor | None] = [
                torch.empty_like(o) if o.requires_grad else None for o in static_outputs
            ]
            backward_graph: Any = None  # (nothing to differentiate: no backward)
            found: Sequence[torch.Tensor | None] = ()
            if needs and wrt:
                grad_outputs = [g for g in static_grad_outputs if g is not None]
                backward_graph = torch.cuda.CUDAGraph()
                found = capture_isolated(
                    backward_graph,
                    pool,
                    side,
                    lambda: torch.autograd.grad(needs, wrt, grad_outputs=grad_outputs, allow_unused=True),
                )
        finally:
            _torch.set_versions(state, versions)
            _streams.give_back(side)
        by_tensor = dict(zip(map(id, wrt), found))
        static_grads = [by_tensor.get(id(t)) if t.requires_grad else None for t in (*static_inputs, *leaves)]
        return cls(
            name,
            static_inputs,
            params,
            static_outputs,
            static_grad_outputs,
            static_grads,
            forward_graph,
            backward_graph,
            single=isinstance(returned[0], torch.Tensor),
            spec=_structure(returned[0]),
        )


def _check_leaves(outs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], name: str) -> None:
    """``ValueError`` when the outputs' autograd graph reaches a tensor that requires grad other
    than ``wrt`` (a global, a closure's tensor, a parameter of another module): the captured
    backward would not give it its gradient."""
    known = {id(t) for t in wrt}
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    seen: set[int] = set()
    others = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it feeds
        if var is not None and id(var) not in known:
            others.append(var)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    if others:
        shapes = ", ".join(str(tuple(t.shape)) for t in others[:4])
        raise ValueError(
            f"`{name}` reads {len(others)} tensor(s) that require grad besides its arguments and its module's "
            f"parameters ({shapes}): a recorded backward would not give them their gradients"
        )


def _check_aliases(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], name: str) -> None:
    """``ValueError`` when an output shares memory with an input (``view_as_complex``, a slice): the
    recording's output is a view of its own copy of the input, which the next call overwrites, and
    its gradient came back with the output's dtype (the OpInfo sweep on an H100: complex64 for a
    float32 input)."""
    ptrs = {t.untyped_storage().data_ptr(): i for i, t in enumerate(inputs) if t.numel()}
    for o in outs:
        i = ptrs.get(o.untyped_storage().data_ptr()) if o.numel() else None
        if i is not None:
            raise ValueError(
                f"`{name}` returns a view of its input {i}: a training recording replays into its own copy of "
                f"the input, which the next call overwrites (return a copy, or graph a whole training step)"
            )


def _structure(out: Any) -> Any:
    """The pytree spec that rebuilds ``out`` (a list or tuple of tensors) from a tuple of its tensors,
    or None where the tuple itself is right: one tensor, a plain tuple, or a tuple subclass pytrees
    do not flatten."""
    if isinstance(out, torch.Tensor) or type(out) is tuple:
        return None
    leaves, spec = _torch.tree_flatten(out)
    return spec if len(leaves) == len(out) else None


def _tensors(out: Any) -> list[torch.Tensor]:
    """The function's outputs as a list of tensors; ``TypeError`` for anything else."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    got = type(out).__name__
    raise TypeError(f"a function graphed for training must return a tensor or a tuple of tensors, got {got}")
