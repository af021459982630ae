"""Reading CUPTI's activity records into compact numpy columns, without a Python object per record.

:class:`_FastParser` reads buffers cupti-python hands over (its record objects give the
addresses); :class:`_RawParser` reads raw libcupti buffers (``_rawbuf.py``) by walking the
records' kinds. Both check the layout against cupti-python's own record classes and raise
:class:`_LayoutMismatch` when it differs, so that the session falls back to reading record by
record. How and why: ``DESIGN.md`` beside this file ("Records: buffers, memory, losses").
"""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar, TypeVar

from graphtree.profile._model import KERNEL, MEMCPY, MEMSET, ProfileOptions

_P = TypeVar("_P", bound="_FastParser")  # create() on a subclass makes that subclass


def _pin(objs: list[Any]) -> None:
    """Never free these cupti-python record objects, not even at interpreter exit.

    Objects made with ``from_ptr`` on a buffer graphtree owns look that buffer up in
    cupti-python's own buffer manager when they are destroyed, which prints errors (a KeyError;
    at exit, an ImportError). They are few (the layout check of the process's first buffer, and
    the rare record-by-record fallback), so they are leaked on purpose.
    """
    for o in objs:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


def _memcpy_names(cupti: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    kinds = getattr(cupti, "ActivityMemcpyKind", None)
    if kinds is not None:
        for n, v in kinds.__members__.items():
            if n == "FORCE_INT":
                continue
            pretty = n if n == "UNKNOWN" else n[0] + "to" + n[3:] if len(n) == 4 and n[1:3] == "TO" else n
            names[int(v)] = f"Memcpy {pretty}"
    return names


class _LayoutMismatch(Exception):
    """Raw bytes and cupti-python's objects disagree: do not trust the raw layout."""


class _FastParser:
    """Reads a completed buffer's records straight from memory with numpy.

    cupti-python hands over one Python object per record; each object's ``ptr`` is the record's
    address inside the CUPTI buffer, and ``cupti.activity_kernel10_dtype`` (and the memcpy /
    memset dtypes) describe the C layout. So the whole buffer is copied in one call and its fields
    are read as arrays: per-record Python work is two attribute reads instead of a dozen plus the
    aggregation. Every buffer is checked: the first and last record of each kind must read the
    same as the objects' attributes, else :class:`_LayoutMismatch` and the session falls back to
    the per-record path for good.
    """

    _FIELDS = ("start", "end", "device_id", "stream_id", "correlation_id", "graph_id", "graph_node_id")
    _EXTRA: ClassVar[dict[int, tuple[str, ...]]] = {
        KERNEL: ("name",),
        MEMCPY: ("copy_kind", "bytes"),
        MEMSET: ("bytes",),
    }

    def __init__(
        self, np: Any, groups: dict[int, tuple[int, Any]], span_limit: int, memcpy_names: dict[int, str]
    ) -> None:
        self.np = np
        self.groups = groups  # activity kind value -> (our KERNEL/MEMCPY/MEMSET, dtype)
        self.span_limit = span_limit
        self.memcpy_names = memcpy_names
        self.names: dict[int, str] = {}
        self.compact: dict[int, Any] = {}  # our KERNEL/MEMCPY/MEMSET -> dtype of the stashed columns

    @classmethod
    def create(cls: type[_P], cupti: Any, options: ProfileOptions) -> _P | None:
        try:
            import numpy as np
        except ImportError:
            return None
        ak = cupti.ActivityKind
        wanted = (
            (ak.CONCURRENT_KERNEL, "activity_kernel10_dtype", KERNEL),
            (ak.KERNEL, "activity_kernel10_dtype", KERNEL),
            (ak.MEMCPY, "activity_memcpy6_dtype", MEMCPY),
            (ak.MEMSET, "activity_memset4_dtype", MEMSET),
        )
        groups: dict[int, tuple[int, Any]] = {}
        for kind, attr, code in wanted:
            dt = getattr(cupti, attr, None)
            if dt is None or not all(f in (dt.names or ()) for f in (*cls._FIELDS, "kind")):
                return None
            if not all(f in dt.names for f in cls._EXTRA[code]):
                return None
            groups[int(kind)] = (code, dt)
        return cls(np, groups, int(options.buffer_size) + 4096, _memcpy_names(cupti))

    def _name(self, ptr: int) -> str:
        name = self.names.get(ptr)
        if name is None:
            raw = ctypes.string_at(ptr) if ptr else b"<unknown>"
            name = self.names[ptr] = raw.decode("utf-8", "replace")
        return name

    def _name_ids(self, ptrs: Any) -> tuple[Any, Any]:
        """``np.unique(ptrs, return_inverse=True)`` for kernel name pointers: a binary search in
        the (few) pointers seen before instead of sorting every record's."""
        np = self.np
        known = getattr(self, "_known_ptrs", None)
        if known is not None and known.shape[0]:
            pos = np.searchsorted(known, ptrs)
            np.minimum(pos, known.shape[0] - 1, out=pos)
            if bool((known[pos] == ptrs).all()):
                return known, pos
        uptr, inv = np.unique(ptrs, return_inverse=True)
        merged = uptr if known is None else np.union1d(known, uptr)
        self._known_ptrs = merged if merged.shape[0] <= 1 << 16 else None
        return uptr, inv.reshape(-1)

    def resolve_names(self, items: list[tuple[int, Any]]) -> None:
        """Read the name of every kernel name pointer among stashed ``items`` that is new (they
        are cached: :meth:`batches` then reads no memory of CUPTI's)."""
        for code, arr in items:
            if code == KERNEL and arr.shape[0]:
                uptr, _ = self._name_ids(arr["name"])
                for p in uptr.tolist():
                    self._name(int(p))

    def _compact_dtype(self, code: int) -> Any:
        dt = self.compact.get(code)
        if dt is None:
            src = next(d for c, d in self.groups.values() if c == code)
            names = self._FIELDS + self._EXTRA[code]
            dt = self.compact[code] = self.np.dtype([(f, src.fields[f][0]) for f in names])
        return dt

    def _check(self, code: int, arr: Any, rows: Any, activities: Any, idx: Any) -> None:
        """Raw fields of ``arr`` rows ``rows`` must equal the attributes of ``activities[idx]``."""
        for j, i in zip(rows, idx):
            obj = activities[i]
            for f in self._FIELDS:
                if int(arr[f][j]) != int(getattr(obj, f)):
                    raise _LayoutMismatch(f"field {f} of record {i}")
            if code == KERNEL and self._name(int(arr["name"][j])) != obj.name:
                raise _LayoutMismatch("kernel name")

    def _take(self, code: int, arr: Any) -> tuple[int, Any]:
        out = self.np.empty(arr.shape[0], dtype=self._compact_dtype(code))
        for f in out.dtype.names:
            out[f] = arr[f]
        return code, out

    def stash(self, activities: Any) -> list[tuple[int, Any]]:
        """The records of one buffer as compact numpy columns per kind: ``[(code, array)]``.

        This is what runs in CUPTI's thread for every buffer, so it does no per-record Python
        work in the common case (one kind, records back to back: a graph replay's kernels): the
        buffer is viewed in place with the record dtype, its ``kind`` column checked, three records
        compared with cupti-python's objects, and the needed fields copied out. Mixed buffers
        read each object's ``ptr`` once. Kernel names stay pointers (CUPTI's name strings live as
        long as the context) until :meth:`batches`.
        """
        np = self.np
        n = len(activities)
        first, last = activities[0], activities[-1]
        k0 = int(first.kind)
        group = self.groups.get(k0)
        if group is not None and int(last.kind) == k0:
            code, dt = group
            size = dt.itemsize
            base = int(first.ptr)
            if base > 0 and int(last.ptr) - base == (n - 1) * size and n * size <= self.span_limit:
                view = np.frombuffer((ctypes.c_char * (n * size)).from_address(base), dtype=dt)
                if bool((view["kind"] == k0).all()):
                    idx = sorted({0, n // 2, n - 1})
                    self._check(code, view, idx, activities, idx)
                    return [self._take(code, view)]
        # mixed kinds or gaps: one pointer read per record
        ptrs = np.fromiter((a.ptr for a in activities), dtype=np.int64, count=n)
        if int(ptrs.min()) <= 0:
            raise _LayoutMismatch("record without an address")
        kinds = np.fromiter((a.kind for a in activities), dtype=np.int64, count=n)
        sizes = np.zeros(n, dtype=np.int64)
        for kind, (_, dt) in self.groups.items():
            sizes[kinds == kind] = dt.itemsize
        # records of one buffer lie one after another, in order; anything else: do not read raw memory
        if n > 1 and not bool((ptrs[1:] >= ptrs[:-1] + sizes[:-1]).all()):
            raise _LayoutMismatch("records are not laid out one after another")
        base = int(ptrs[0])
        top = int(ptrs[-1] + max(int(sizes[-1]), 8))
        if top - base > self.span_limit:
            raise _LayoutMismatch(f"records span {top - base} bytes")
        offs = ptrs - base
        full = np.frombuffer((ctypes.c_char * (top - base)).from_address(base), dtype=np.uint8)
        out: list[tuple[int, Any]] = []
        for kind, (code, dt) in self.groups.items():
            sel = np.flatnonzero(kinds == kind)
            if not sel.size:
                continue
            o = offs[sel]
            size = dt.itemsize
            rows = full[o[:, None] + np.arange(size)]
            arr = np.ascontiguousarray(rows).view(dt).reshape(-1)
            js = sorted({0, int(sel.size) - 1})
            self._check(code, arr, js, activities, [int(sel[j]) for j in js])
            out.append(self._take(code, arr))
        if len(out) > 1:  # keep the order of kinds fixed (kernels, memcpys, memsets)
            out.sort(key=lambda t: t[0])
        return out

    def batches(self, items: list[tuple[int, Any]]) -> list[tuple[Any, ...]]:
        """``record_batch`` argument tuples for stashed items (one batch per kind, in order)."""
        np = self.np
        by_code: dict[int, list[Any]] = {}
        for code, arr in items:
            by_code.setdefault(code, []).append(arr)
        out = []
        for code, arrs in sorted(by_code.items()):
            arr = arrs[0] if len(arrs) == 1 else np.concatenate(arrs)
            if code == KERNEL:
                uptr, inv = self._name_ids(arr["name"])
                names = [self._name(int(p)) for p in uptr.tolist()]
                nbytes = np.zeros(arr.shape[0], dtype=np.int64)
            elif code == MEMCPY:
                ukind, inv = np.unique(arr["copy_kind"], return_inverse=True)
                names = [self.memcpy_names.get(int(k), "Memcpy") for k in ukind.tolist()]
                nbytes = arr["bytes"]
            else:
                names, inv = ["Memset"], np.zeros(arr.shape[0], dtype=np.int64)
                nbytes = arr["bytes"]
            out.append(
                (
                    code,
                    names,
                    inv.reshape(-1),
                    arr["start"],
                    arr["end"],
                    arr["device_id"],
                    arr["stream_id"],
                    arr["correlation_id"],
                    arr["graph_id"],
                    arr["graph_node_id"],
                    nbytes,
                )
            )
        return out

    def parse(self, activities: Any) -> list[tuple[Any, ...]]:
        """``record_batch`` argument tuples for the records of one buffer (validated)."""
        return self.batches(self.stash(activities))


def _record_classes(cupti: Any) -> dict[int, Any]:
    """Activity kind value -> cupti-python record class with ``from_ptr`` (layout checks, fallback)."""
    ak = cupti.ActivityKind
    out: dict[int, Any] = {}
    for kind, cls in (
        ("CONCURRENT_KERNEL", "ActivityKernel10"),
        ("KERNEL", "ActivityKernel10"),
        ("MEMCPY", "ActivityMemcpy6"),
        ("MEMSET", "ActivityMemset4"),
    ):
        c = getattr(cupti, cls, None)
        if c is not None and hasattr(c, "from_ptr") and hasattr(ak, kind):
            out[int(getattr(ak, kind))] = c
    return out


class _RawParser(_FastParser):
    """Reads a raw CUPTI buffer (``address``, ``valid_size``) with numpy, no object per record.

    Every CUPTI activity record starts with its ``CUpti_ActivityKind`` (uint32) and records lie
    back to back (each ``dtype.itemsize`` bytes, the C struct's size). The walk finds *runs* of one
    kind. Real buffers mix kinds often (an H100 decode loop at batch 32 gave ~9,600 runs in 40,000
    records), so a run is first followed record by record in Python, up to 16 records; only a
    longer run is counted in growing vectorized chunks (the first mismatch is exactly where the
    next record begins). The needed fields of all records of one kind are then gathered at once,
    one fancy index per field into a typed view of the buffer: the cost per run is a few Python
    steps, not a few numpy calls (a buffer of 9,600 runs took 300-400 ms that way, on an H100
    host, 2026-11-23).

    Checks, per buffer (cheap; a failure raises :class:`_LayoutMismatch` and the session goes
    per-record through CUPTI's iterator and cupti-python's classes for good): the walk must end
    exactly at ``valid_size`` with only known kinds; the first ``verify_records`` record offsets
    (the first 4096 in the first buffer of the process) must equal what
    ``cuptiActivityGetNextRecord`` returns; in the first buffer of the process, the first and last
    record of each kind are read through cupti-python's ``from_ptr`` objects and must give the same
    fields and name.
    """

    verify_records = 16
    _first_done = False  # class level: the first buffer of the process is checked in full
    _step_limit = 16  # records of one run followed in Python before counting the rest with numpy

    backend: Any = None
    objects: dict[int, Any] = {}  # noqa: RUF012 - a read-only default: a session assigns its own

    def _walk(self, mem: Any, valid: int) -> dict[int, list[int]]:
        """The offsets of the records of each kind (kind -> offsets, ascending)."""
        sizes = {k: g[1].itemsize for k, g in self.groups.items()}
        if any(size % 4 for size in sizes.values()):
            raise _LayoutMismatch(f"record sizes {sorted(sizes.values())} not multiples of 4")
        kinds = memoryview(mem[: valid - valid % 4]).cast("I")  # the kind at offset o: kinds[o >> 2]
        found: dict[int, list[int]] = {k: [] for k in sizes}
        table = {k: (size, found[k]) for k, size in sizes.items()}
        step_limit = self._step_limit
        prev, same, off = -1, 0, 0
        try:
            while off < valid:
                k = kinds[off >> 2]
                entry = table.get(k)
                if entry is None:
                    raise _LayoutMismatch(f"record of unknown kind {k} at offset {off}")
                size, offsets = entry
                offsets.append(off)
                off += size
                if k != prev:
                    prev, same = k, 1
                    continue
                same += 1
                if same == step_limit and off < valid:  # a long run: count the rest with numpy
                    c = self._count_run(mem, off, k, size, (valid - off) // size)
                    offsets.extend(range(off, off + c * size, size))
                    off += c * size
        except IndexError:
            raise _LayoutMismatch(f"{valid - off} trailing bytes") from None
        if off != valid:
            raise _LayoutMismatch(f"records end at {off}, valid size {valid}")
        return {k: v for k, v in found.items() if v}

    def _count_run(self, mem: Any, off: int, k: int, size: int, m: int) -> int:
        """How many of the (at most ``m``) records from ``off`` on are of kind ``k``."""
        np = self.np
        count, chunk = 0, 64
        while count < m:
            c = min(chunk, m - count)
            ks = np.ndarray((c,), dtype="<u4", buffer=mem, offset=off + count * size, strides=(size,))
            bad = np.flatnonzero(ks != k)
            if bad.size:
                return count + int(bad[0])
            count += c
            chunk *= 4
        return count

    @staticmethod
    def _offsets(found: dict[int, list[int]], limit: int) -> list[int]:
        """The first ``limit`` record offsets, in buffer order."""
        return sorted(o for offsets in found.values() for o in offsets[:limit])[:limit]

    def _gather(self, mem: Any, valid: int, code: int, dt: Any, offsets: list[int]) -> Any:
        """The compact columns of the records of one kind at ``offsets``: one gather per field."""
        np = self.np
        cdt = self._compact_dtype(code)
        o = np.asarray(offsets, dtype=np.int64)
        out = np.empty(o.shape[0], dtype=cdt)
        aligned = all(g[1].itemsize % 8 == 0 for g in self.groups.values())
        if not aligned:  # 8-byte fields might straddle: copy whole records, then take the fields
            rows = mem[o[:, None] + np.arange(dt.itemsize)]
            return self._take(code, np.ascontiguousarray(rows).view(dt).reshape(-1))[1]
        typed: dict[Any, Any] = {}
        for f in cdt.names:
            fdt, fo = dt.fields[f][0], dt.fields[f][1]
            isz = fdt.itemsize
            if fo % isz:
                raise _LayoutMismatch(f"field {f} at offset {fo} is not aligned")
            view = typed.get(fdt)
            if view is None:
                view = typed[fdt] = mem[: valid - valid % isz].view(fdt)
            out[f] = view[(o + fo) // isz]
        return out

    def _verify(
        self, addr: int, valid: int, found: dict[int, list[int]], kinds: dict[int, tuple[Any, list[int]]]
    ) -> None:
        """Offsets against CUPTI's iterator; in the process's first buffer, the first and last record
        of each kind (``kinds``: kind -> (its compact columns, its record offsets)) against
        cupti-python's objects."""
        backend = self.backend
        limit = self.verify_records if _RawParser._first_done else 4096
        if backend is not None and hasattr(backend, "record_offsets"):
            ref = backend.record_offsets(addr, valid, limit)
            ours = self._offsets(found, limit)
            if ref != ours[: len(ref)] or (len(ref) < limit and len(ref) != len(ours)):
                raise _LayoutMismatch("record offsets differ from cuptiActivityGetNextRecord")
        if not _RawParser._first_done:  # field by field against cupti-python, once per process
            classes = self.objects
            for k, (arr, offsets) in kinds.items():
                cls = classes.get(k)
                if cls is None:
                    continue
                code = self.groups[k][0]
                rows = sorted({0, len(offsets) - 1})
                objs = [cls.from_ptr(addr + offsets[j], True) for j in rows]
                self._check(code, arr, rows, objs, range(len(objs)))
                _pin(objs)
        _RawParser._first_done = True

    def stash_raw(self, addr: int, valid: int) -> list[tuple[int, Any]]:
        """Compact columns ``[(code, array)]`` (one per kind, kinds in fixed order) of a raw buffer."""
        np = self.np
        if valid > self.span_limit:
            raise _LayoutMismatch(f"valid size {valid} larger than the buffer")
        mem = np.frombuffer((ctypes.c_char * valid).from_address(addr), dtype=np.uint8)
        found = self._walk(mem, valid)
        columns: dict[int, list[Any]] = {}
        checked: dict[int, tuple[Any, list[int]]] = {}  # kind -> (its columns, its record offsets)
        for k, offsets in found.items():
            code, dt = self.groups[k]
            size = dt.itemsize
            first, n = offsets[0], len(offsets)
            if offsets[-1] - first == (n - 1) * size:  # back to back: view them in place
                arr = self._take(code, mem[first : first + n * size].view(dt))[1]
            else:
                arr = self._gather(mem, valid, code, dt, offsets)
            columns.setdefault(code, []).append(arr)
            checked[k] = (arr, offsets)
        self._verify(addr, valid, found, checked)
        return [(code, arrs[0] if len(arrs) == 1 else np.concatenate(arrs)) for code, arrs in sorted(columns.items())]


def batches_of_objects(cupti: Any, activities: Any, memcpy_names: dict[int, str]) -> tuple[list[tuple[Any, ...]], int]:
    """The per-record path: cupti-python's activity objects read one by one, as the arguments of
    ``ProfileData.record_batch`` for each kind present (kernel, memcpy, memset), and how many
    records could not be read. Other kinds are skipped."""
    code_of = {int(cupti.ActivityKind.CONCURRENT_KERNEL): KERNEL, int(cupti.ActivityKind.KERNEL): KERNEL}
    code_of[int(cupti.ActivityKind.MEMCPY)] = MEMCPY
    code_of[int(cupti.ActivityKind.MEMSET)] = MEMSET
    rows: dict[int, list[tuple[Any, ...]]] = {KERNEL: [], MEMCPY: [], MEMSET: []}
    unread = 0
    for a in activities or ():
        try:
            code = code_of.get(a.kind)
            if code is None:
                continue
            if code == KERNEL:
                name, nbytes = a.name, 0
            elif code == MEMCPY:
                name, nbytes = memcpy_names.get(a.copy_kind, "Memcpy"), a.bytes
            else:
                name, nbytes = "Memset", a.bytes
            row = (name, a.start, a.end, a.device_id, a.stream_id, a.correlation_id)
            rows[code].append((*row, a.graph_id, a.graph_node_id, nbytes))
        except Exception:  # noqa: BLE001 - a record that cannot be read is counted, the others go on
            unread += 1
    batches = []
    for code, batch in rows.items():
        if batch:
            names = sorted({r[0] for r in batch})
            index = {n: i for i, n in enumerate(names)}
            columns = list(zip(*batch))
            batches.append((code, names, [index[n] for n in columns[0]], *columns[1:]))
    return batches, unread


def objects_in_raw_buffer(backend: Any, classes: dict[int, Any], addr: int, valid: int) -> tuple[list[Any], int]:
    """The records of raw buffer ``addr`` (``valid`` bytes) as cupti-python objects, found by
    CUPTI's own iterator (``backend.record_offsets``) and read by ``classes`` (kind -> class with
    ``from_ptr``), pinned while the buffer lives; and how many were of a kind without a class."""
    objs = []
    lost = 0
    for off in backend.record_offsets(addr, valid):
        cls = classes.get(int(ctypes.c_uint32.from_address(addr + off).value))
        if cls is None:
            lost += 1
            continue
        objs.append(cls.from_ptr(addr + off, True))
    _pin(objs)
    return objs, lost
