"""Diagnostics for graphtree: :func:`doctor` says whether CUDA graphs can run here and why not;
:func:`dump_on_error` keeps a durable dump of a call that failed, which :func:`load_dump` reads;
:class:`GraphReplayError` is what a CUDA error surfacing at a graph replay is raised as.

Example::

    from graphtree.debug import doctor
    print(doctor().render())
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

from graphtree import _events
from graphtree.debug import late
from graphtree.debug.doctor import DoctorReport, doctor
from graphtree.debug.dump import (
    DEFAULT_LIMIT_BYTES,
    Dump,
    DumpTooLarge,
    dump_failure,
    dump_on_error,
    late_dumps,
    load_dump,
    write_dump,
)
from graphtree.debug.snapshot import InputSnapshots
from graphtree.tree.replay_error import GraphReplayError

__all__ = [
    "DoctorReport",
    "Dump",
    "DumpTooLarge",
    "GraphReplayError",
    "doctor",
    "dump_on_error",
    "load_dump",
    "write_dump",
]


def _snapshots_for(fn: Callable[..., Any], folder: str | os.PathLike[str], name: str) -> InputSnapshots:
    """The input snapshots of a function graphed with ``debug=folder``, dumped there should a CUDA
    fault surface outside its calls too (:mod:`graphtree.debug.late`)."""
    snapshots = InputSnapshots(DEFAULT_LIMIT_BYTES, of=fn)
    late.watch(snapshots, late_dumps(folder, fn, name, DEFAULT_LIMIT_BYTES))
    return snapshots


# What graphed(fn, debug=dir) calls: the tree reaches this tool through graphtree._events only.
_events.provide("debug", types.SimpleNamespace(snapshots=_snapshots_for, dump_failure=dump_failure))
