"""What a graphed callable reads besides its arguments: the module it belongs to, and the tensors its
closure holds, which its graphs read in place.

A closure's cell can be rebound between calls (``w = new_w`` in the enclosing function): the graphs
recorded with the old tensor would read it, or its freed memory, where eager reads the new one.
:meth:`Reach.follow` reads the cells at each call (a few attribute reads) and, when one holds another
tensor, says so (``inputs.statics_replaced``): every recording checks the state it reads in place
before its next replay, and those made with the old tensor no longer fit.

Example::

    reach = Reach(fn)
    reach.module, reach.tensors     # the module in its closure (or that it is), its closure's tensors
    reach.follow()                  # at each call: a cell rebound is seen
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from graphtree.tree.inputs import statics_replaced


class Reach:
    """The module ``fn`` is, is a method of, or finds in its closure, and its closure's tensors."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.module: torch.nn.Module | None = None
        cells = []
        if isinstance(fn, torch.nn.Module):
            self.module = fn
        elif inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module):
            self.module = fn.__self__
        else:
            for cell, v in _contents(getattr(fn, "__closure__", None) or ()):
                if isinstance(v, torch.Tensor):
                    cells.append(cell)
                elif isinstance(v, torch.nn.Module) and self.module is None:
                    self.module = v
        self.cells = tuple(cells)
        """The closure's cells that held a tensor when ``fn`` was graphed."""
        self.tensors = _cell_tensors(self.cells)
        """The tensors they hold, as of the last :meth:`follow`."""

    def follow(self) -> None:
        """Read the cells again; if one holds another tensor (or none), the state graphs read in
        place was replaced (``inputs.statics_replaced``)."""
        now = _cell_tensors(self.cells)
        if len(now) != len(self.tensors) or any(a is not b for a, b in zip(now, self.tensors)):
            self.tensors = now
            statics_replaced()


def _cell_tensors(cells: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors ``cells`` hold now (a cell emptied or rebound to something else holds none)."""
    return [v for _, v in _contents(cells) if isinstance(v, torch.Tensor)]


def _contents(cells: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """Each cell that holds a value, with it (an empty cell, ``del``-ed in its scope, holds none)."""
    for cell in cells:
        try:
            yield cell, cell.cell_contents
        except ValueError:
            continue
