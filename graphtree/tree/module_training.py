"""A graphed module called with grad enabled: its forward and backward replayed (issue 28, item 1).

``graphed(model)`` called where autograd records (grad mode on, and a parameter or an input that
requires grad) runs here, not in the tree; so does a graphed function (no module, no optimizer
within reach) given an argument that requires grad. Per signature, the first ``warmup`` calls run eagerly,
then a :class:`~graphtree.tree.training.TrainingRecording` is captured (two graphs in a pool of its
own) and every later call is an autograd ``Function`` whose forward replays the first graph and
whose backward, when ``loss.backward()`` reaches it, replays the second. Gradients reach ``.grad``
through autograd's own accumulation, as eager's do (micro-batches summed, ``zero_grad`` either way);
the optimizer is the caller's.

A call that cannot be graphed so runs eagerly, with the reason in ``graphtree.stats().eager``:
keyword or non-tensor arguments, hooks on the module or below it (or global ones), a tensor that
requires grad read besides the arguments and the module's parameters (a global), more than
``max_signatures`` signatures, a capture that failed, and a call made while the last one's
backward may still come (its autograd graph alive and no backward run: two forwards, then one
backward through both: the graph holds one call's activations).

Example::

    model = graphtree.graphed(net)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()   # forward and backward replayed from the 2nd call
        opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from graphtree.tree.stats import count_untreed
from graphtree.tree.training import TrainingRecording, WarmUpFailed, apply

NOT_TENSORS = (
    "autograd: `{name}` is called with grad enabled and arguments that are not all CUDA tensors given "
    "by position; a module's training calls are graphed for those only (graph a whole training step "
    "instead: README, Training steps)"
)

NOT_HELD = (
    "autograd: `{name}` is called with grad enabled on a tensor that requires grad; graphtree records a "
    "forward and its backward for a graphed module or a function that reaches no module, without "
    "buckets=: graph the module itself, or the whole training step returning loss.detach() (README, "
    "Training steps)"
)

PENDING = (
    "autograd: `{name}` is called again while the backward of its last call may still come (its autograd "
    "graph is alive and no backward ran): the graph holds one call's activations, so this call runs eagerly"
)


class ModuleCalls:
    """The calls of one graphed module made under autograd (see the module's docstring).

    ``key`` (what :meth:`__call__` is given) is the call's recording key with the ambient state;
    the module's ``training`` flag, which inputs require grad and the calling thread are added here. Warm-ups,
    recordings and replays are counted in :func:`graphtree.stats`.

    Example::

        calls = ModuleCalls(model, "model", warmup=1)
        out = calls(model, args, kwargs, key, eager)
    """

    def __init__(self, module: torch.nn.Module | None, name: str, warmup: int = 1, max_signatures: int = 8) -> None:
        self.module = module  # None: a function, whose tensors that require grad must all be arguments
        self.name = name
        self.warmup = max(1, warmup)
        self.max_signatures = max_signatures
        self.recordings: dict[Any, TrainingRecording] = {}
        self.given_up: dict[Any, str] = {}
        self._seen: dict[Any, int] = {}

    def reason(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why this call runs eagerly whatever its signature, or None."""
        if kwargs or not args or not all(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return NOT_TENSORS.format(name=self.name)
        return None

    def __call__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: Any,
        eager: Callable[[tuple[Any, ...], dict[str, Any], str], Any],
    ) -> Any:
        """Run one call: eagerly (``eager(args, kwargs, reason)`` counts the reason), as a warm-up,
        or through its recording."""
        reason = self.reason(args, kwargs)
        if reason is not None:
            return eager(args, kwargs, reason)
        # (each thread its own recordings, as each has its own trees: two threads never share a graph's buffers)
        training = self.module.training if self.module is not None else None
        key = (key, training, tuple(a.requires_grad for a in args), threading.get_ident())
        rec = self.recordings.get(key)
        if rec is not None and rec.params_moved():  # a parameter replaced (.to(), load_state_dict(assign=True))
            del self.recordings[key]
            self._seen[key] = 0
            rec = None
        if rec is None:
            reason = self.given_up.get(key)
            if reason is not None:
                return eager(args, kwargs, reason)
            n = self._seen[key] = self._seen.get(key, 0) + 1
            if n <= self.warmup:  # a real call: the module's state changes as eager's
                count_untreed("warmups")
                return fn(*args)
            rec, reason = self._record(fn, args, key)
            if rec is None:
                self.given_up[key] = reason
                return eager(args, kwargs, reason)
            self.recordings[key] = rec
            count_untreed("recordings")
        if rec.backward_may_come():
            return eager(args, kwargs, PENDING.format(name=self.name))
        outs = apply(rec, args)
        count_untreed("replays")
        return rec.returned(outs)

    def _record(self, fn: Callable[..., Any], args: tuple[Any, ...], key: Any) -> tuple[TrainingRecording | None, str]:
        """A recording of this signature, or None and why not. An exception the module raises in
        the recording's warm-up reaches the caller (the next call tries again)."""
        if len(self.recordings) >= self.max_signatures:
            return None, f"autograd: `{self.name}` met more than {self.max_signatures} signatures under autograd"
        try:
            rec = TrainingRecording.capture(fn, args, [], name=self.name, warmup=1, module=self.module)
            return rec, ""
        except WarmUpFailed as e:
            self._seen[key] = 0  # (this signature warms up again)
            raise e.__cause__ from None  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - the module cannot be captured: eager, with why
            return None, f"autograd: `{self.name}` could not be recorded for training: {type(e).__name__}: {e}"[:500]
