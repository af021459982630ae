"""How a tree grows: a call no recording fits warms up, or is recorded as a child of the node the step
stands on (:mod:`graphtree.tree.manager` decides which; :mod:`graphtree.tree.recorder` runs them).

- **warm-up**: the call runs eagerly with its memory in the tree's pool; one that allocated state
  it keeps, filled a container or compiled warms up again, and one that cannot be graphed gives
  its signature up (later calls run eagerly, with the reason).
- **record**: the call is captured from the allocator state its parent left behind (restored
  first, :meth:`TreeMemory.sync`), its objects' tensors moved into memory its earlier recordings
  keep (:mod:`graphtree.tree.adoption`); a capture that fails gives the signature up, or, where
  ``torch.compile`` traced in it, warms it up again. Past the re-record limit at one place the call
  runs eagerly for good.
- Functions that call ``torch.distributed`` collectives decide with their ranks
  (:mod:`graphtree.tree.lockstep`): all warm up, record, or run eagerly alike.

Example (what :meth:`TreeManager.call <graphtree.tree.manager.TreeManager.call>` does)::

    grow = Grower(device, walk, memory, counters, warmed)
    out = grow.warm_up(gc, call) if warm else grow.record(gc, call)
"""

from __future__ import annotations

from typing import Any

from graphtree.tree import recorder
from graphtree.tree.adoption import adopt_orphans, release_oldest_orphans
from graphtree.tree.breaks import Segment
from graphtree.tree.callee import Callee
from graphtree.tree.capture import CaptureFailed
from graphtree.tree.inputs import Call
from graphtree.tree.lockstep import Vote, environment_problem
from graphtree.tree.memory import TreeMemory
from graphtree.tree.node import Node
from graphtree.tree.stats import Counters, count_eager, log
from graphtree.tree.walk import Walk


class Grower:
    """The warm-ups and recordings of one tree: ``walk`` says where, ``memory`` gives the pool and
    stream, ``counters`` count them, ``warmed`` holds the warm-ups per (callable id, signature)."""

    def __init__(
        self, device: int, walk: Walk, memory: TreeMemory, counters: Counters, warmed: dict[tuple[int, Any], int]
    ) -> None:
        self.device = device
        self.walk = walk
        self.memory = memory
        self.counters = counters
        self.warmed = warmed

    def start_together(self, gc: Callee, call: Call, warm: bool) -> Any:
        """A call of a function that calls collectives, which no recording replays: its ranks agree
        to warm up (if any would: one that warmed up another function earlier in its step does),
        to record, or to run it eagerly for good (one reached the re-record limit). The churn guard
        is off for such functions: it counts what one rank saw."""
        lockstep = gc.lockstep()
        assert lockstep is not None
        limit = None if warm else rerecord_limit(gc, len(self._alive_siblings((gc.id, call.key))))
        reason, anyone_warms = lockstep.agree("start", limit, again=warm)
        self.counters.agreements += 1
        if reason is not None:
            gc.verdicts.give_up(call.key, reason)
            return gc.run_eager(call, reason)
        return self.warm_up(gc, call) if anyone_warms else self.record(gc, call)

    def warm_up(self, gc: Callee, call: Call) -> Any:
        """Run the call eagerly in the pool, and note what it says about recording it."""
        self.walk.warming = True
        self.memory.sync(self.walk)  # (the warm-up's cuBLAS workspace comes from the pool)
        done = recorder.warm_up(gc, call, self.memory.stream, self.device, self.memory.pool)
        self.counters.warmups += 1
        gc.churn.warmed_up()
        key = (gc.id, call.key)
        verdicts = gc.verdicts
        give_up = done.give_up or verdicts.size_reason(done.ops)
        again = bool(done.kept or done.mutated) or done.compiled
        lockstep = gc.lockstep(done.groups)
        if lockstep is not None:  # it calls collectives: its ranks decide together (tree/lockstep.py)
            give_up, again = lockstep.agree("warm-up", give_up or environment_problem(), again)
            self.counters.agreements += 1
        if give_up:
            verdicts.give_up(call.key, give_up)
        elif again:  # it allocated state or filled a container (a cache, on first use), or compiled: again
            if verdicts.note_kept_state(call.key):
                verdicts.give_up(call.key, done.again_reason(gc.name, gc.free.kept_hint))
        else:
            self.warmed[key] = self.warmed.get(key, 0) + 1
        return done.out

    def record_value(self, gc: Callee, call: Call, read: list[tuple[Segment, Any]]) -> Any:
        """The last value of ``read`` has no segment after it: record the call on from there, or,
        past the limit of values at that read, run it eagerly for good."""
        seg, _value = read[-1]
        if len(seg.next) >= gc.options.max_break_values:
            assert seg.read is not None
            reason = (
                f"`{gc.name}` read more than {gc.options.max_break_values} different values at {seg.read.where}: "
                f"each needs recordings of its own (raise graphed(..., max_break_values=) if they are few)"
            )
            gc.verdicts.give_up(call.key, reason)  # later calls run eagerly from the start
            if not any(s.changes_state for s, _ in read):
                return gc.run_eager(call, reason)
            # The segments just replayed wrote state the call did not make (an input or a cache in
            # place, an eager part): running the call again eagerly would do that twice. This one
            # call is finished by recording its value, as below; it is the last.
        self.counters.values += 1
        return self.record(gc, call, prefix=read)

    def record(self, gc: Callee, call: Call, prefix: list[tuple[Segment, Any]] | None = None) -> Any:
        """Record the call as a child of the current node (or, with ``prefix``, after the segments
        of a broken recording just replayed), and return its outputs."""
        walk = self.walk
        self.memory.sync(walk)
        key = (gc.id, call.key)
        siblings = [] if prefix else self._alive_siblings(key)  # a new value's recording is no re-recording
        reason = None if prefix else rerecord_limit(gc, len(siblings))
        if reason is not None:  # (for a function that calls collectives, agreed in start_together)
            gc.verdicts.give_up(call.key, reason)
            return gc.run_eager(call, reason)
        lockstep = gc.lockstep()  # every rank keeps its capture, or none does (tree/lockstep.py)
        captured = Vote(lockstep, "capture") if lockstep is not None else None
        if not prefix:  # object tensors into memory the callable's other recordings keep (tree/adoption.py)
            others = [
                n.adoption
                for n in sorted(walk.nodes(), key=_age)
                if n.key[0] == gc.id and n.key != key and n.adoption is not None
            ]
            if others:  # (released first: a storage adopted below is held by this call's object)
                release_oldest_orphans(others)  # a cache's worth each: the newest few stay
                adopt_orphans(call.leaves, call.n_args, others)
        try:
            node, out = recorder.record(
                gc,
                call,
                parent=walk.current,
                path=walk.path,
                pool=self.memory.pool,
                stream=self.memory.stream,
                device=self.device,
                prefix=prefix,
                captured=captured,
            )
        except CaptureFailed as e:
            return self._failed(gc, call, e, captured, prefix)
        except BaseException:
            # The function's own error (or an out-of-memory, Ctrl-C, an error of graphtree's): it
            # reaches the caller unchanged. Its traceback may keep tensors the capture allocated in
            # the pool alive, which no checkpoint knows: recordings go on in a fresh pool.
            self.memory.retire(walk, quiet=True)
            raise
        gc.churn.recorded()
        if captured is not None:
            self.counters.agreements += 1
        if siblings:
            self.counters.rerecordings += 1
        if not prefix:  # (a new value's recording is found through the first segment it shares)
            walk.current.children.setdefault(key, []).append(node)
        walk.enter(node)
        self.counters.recordings += 1
        return out

    def _failed(
        self,
        gc: Callee,
        call: Call,
        e: CaptureFailed,
        captured: Vote | None,
        prefix: list[tuple[Segment, Any]] | None,
    ) -> Any:
        """A capture failed: the call's result, from the capture where it ran whole, or from an eager
        run; its signature given up, or warmed up again where ``torch.compile`` traced in it."""
        if captured is not None:
            if not captured.cast:  # the other ranks learn that this one failed
                captured(str(e))
            self.counters.agreements += 1
        elif e.again and gc.verdicts.may_record_again(call.key):  # (compiled in the capture: warm it up again)
            self.warmed.pop((gc.id, call.key), None)
            return gc.run_eager(call, str(e))
        gc.verdicts.give_up(call.key, str(e))
        if e.pool_tainted:
            self.memory.retire(self.walk)
        if e.has_result:  # the capture ran the call whole: running it again would repeat its side effects
            count_eager(gc.name, str(e))
            return e.result
        if prefix and any(seg.changes_state for seg, _ in prefix):
            log.warning(
                "graphtree: `%s`: recording a new value failed after the replay of the part before "
                "the read had written state in place; the eager run now writes it again (%s)",
                gc.name,
                e,
            )
        return gc.run_eager(call, str(e))

    def _alive_siblings(self, key: Any) -> list[Node]:
        """The live recordings of ``key`` under the current node (:meth:`Walk.alive_siblings`), the
        dead ones dropped and counted as replaced."""
        alive, dead = self.walk.alive_siblings(key)
        self.counters.replaced += dead
        return alive


def rerecord_limit(gc: Callee, n: int) -> str | None:
    """The reason not to record a call again where ``n`` live recordings of it are, or None."""
    if n <= gc.options.max_rerecords:
        return None
    return (
        f"re-record limit reached: recorded {n} times at the same place "
        f"(in-place inputs or parameters keep moving, or held outputs keep changing)"
    )


def _age(node: Node) -> int:
    """The order in which recordings were made (their ids count up: "n1", "n2", ...)."""
    return int(node.id[1:])
