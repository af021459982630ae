"""Diagnostics for graphtree: :func:`doctor` says whether CUDA graphs can run here and why not;
:func:`dump_on_error` keeps a durable dump of a call that failed, which :func:`load_dump` reads;
:class:`GraphReplayError` is what a CUDA error surfacing at a graph replay is raised as.

Example::

    from graphtree.debug import doctor
    print(doctor().render())
"""

import types

from graphtree import _events
from graphtree.debug.doctor import DoctorReport, doctor
from graphtree.debug.dump import (
    Dump,
    DumpTooLarge,
    dump_failure,
    dump_on_error,
    load_dump,
    watched_snapshots,
    write_dump,
)
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

# What graphed(fn, debug=dir) calls: the tree reaches this tool through graphtree._events only.
_events.provide("debug", types.SimpleNamespace(snapshots=watched_snapshots, dump_failure=dump_failure))
