"""``graphed``: wrap a PyTorch callable so that its calls are recorded and replayed as CUDA graphs."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtree import _events, _native, _torch
from graphtree._after_import import call_after_import
from graphtree.tree import ambient as _ambient
from graphtree.tree import fast_hit as _fast_hit
from graphtree.tree import manager as _manager
from graphtree.tree.bucket_warmup import record_buckets
from graphtree.tree.callee import UserCode, user_code
from graphtree.tree.churn import Churn
from graphtree.tree.graphed_module import GraphedModule
from graphtree.tree.hf_cache import CacheLayouts
from graphtree.tree.hf_compile import CompiledTwins
from graphtree.tree.hf_compile import install as install_compiled_twins
from graphtree.tree.hooks import CallHooks
from graphtree.tree.inputs import Bucketing, Call, plain_tensor_parts, read_call
from graphtree.tree.lockstep import LOCKSTEP_TIMEOUT, Lockstep, for_groups, release_before_teardown
from graphtree.tree.module_training import NOT_HELD, ModuleCalls
from graphtree.tree.numbers import Numbers
from graphtree.tree.options import MAX_VALUES, Options
from graphtree.tree.parts import MIN_PART_OPS, Parts, own_copies
from graphtree.tree.reach import FreeValues, ModuleArguments, Reach
from graphtree.tree.readable import PLAIN_TYPES, Unsupported
from graphtree.tree.state_epoch import watch_parameter_changes
from graphtree.tree.stats import count_eager
from graphtree.tree.teardown import drop_all
from graphtree.tree.training_step import TrainingStep, is_forward
from graphtree.tree.verdicts import Verdicts

_ids = itertools.count(1)
_cuda_ok: bool | None = None
_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling  # (one frame, not two: before the fast hit)
_state = _ambient.state
log = logging.getLogger("graphtree")


def _has_cuda() -> bool:
    global _cuda_ok
    if _cuda_ok is None:
        _cuda_ok = torch.cuda.is_available()
    return _cuda_ok


def mark_static(t: torch.Tensor) -> torch.Tensor:
    """Use ``t`` in place in recordings instead of copying it; returns ``t``.

    For tensors whose address never changes and whose contents you update in place (a KV cache,
    a persistent input buffer). Only the address is checked on replay; a different address
    leads to a new recording.

    Example::

        cache = graphtree.mark_static(torch.zeros(8, 1024, device="cuda"))
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark_static expects a tensor, got {type(t).__name__}")
    t._graphtree_static = True  # type: ignore[attr-defined]
    return t


class GraphedCallable:
    """A callable whose calls run as replays of CUDA graphs (see :func:`graphed`)."""

    # The attributes its fast hit reads on every call, as slots (the native hit reads them at their
    # offsets: graphtree/_native/fast_hit.h); the rest in its __dict__ (functools.update_wrapper's too).
    __slots__ = (
        "__dict__", "__weakref__", "_forward", "_grad_off_inside", "_reach", "_snapshots", "_step", "bucketing",
        "disabled_reason", "fast_hits", "free", "id", "numbers",
    )  # fmt: skip
    graphtree_callable = True  # (how tree/parts.py knows one among a module's attributes)
    hooks_around = False  # its module's own hooks run around its calls, not inside (a part's: GraphedPart)

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        buckets: Sequence[int] | None = None,
        bucket_dim: int = 0,
        warmup: int = 1,
        max_rerecords: int = 8,
        name: str | None = None,
        debug: str | os.PathLike[str] | None = None,
        max_break_values: int = MAX_VALUES,
        lockstep_timeout: float = LOCKSTEP_TIMEOUT,
        parts: bool = True,
        min_ops: int = 0,
        runs: Callable[..., Any] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"graphed() needs a callable, got {type(fn).__name__}")
        # checked (a ValueError names the option), and what a copy is made with (copy.deepcopy, pickle)
        self.options = Options(
            buckets, bucket_dim, warmup, max_rerecords, name, debug, max_break_values, lockstep_timeout, parts, min_ops
        )
        # runs: what the calls run, where that is not fn itself (a model's forward compiled by HF's
        # get_compiled_call: tree/hf_compile.py); fn still says what it is (its module, its caches)
        self.fn = runs if runs is not None else fn
        self.id = next(_ids)
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        # debug=: graphtree.debug provides the inputs' snapshots (dumped also should a CUDA fault
        # surface outside the calls) and the dump of a call that raises
        self._snapshots = _events.provided("debug").snapshots(fn, debug, self.name) if debug is not None else None
        self.bucketing = Bucketing(buckets, bucket_dim) if buckets is not None else None
        # The process groups of the collectives it calls, and the ranks' agreements (tree/lockstep.py)
        self._groups: dict[str, tuple[int, ...]] = {}
        self._lockstep: Lockstep | None = None
        self.disabled_reason: str | None = None
        # Signatures never to graph, with the reason (a host sync, a mutated input, a failed
        # capture, the re-record limit, ...): other signatures of the function still are.
        self.verdicts = Verdicts(self.name, min_ops)
        self.churn = Churn()  # signatures that keep changing run eagerly, without warm-ups (tree/churn.py)
        # Python numbers among the arguments: device scalars where they can be (tree/host_scalars.py)
        self.numbers = Numbers(self.id)
        self._reach = Reach(fn)  # its module, and its closure's tensors (read in place, followed per call)
        self._module = self._reach.module
        self.free = FreeValues(fn, self._module)  # plain values it reads besides its arguments (keyed per call)
        self._module_args = ModuleArguments()  # and the settings of modules passed as arguments
        # A module's forward builds an autograd graph its caller needs; any other function's
        # warm-up says (a training step returns loss.detach(): tree/training_step.py)
        self._forward = is_forward(fn, self._module)
        # The hooks of the modules the call runs (its own too, unless fn is its forward, around
        # which nn.Module.__call__ runs them): a call that would run one runs eagerly (tree/hooks.py)
        own_forward = self._forward and fn is not self._module and getattr(fn, "__name__", "") == "forward"
        inside = not (own_forward or self.hooks_around)
        self._hooks = CallHooks(self._module, include_self=inside)  # (and the models it calls by name)
        self._step: TrainingStep | None = None if self._forward else (TrainingStep(fn) or None)
        # a module's forward, or a function reaching no module, under autograd: tree/module_training.py
        train = (self._forward or (self._step is None and self._module is None)) and not min_ops  # (not a part)
        self._autograd = ModuleCalls(self._module, self.name, warmup) if train else None
        # @torch.no_grad() / @torch.inference_mode() on it: no autograd graph, whatever the caller's mode
        self._grad_off_inside = _torch.grad_off_inside(fn)
        # A transformers model's forward: fresh static caches get their tensors before the call
        # (hf_cache.py), and its decode step as HF compiles it (hf_compile.py); a module's signature
        # that cannot be graphed runs with its submodules graphed (tree/parts.py)
        self.min_ops = min_ops  # a part whose warm-ups dispatch fewer operators is not worth a graph
        self._hf_caches, self.compiled_twins, self._parts = _module_helpers(self, fn, runs, parts)
        self.fast_hits: dict[Any, Any] = {}  # its signatures' last replays (tree/fast_hit.py)
        functools.update_wrapper(self, fn, updated=())
        # Collected, its recordings (and the pool memory only they used) are dropped at each tree's next step.
        weakref.finalize(self, _manager.forget, self.id)

    def __repr__(self) -> str:
        return f"graphed({self.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy (``copy.deepcopy``, pickle) is the same callable graphed anew with the same options:
        it shares no recording (its function deep-copied where the copy is deep: a module's method
        with a copy of the module)."""
        return (_graphed_again, (type(self), self.fn, self.copy_options()))

    @property
    def warmup(self) -> int:
        """Eager runs before a new signature is recorded (``warmup=``); what the call reaches may
        ask for more (a DistributedDataParallel model: ``FreeValues.warms_up``)."""
        return self.options.warmup

    def copy_options(self) -> dict[str, Any]:
        """The options it was made with, for a copy (``buckets``, ``warmup``, ``name``...)."""
        return self.options.as_dict()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a decorator on a method: bind to the instance like a function would."""
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_dynamo_compiling():  # traced by torch.compile: graphtree's call runs outside the trace
            return _outside_compile(self, args, kwargs)
        if UserCode.threads and user_code.active:  # called from another graphed function's warm-up or recording
            return self.fn(*args, **kwargs)
        if self.fast_hits and not kwargs:  # the same replay as this signature's last (tree/fast_hit.py)
            out = _fast_hit.entry(self, self.fast_hits, args)
            if out is not _fast_hit.MISS:
                return out
        return self.past_fast_hit(args, kwargs)

    def past_fast_hit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call once no fast hit replayed it (none kept, or its answer changed): the Python path.
        ``GraphedModule.__call__`` calls it after trying the fast hit itself."""
        if _is_compiling():  # (torch.export's tracing too: its fake tensors are never a fast hit)
            return _outside_compile(self, args, kwargs)
        try:  # costs nothing unless the call raises (Python 3.11+)
            if self._snapshots is not None:  # debug=: the inputs as they were, should the call fail
                _take_snapshot(self, self._snapshots, args, kwargs)
            if self.disabled_reason is not None:
                return self._eager(args, kwargs, self.disabled_reason)
            models, hooks = self.free.models, self._hooks
            hooked = None if hooks.idle and not models else hooks.reason(self.name, models)
            if hooked is not None:
                return _in_parts(self, args, kwargs, hooked)
            if not (_cuda_ok or _has_cuda()):
                return self._eager(args, kwargs, "no CUDA")
            if self._hf_caches is not None and kwargs:  # a transformers cache: made ready first (hf_cache.py)
                return self._hf_caches.run(self._run, self._eager, args, kwargs)
            return self._run(args, kwargs)
        except Exception as e:
            if self.options.debug is not None:
                _events.provided("debug").dump_failure(
                    self.options.debug, self.fn, self.name, args, kwargs, e, snapshots=self._snapshots
                )
            raise

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Key the call and hand it to its tree (or run it eagerly, with the reason)."""
        if self.churn.streak >= self.churn.limit and not kwargs and _eager_now(self, args):  # churning
            return self._eager(args, kwargs, self.churn.reason(self.name))
        if self._reach.cells:
            self._reach.follow()
        try:
            call = read_call(args, kwargs, self.bucketing)
        except Unsupported as e:
            return self._eager(args, kwargs, str(e))
        free = self.free  # plain values it reads besides its arguments: a graph's constants (reach.py)
        reads = free.part() if free.active else None
        # (the settings of modules passed in, `step(model, x)`: a module is an object argument)
        held = self._module_args.part(args, kwargs) if call.objects else None
        if held is not None:
            reads = (reads, held[0])
        if _builds_autograd(self, call.needs_grad):
            if self._autograd is None or self.bucketing is not None:
                return self._eager(args, kwargs, NOT_HELD.format(name=self.name))
            out = self._autograd(self.fn, args, kwargs, (call.key, _state(), reads), self._eager)
            _after_call(self, held)
            return out
        if call.numbers:  # floats and ints keyed by type where they may be device scalars
            self.numbers.rekey(call)
        _key_state(call, self._module, reads, self._step)
        device = call.device
        if device < 0:
            device = self._reach.state_device()
            if device < 0:
                return self._eager(args, kwargs, "no CUDA tensors in the call")
        out = _manager.run(self, call, device)
        _after_call(self, held)
        if not kwargs and held is None:
            _fast_hit.remember(self, self.fast_hits, call, device)
        return out

    def takes_python_path(self, needs_grad: bool) -> bool:
        """Whether a call of tensors alone goes anywhere but its tree's replay (tree/fast_hit.py)."""
        step = self._step
        off = self._snapshots is not None or self.disabled_reason is not None or self.bucketing is not None
        follows = bool(self._reach.cells) or (step is not None and step.trains)
        # (grad mode first, though _builds_autograd reads it too: under no_grad, the common loop, no call)
        return off or follows or (torch.is_grad_enabled() and _builds_autograd(self, needs_grad))

    # --- eager paths ------------------------------------------------------------------------
    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> Any:
        count_eager(self.name, reason)
        return self.fn(*args, **kwargs)

    def run_eager(self, call: Call, reason: str) -> Any:
        """Run the function as plain PyTorch on a call's arguments, counting ``reason``; a module's
        signature given up runs with the module's parts graphed (tree/parts.py)."""
        args, kwargs = call.arguments()
        if call.key not in self.verdicts.given_up:
            return self._eager(args, kwargs, reason)
        return _in_parts(self, args, kwargs, reason)

    def parts(self) -> list[str]:
        """The names of the submodules put in this module's place while a signature of it that
        cannot be graphed runs, each followed by its own parts (a part that cannot be graphed
        whole runs with parts too); empty until such a call ran (:mod:`graphtree.tree.parts`)."""
        return self._parts.names() if self._parts is not None else []

    @property
    def is_part(self) -> bool:
        """Made by graphtree as a part of a module graphed in parts (tree/parts.py)."""
        return self.min_ops > 0

    def disable(self, reason: str) -> None:
        """Run eagerly from now on, for the reason given (shown in ``stats()`` and logged once)."""
        self.disabled_reason = reason

    def lockstep(self, groups: dict[str, tuple[int, ...]] | None = None) -> Lockstep | None:
        """The agreements among ranks this function's recordings need, or None when it calls no
        collective; ``groups``: the process groups a warm-up saw it use (name -> global ranks)."""
        if groups and not groups.keys() <= self._groups.keys():
            self._groups.update(groups)
            self._lockstep = for_groups(self.name, self._groups, float(self.options.lockstep_timeout))
            release_before_teardown(drop_all)  # its captures would hang destroy_process_group (teardown.py)
        return self._lockstep

    def training_step(self) -> TrainingStep | None:
        """The modules and optimizers the function reaches outside its arguments (None: none, or a forward)."""
        return self._step

    def module(self) -> torch.nn.Module | None:
        """The module whose parameters and buffers the function reads in place, if any."""
        return self._module

    def static_tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers of the module (and closure tensors) the graph reads in place (``Reach``)."""
        return self._reach.static_tensors()

    def warm_up(self, *example_args: Any, sizes: Sequence[int] | None = None, **example_kwargs: Any) -> None:
        """Warm up and record one graph per bucket size, largest first (``sizes``: some of them), so
        that the smaller ones reuse its memory; each in a step of its own: call it before your loop.

        Example::

            step = graphtree.graphed(model, buckets=[1, 2, 4, 8, 16])
            step.warm_up(example_batch)
        """
        record_buckets(self, example_args, example_kwargs, sizes)


def _take_snapshot(gc: GraphedCallable, snapshots: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """debug=: the call's inputs as they are, for a dump should the call fail."""
    try:
        snapshots.take(args, kwargs)
    except RuntimeError as e:  # the first CUDA call of this call: a fault of earlier work surfaces here
        err = _manager.explain_fault_before_replay(e, gc.name, str(gc.options.debug))
        if err is e:
            raise
        raise err from e


def _in_parts(gc: GraphedCallable, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> Any:
    """Run ``gc``'s call eagerly, counting ``reason``, with its module's parts graphed where it has them."""
    parts = gc._parts
    if parts is None:
        return gc._eager(args, kwargs, reason)
    count_eager(gc.name, reason)
    with _manager.one_step() as since:  # a part called twice keeps its first output for the module's code
        out = parts.run(gc.fn, args, kwargs)
        # what the module returns is the caller's, as from an eager run: never a part's output,
        # which the part's next replay would overwrite (copied once, by the outermost module)
        return own_copies(out, since) if since is not None else out


def _after_call(gc: GraphedCallable, held: Any) -> None:
    """After a call ran: a module attribute it changed is its state, not a setting (reach.py), in
    the modules its code reaches and in those passed in (``held``: ``ModuleArguments.part``)."""
    if gc.free.follows_modules:
        gc.free.after_call()
    if held is not None:
        gc._module_args.after_call(held)


def _eager_now(gc: GraphedCallable, args: tuple[Any, ...]) -> bool:
    """Whether the churning callable ``gc``'s call ``gc(*args)`` runs eagerly now, without the
    Python path (tree/churn.py): CUDA tensors alone, never met, in a call that would reach its tree
    (no grad to build, no collectives, no module state to follow). Orders the current stream after
    the tree's last call first, as the tree does; the caller then runs it and counts it."""
    native = _native.loaded
    sig = native.signature(args, PLAIN_TYPES) if native is not None else _fast_hit.tensor_signature(args)
    if sig is None:
        return False
    parts, device, needs_grad = sig
    if not plain_tensor_parts(parts):  # a number, a host scalar, a lazy view: the Python path
        return False
    if gc.takes_python_path(needs_grad) or gc.free.follows_modules or gc.lockstep() is not None:
        return False
    if not gc.churn.new_tensors((parts, device)):
        return False
    tree = _manager.tree_for(device)
    with tree.lock:
        tree.order.follow()
    return True


def _builds_autograd(gc: GraphedCallable, needs_grad: bool) -> bool:
    """Whether a call of ``gc`` whose inputs require grad (``needs_grad``) builds an autograd graph."""
    return (
        torch.is_grad_enabled()
        and not gc._grad_off_inside
        and (needs_grad or (gc._forward and any(t.requires_grad for t in gc.static_tensors())))
    )


def _key_state(
    call: Call, module: torch.nn.Module | None, reads: tuple[Any, ...] | None, step: TrainingStep | None
) -> None:
    """Add to ``call``'s key what it computes under besides its arguments: the ambient state
    (autocast, grad mode, default dtype, TF32, cuDNN and SDPA switches: ambient.py), a module's
    train() or eval() (dropout, batch norm), the plain values the code reads (``reads``: reach.py)
    and, for a training step, its gradients' presence and its optimizers' settings."""
    if module is not None:
        call.key = (*call.key, _state(), ("training", module.training))
    else:
        call.key = (*call.key, _state())
    if reads is not None:
        call.key = (*call.key, reads)
    if step is not None and step.trains:
        call.key = (*call.key, step.key(call.leaves))


def _module_helpers(
    gc: GraphedCallable, fn: Callable[..., Any], runs: Callable[..., Any] | None, parts: bool
) -> tuple[CacheLayouts | None, CompiledTwins | None, Parts | None]:
    """What ``gc``, graphing ``fn``, needs for the module it reaches, where ``fn`` is that module or
    its method: a transformers model's cache layouts and compiled twins (not for a part graphtree
    chose, nor for a twin itself, ``runs``), and its parts (``parts``)."""
    module = gc.module()
    if module is None:
        return None, None, None
    watch_parameter_changes()
    if not (fn is module or getattr(fn, "__self__", None) is module):
        return None, None, None
    caches = twins = made = None
    if not gc.min_ops and _no_auto_compile(module):
        caches = CacheLayouts(module)
        if runs is None:  # generate()'s compiled decode step, graphed too (tree/hf_compile.py)
            twin = functools.partial(
                type(gc), fn, name=f"{gc.name} (compiled)", warmup=gc.warmup, parts=False, debug=gc.options.debug
            )
            twins = CompiledTwins(fn, lambda compiled: twin(runs=compiled))
            install_compiled_twins(module)
    if parts:
        # (the options, not a bound method: no cycle to keep a dropped callable alive)
        make = functools.partial(
            GraphedPart,
            warmup=gc.warmup,
            max_rerecords=gc.options.max_rerecords,
            max_break_values=gc.options.max_break_values,
            lockstep_timeout=gc.options.lockstep_timeout,
            min_ops=MIN_PART_OPS,
        )
        made = Parts(module, gc.name, make)
    return caches, twins, made


def _call_outside_compile(gc: GraphedCallable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A graphed call met by torch.compile's tracer: dynamo never traces into graphtree (its checks
    and private calls are not traceable); the compiled code breaks its graph here and graphtree
    replays, records or runs eagerly as it would outside."""
    return gc(*args, **kwargs)


_outside_compile: Callable[[GraphedCallable, tuple[Any, ...], dict[str, Any]], Any] = _call_outside_compile
""":func:`_call_outside_compile`, wrapped by ``torch.compiler.disable`` once ``torch._dynamo`` is
imported (:func:`_wrap_for_compile`)."""


def _wrap_for_compile() -> None:
    global _outside_compile
    _outside_compile = torch.compiler.disable(_call_outside_compile)


# The compile break is ready before torch.compile can trace a graphed call: at once if
# torch._dynamo is loaded, else the moment the program imports it. The wrapper imports
# torch._dynamo (1.1 s on the H100 host), which a program that never compiles must not pay.
call_after_import("torch._dynamo", _wrap_for_compile)


class GraphedPart(GraphedCallable):
    """A submodule graphtree graphed in a module's place (tree/parts.py). Its own hooks run around
    it (``nn.Module.__call__``); on a call where a module below it holds a hook, or a global module
    hook is registered (since it was made: ``FlopCounterMode``), it runs eagerly (tree/hooks.py)."""

    hooks_around = True  # (its forward is set on the submodule: __call__ runs the submodule's hooks)


def _graphed_again(
    cls: type[GraphedCallable], fn: Callable[..., Any], options: dict[str, Any]
) -> GraphedCallable | _BuiltAtFirstUse:
    """What a copy of a graphed callable is rebuilt with (see ``GraphedCallable.__reduce__``). A
    model's own ``forward``, graphed and copied with the model (``copy.deepcopy(model)``, pickle), is
    rebuilt before the model's copy is whole: it is built at its first use."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and "_modules" not in owner.__dict__:
        return _BuiltAtFirstUse(cls, fn, options)
    return cls(fn, **options)


class _BuiltAtFirstUse:
    """A graphed callable whose module was not yet whole when it was rebuilt (a model copied with
    its graphed ``forward``: the copy's ``__dict__`` is filled after its values are copied); the
    graphed callable is built at its first call or attribute read, when the model is whole."""

    def __init__(self, cls: type[GraphedCallable], fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self._args = (cls, fn, options)
        self._built: GraphedCallable | None = None

    def _real(self) -> GraphedCallable:
        if self._built is None:
            cls, fn, options = self._args
            self._built = cls(fn, **options)
        return self._built

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # (its name, __wrapped__ for inspect.signature, stats...)
        if name in ("_args", "_built") or (name.startswith("__") and name != "__wrapped__"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_graphed_again, self._args)


def _no_auto_compile(model: torch.nn.Module) -> bool:
    """Turn off Hugging Face's automatic ``torch.compile`` of a model's decode step: graphtree graphs it.

    transformers' ``generate()`` compiles the decode step with ``mode="reduce-overhead"`` whenever the
    cache is a static one, unless ``generation_config.disable_compile`` is set; two graph systems on one
    forward fought (stale-tensor errors, an internal assert, 12x slower). Set only where the model's
    generation config leaves it unset (``None``): an explicit ``False`` is the user's and is kept, and
    the compiled code then calls graphtree outside its trace (see :func:`_outside_compile`).
    Returns whether ``model`` is such a model.
    """
    config = getattr(model, "generation_config", None)
    if config is None or not hasattr(model, "_valid_auto_compile_criteria"):
        return False
    if getattr(config, "disable_compile", None) is None:
        config.disable_compile = True
        log.info(
            "graphtree: %s.generation_config.disable_compile = True: generate() will not torch.compile the "
            "decode step that graphtree graphs (pass disable_compile=False to generate() to compile anyway)",
            type(model).__name__,
        )
    return True


def graphed(
    fn: Callable[..., Any] | None = None,
    *,
    buckets: Sequence[int] | None = None,
    bucket_dim: int = 0,
    warmup: int = 1,
    max_rerecords: int = 8,
    name: str | None = None,
    debug: str | os.PathLike[str] | None = None,
    max_break_values: int = MAX_VALUES,
    lockstep_timeout: float = LOCKSTEP_TIMEOUT,
    parts: bool = True,
) -> Any:
    """Record ``fn`` as CUDA graphs on first use and replay them afterwards.

    Works on functions, ``nn.Module`` s (returning a :class:`GraphedModule`, itself an
    ``nn.Module`` sharing the original's parameters), bound methods and methods (as a decorator
    in a class body: each instance gets recordings of its own), as a call or a decorator. Results
    equal eager execution. Tensor inputs are copied into the graph's placeholders, except
    parameters, buffers, tensors marked with :func:`mark_static` and outputs of earlier calls
    still held, which are read in place. One recording per input signature (shapes, dtypes,
    strides, devices and plain Python values).

    Args:
        fn: the callable. It must not mutate copied inputs. A host read of a scalar or of a
            small tensor (``.item()``, ``bool(t)``, ``if t:``, ``.tolist()`` of up to 256
            elements) splits its recording in two at that point, the value read choosing what is
            replayed after it (see ``max_break_values``); other host
            synchronisations (larger copies, printing tensors, data-dependent shapes) make it run
            eagerly, and ``stats()`` says why.
        buckets: pad dimension ``bucket_dim`` of the inputs up to the next of these sizes and
            cut the outputs back, so that many batch sizes share a few recordings. Rows of that
            dimension must be independent.
        bucket_dim: the dimension ``buckets`` pad (a non-negative int).
        warmup: eager runs (inside the tree's memory pool) before recording a new signature.
        max_rerecords: new recordings of one call site, after its first, before the function
            runs eagerly for good (in-place inputs or parameters that keep moving).
        name: a name for logs, ``stats()`` and error messages (default: the function's).
        max_break_values: breakable recordings (``graphtree.tree.breaks``): distinct values one
            host read may give (each gets recordings of its own for what follows it) before the
            signature runs eagerly (default 8, ``graphtree.tree.options.MAX_VALUES``); 0 runs a
            call that reads a value on the host eagerly, as before breaks.
        lockstep_timeout: for a function that calls ``torch.distributed`` collectives, seconds a
            rank waits for the other ranks of their groups to agree to record it or to run it
            eagerly (``graphtree.tree.lockstep``; default 600, torch.distributed's own default),
            after which it raises ``LockstepTimeout`` naming the ranks that did not come.
        parts: for a module (or its bound ``forward``): a signature that cannot be graphed whole
            (its own code uploads host values, has data-dependent shapes, ...) runs eagerly with
            each of its submodules graphed in their place, down the tree of modules, those of
            fewer than 16 operators left alone (``graphtree.tree.parts``; ``GraphedCallable.parts()``
            names them). False runs such a signature wholly eagerly.
        debug: a folder: a call that raises writes a dump of itself there (its inputs, the
            function by import path or by value, a model with its weights, random states,
            versions, traceback; see :func:`graphtree.debug.dump_on_error`) before the error
            reaches the caller, with a note naming it; ``graphtree debug rerun DUMP`` runs it
            again eagerly. The inputs are copied to pinned host memory before every call (a
            ``cudaMemcpyAsync`` per tensor), and a model's weights once, at its first call, so
            that a CUDA error that leaves the GPU unreadable still gets its dump, and the call
            before it too (a fault inside a graph is reported one call late).

    Raises ``TypeError`` for a ``fn`` that is not callable and ``ValueError`` for an option
    out of range, naming the option, the value and what is allowed.

    Objects among the arguments (a module, ``self`` of a method, a cache, a dataclass) are read:
    their tensors are used in place and their plain attributes are part of the signature.

    Constraints: a graph reads tensors it was not given (globals, closures, attributes that are
    not parameters or buffers) at the address they had when it was recorded. graphtree finds
    them while recording and records again when one is freed or moves; such a tensor is keyed by
    its identity, so rebinding it to a new tensor while the old one stays alive (``W = W * 2``)
    makes the next call a new signature, recorded anew: update it in place (``W.copy_(new)``), or
    pass it as an argument, to keep one recording. Under autograd (grad mode on and an input or
    parameter requiring grad) a graphed module, or a function that reaches no module, records its
    forward and its backward (:mod:`graphtree.tree.module_training`, which lists what runs
    eagerly); a whole training step (forward, ``backward()``, optimizer step, returning
    ``loss.detach()``) is recorded whole; another function runs eagerly, with the reason. A
    function that turns grad off itself (``@torch.no_grad()``, ``@torch.inference_mode()``) is
    recorded as any other call.

    A graphed callable or module can be copied (``copy.deepcopy``, pickle, ``torch.save``): the
    copy is graphed anew with the same options, over a copy of the module, and records its own.

    Example::

        @graphtree.graphed
        def step(x, w):
            return torch.relu(x @ w)

        model = graphtree.graphed(model, buckets=[1, 2, 4, 8])
    """

    def make(f: Callable[..., Any]) -> Any:
        call = GraphedCallable(
            f,
            buckets=buckets,
            bucket_dim=bucket_dim,
            warmup=warmup,
            max_rerecords=max_rerecords,
            name=name,
            debug=debug,
            max_break_values=max_break_values,
            lockstep_timeout=lockstep_timeout,
            parts=parts,
        )
        return GraphedModule(f, call) if isinstance(f, torch.nn.Module) else call

    if fn is None:  # as a decorator with options: @graphed(buckets=[...]): checked now
        Options(buckets, bucket_dim, warmup, max_rerecords, name, debug, max_break_values, lockstep_timeout, parts)
        return make
    return make(fn)
