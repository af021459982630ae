"""Lock-step recording for functions that call collectives: every rank of their process groups warms
up, records and falls back at the same calls.

A graph that holds an NCCL collective is a collective when it replays, and capturing one can be
collective too (NCCL registers the graph's buffers with its peers). A rank that records while
another runs eagerly, or that falls back while another replays, would leave the other waiting for
an operation that never comes, or, with NCCL's buffer registration, hang the capture. So the
decisions a tree makes alone for other functions are agreed for these: at a call no recording
replays (warm up, record, or give up at the re-record limit), after each warm-up (graph this
signature, warm up again, or give it up) and after a capture (did it succeed). Each rank writes
its vote in the job's store (``init_process_group``'s); each then reads every vote of the group,
and one rank's reason to fall back makes all fall back, with that reason. Replays are not agreed:
they are as many on every rank as the calls are.

A rank that does not come to an agreement within ``lockstep_timeout`` seconds (it raised, called the
function with another signature, or called something else) makes the others raise
:class:`LockstepTimeout`, naming it: never a hang. Replaying, warm-up and eager runs each run a
collective exactly once, so ranks in different modes still meet as NCCL expects (with
``NCCL_GRAPH_MIXING_SUPPORT``, on by default).

Example::

    watch = CollectiveWatch()
    with watch:
        fn(x)                       # notes the groups of the collectives fn calls
    reason, again = Lockstep("fn", ranks=(0, 1), rank=0, store=store, timeout=60).agree("warm-up", None)
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from graphtree import _torch

log = logging.getLogger("graphtree")

LOCKSTEP_TIMEOUT = 600.0
"""Seconds a rank waits for the others to agree by default: torch.distributed's default timeout."""

_NAMESPACES = ("c10d", "_c10d_functional")
_GROUP_ARGUMENTS = ("process_group", "group_name")


class LockstepTimeout(RuntimeError):
    """Ranks of a collective function's groups did not all come to an agreement within the timeout."""


class LockstepMismatch(RuntimeError):
    """Ranks came to the same agreement for different functions or steps: their calls differ."""


class UnagreedCollective(RuntimeError):
    """A capture met a collective on a group its ranks had not agreed to record (raised before it runs)."""


class CollectiveWatch(_torch.EagerDispatchMode):
    """In a warm-up: the process groups (name and global ranks) of the collectives the function calls.

    In a capture (``known``: the groups agreed on, empty for a function no warm-up saw call one): a
    collective on any other group raises :class:`UnagreedCollective` before it runs, since its ranks
    did not agree to capture it (a first call recorded with ``warmup=0``, a branch no warm-up took).
    """

    def __init__(self, known: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__()
        self.groups: dict[str, tuple[int, ...]] = {}
        self.ops: list[str] = []
        self.known = known

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES:
            for i, arg in enumerate(func._schema.arguments):
                if arg.name in _GROUP_ARGUMENTS:
                    found = _group_of(args[i] if i < len(args) else kwargs.get(arg.name))
                    if found is not None:
                        if self.known is not None and found[0] not in self.known:
                            raise UnagreedCollective(
                                f"it calls {func} on process group {found[0]} (ranks {list(found[1])}), which no "
                                f"warm-up saw: the ranks must agree before such a capture (warm it up first: "
                                f"graphed(..., warmup=1), the default)"
                            )
                        self.groups[found[0]] = found[1]
                        if str(func) not in self.ops:
                            self.ops.append(str(func))
        return self.run(func, args, kwargs)


def _group_of(arg: Any) -> tuple[str, tuple[int, ...]] | None:
    """The name and global ranks of the process group a collective's argument names, or None: a
    ``c10d`` operation (``dist.all_reduce`` and friends) gives the dispatcher its group as a
    ``ScriptObject``, a functional one (``torch.distributed._functional_collectives``) its name."""
    import torch.distributed as dist

    group: Any = None
    if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
        group = dist.ProcessGroup.unbox(arg)
    elif isinstance(arg, str):
        group = _torch.resolve_process_group(arg)
    elif isinstance(arg, dist.ProcessGroup):
        group = arg
    if group is None:
        return None
    return str(group.group_name), tuple(dist.get_process_group_ranks(group))


def watch_collectives(known: dict[str, tuple[int, ...]] | None = None) -> CollectiveWatch | None:
    """A :class:`CollectiveWatch` for a warm-up (or, with ``known``, a capture), or None where no process
    group exists (no collective can run: warm-ups and captures are spared the dispatch mode)."""
    import torch.distributed as dist

    return CollectiveWatch(known) if dist.is_available() and dist.is_initialized() else None


def environment_problem() -> str | None:
    """Why this process's environment keeps NCCL collectives out of graphs, or None."""
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").strip() not in ("", "0"):
        return (
            "TORCH_NCCL_BLOCKING_WAIT is set: every collective waits for its result on the host, "
            "which a graph cannot record (unset it)"
        )
    if os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "1").strip() == "0":
        return (
            "NCCL_GRAPH_MIXING_SUPPORT=0: graphtree runs a function's collectives eagerly (warm-ups) and "
            "from graphs on the same communicators, which NCCL then does not allow (unset it)"
        )
    return None


_counters: defaultdict[tuple[tuple[int, ...], str, int], int] = defaultdict(int)
_counters_lock = threading.Lock()


def _next_number(ranks: tuple[int, ...], rank: int) -> int:
    """The number of this thread's next agreement among ``ranks``: the same on every rank when their
    calls are the same (threads are told apart by name, as the same program names them alike; the
    rank is in the key only for tests that play several ranks in one process)."""
    with _counters_lock:
        key = (ranks, threading.current_thread().name, rank)
        _counters[key] += 1
        return _counters[key]


_FOLLOW = (
    "Every rank of {ranks} must call `{name}` with the same signatures in the same order, none may raise "
    "in it, and all must keep the same outputs of graphed functions alive: a rank that replays while "
    "another records cannot follow (graphed(..., lockstep_timeout=) sets the wait)"
)


class Lockstep:
    """The agreements of one graphed function among the ranks of its collectives' groups.

    ``store``: any ``torch.distributed.Store`` every rank reaches (the default store in a job;
    a ``HashStore`` shared by threads in tests). ``timeout``: seconds to wait for the other ranks.
    ``groups``: the process groups whose collectives the ranks agree to capture (name -> ranks).
    """

    def __init__(
        self,
        name: str,
        ranks: tuple[int, ...],
        rank: int,
        store: Any,
        timeout: float,
        groups: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not one of the group's ranks {list(ranks)}")
        self.groups = dict(groups or {})  # the process groups agreed on: name -> global ranks
        self.name = name
        self.ranks = ranks
        self.rank = rank
        self.store = store
        self.timeout = timeout
        self.seconds = 0.0  # spent in agree() (voting and waiting for the others), for benchmarks

    def agree(self, stage: str, reason: str | None, again: bool = False) -> tuple[str | None, bool]:
        """Vote at ``stage`` and read every rank's vote: ``reason``, why this rank cannot go on (or
        None); ``again``, that it must do this step once more (a warm-up that kept state). Returns
        the first reason in rank order (prefixed with its rank when it is another's) or None, and
        whether any rank asked for ``again``.

        Raises :class:`LockstepTimeout` naming the ranks that did not vote in time, and
        :class:`LockstepMismatch` when a rank voted for another function or stage.
        """
        start = time.monotonic()
        try:
            return self._agree(stage, reason, again)
        finally:
            self.seconds += time.monotonic() - start

    def _agree(self, stage: str, reason: str | None, again: bool) -> tuple[str | None, bool]:
        number = _next_number(self.ranks, self.rank)
        thread = threading.current_thread().name
        prefix = f"graphtree/lockstep/{','.join(map(str, self.ranks))}/{thread}/{number}"
        keys = [f"{prefix}/{r}" for r in self.ranks]
        mine = json.dumps({"name": self.name, "stage": stage, "reason": reason, "again": again})
        own = keys[self.ranks.index(self.rank)]
        self.store.set(own, mine)
        missing = self._wait(keys)
        if missing:
            # A rank that comes later must not take this vote as given: it finds the mark and raises too.
            self.store.compare_set(own, mine, json.dumps({"timed_out": True}))
            raise LockstepTimeout(
                f"graphtree: rank(s) {missing} did not come to agreement {number} ({stage} of `{self.name}`) "
                f"within {self.timeout:g} s. {_FOLLOW.format(ranks=list(self.ranks), name=self.name)}"
            )
        first: str | None = None
        anyone_again = False
        for r, raw in zip(self.ranks, self.store.multi_get(keys)):
            vote = json.loads(raw)
            if vote.get("timed_out"):
                raise LockstepTimeout(
                    f"graphtree: rank {r} stopped waiting for agreement {number} ({stage} of `{self.name}`) "
                    f"before rank {self.rank} came. {_FOLLOW.format(ranks=list(self.ranks), name=self.name)}"
                )
            if (vote["name"], vote["stage"]) != (self.name, stage):
                raise LockstepMismatch(
                    f"graphtree: at agreement {number} among ranks {list(self.ranks)}, rank {r} was at "
                    f"{vote['stage']} of `{vote['name']}` and rank {self.rank} at {stage} of `{self.name}`: "
                    f"the ranks' calls of graphed functions differ"
                )
            if first is None and vote["reason"] is not None:
                first = vote["reason"] if r == self.rank else f"rank {r}: {vote['reason']}"
            anyone_again = anyone_again or bool(vote["again"])
        return first, anyone_again

    def _wait(self, keys: list[str]) -> list[int]:
        """Wait until every key is in the store, or ``timeout`` seconds; the ranks still missing then.

        Polled with ``check`` (one short round trip at a time), not the store's blocking ``wait``: in a
        job the default store's client is shared with ProcessGroupNCCL's monitor thread. On two H100s
        (torch 2.11) a rank whose ``wait`` was to time out never came back, where the same agreement
        over gloo on the CPU raised in time; the blocking wait on the shared client is the suspect."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0002
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                return [r for r, k in zip(self.ranks, keys) if not self.store.check([k])]
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return []


class Vote:
    """One rank's vote at one stage of a recording, cast at most once: the capture votes that it
    succeeded, and the manager casts the reason of a capture that failed before it could."""

    def __init__(self, lockstep: Lockstep, stage: str) -> None:
        self.lockstep = lockstep
        self.stage = stage
        self.cast = False

    def __call__(self, reason: str | None) -> str | None:
        """Vote ``reason`` (None: this rank goes on); the first rank's reason to stop, or None."""
        self.cast = True
        return self.lockstep.agree(self.stage, reason)[0]


def for_groups(name: str, groups: dict[str, tuple[int, ...]], timeout: float) -> Lockstep:
    """The :class:`Lockstep` of a function whose collectives use ``groups``, on the job's default
    store: among the ranks of its one group, or of the whole world where it uses several (each rank
    of a 2-D mesh sees a different union of its row and column). Raises ``RuntimeError`` naming what
    is missing when there is no default store."""
    import torch.distributed as dist

    store = _torch.default_store()
    if store is None or not dist.is_initialized():
        raise RuntimeError(
            f"graphtree: `{name}` calls collectives, but torch.distributed has no default process group "
            "and store to agree through: call torch.distributed.init_process_group() first"
        )
    if len(groups) == 1:
        (ranks,) = groups.values()
    else:  # the union of several groups differs between ranks (a mesh's rows and columns): the world agrees
        ranks = tuple(range(dist.get_world_size()))
    return Lockstep(name, tuple(sorted(ranks)), dist.get_rank(), store, timeout, groups)


_teardown_lock = threading.Lock()
_releases: list[Callable[[], None]] = []


def release_before_teardown(release: Callable[[], None]) -> None:
    """Have ``release`` (which must free every CUDA graph that captured a collective) run before
    ``torch.distributed.destroy_process_group`` and at exit; installed once, when a warm-up first
    finds a graphed function calling collectives (``GraphedCallable.lockstep``).

    NCCL cannot destroy a communicator while a CUDA graph that captured one of its collectives
    exists: ``ncclCommDestroy`` waits for the graph to go, and the program hangs at its last line
    (pytorch/pytorch#115388; two H100s, torch 2.11). A program would have to know to drop its
    recordings first; graphtree does it for it. ``destroy_process_group`` stays torch's own
    function, wrapped: the wrapper runs ``release`` and then it, with the same arguments.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with _teardown_lock:
        if release in _releases:
            return
        _releases.append(release)
        if len(_releases) > 1:
            return
        original = c10d.destroy_process_group

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            _run_releases("destroy_process_group")
            return original(*args, **kwargs)

        destroy_process_group.__graphtree_wraps__ = original  # type: ignore[attr-defined]
        c10d.destroy_process_group = destroy_process_group
        dist.destroy_process_group = destroy_process_group
        atexit.register(_run_releases, "exit")


def _run_releases(when: str) -> None:
    for release in list(_releases):
        try:
            release()
        except Exception as e:  # noqa: BLE001 - teardown goes on: the communicator's own error says more
            log.warning("graphtree: dropping the recordings that hold collectives before %s failed: %s", when, e)
