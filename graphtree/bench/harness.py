"""The benchmark harness: statistics, result records, interleaving, failure capture, JSON and table.

Everything here is plain Python (no torch, no graphtree), so the harness's logic is tested on
CPU-only CI. The GPU-specific parts live in :mod:`graphtree.bench.timing` and
:mod:`graphtree.bench.scenarios`.

Units: results store base units (``"s"`` for times, ``"bytes"`` for memory, ``"x"`` for
ratios); the table and the plot pick readable units (us, ms, MiB) when they print.

Example::

    from graphtree.bench.harness import Result, interleaved, render_table, summarize

    timings = interleaved({"a": lambda: None, "b": lambda: None}, repeats=5, warmup=1)
    s = summarize(timings.samples["a"])
    rows = [Result("demo", "tiny", "a", "wall_per_call", s["median"], "s", stats=s)]
    print(render_table(rows))
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

SCHEMA_VERSION = 1
"""Version of the JSON document written by :func:`to_json`; bumped on incompatible changes."""

REQUIRED_META: dict[str, tuple[type, ...]] = {
    "device": (str,),
    "torch": (str,),
    "cuda": (str, type(None)),
    "python": (str,),
    "date": (str,),
    "graphtree": (str,),
    "command": (str,),
    "duration_s": (int, float),
}
"""Keys that every ``meta`` object must have, with the JSON types allowed for each."""

RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "scenario": (str,),
    "case": (str,),
    "contender": (str,),
    "metric": (str,),
    "value": (int, float, type(None)),
    "unit": (str,),
    "ok": (bool,),
    "error": (str, type(None)),
    "equal_to_eager": (bool, type(None)),
    "stats": (dict, type(None)),
    "note": (str,),
    "extra": (dict,),
}
"""Keys of every entry of ``results``, with the JSON types allowed for each."""

STATS_KEYS = ("median", "p10", "p90", "mean", "n")

FAILED_MARK = "FAILED"
"""What the table prints in the value column of a failed row."""


class SchemaError(ValueError):
    """A benchmark JSON document does not follow the schema of :func:`to_json`."""


class BudgetExceeded(RuntimeError):
    """Raised (and recorded as a failure) when a contender would start after its time budget."""


# --------------------------------------------------------------------------------------------
# statistics


def _percentile(sorted_samples: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of already sorted samples."""
    if not sorted_samples:
        raise ValueError("percentile of no samples")
    pos = (len(sorted_samples) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(sorted_samples[lo])
    frac = pos - lo
    return float(sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * frac)


def summarize(samples: Iterable[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile (linear interpolation), mean and count of ``samples``.

    Raises ``ValueError`` on an empty sequence or a non-finite sample.

    Example::

        >>> summarize([1.0, 2.0, 3.0, 4.0, 100.0])["median"]
        3.0
    """
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("summarize() needs at least one sample")
    if not all(math.isfinite(x) for x in xs):
        raise ValueError(f"summarize() got a non-finite sample: {xs}")
    return {
        "median": _percentile(xs, 50.0),
        "p10": _percentile(xs, 10.0),
        "p90": _percentile(xs, 90.0),
        "mean": math.fsum(xs) / len(xs),
        "n": len(xs),
    }


# --------------------------------------------------------------------------------------------
# result records


@dataclass
class Result:
    """One measured number (or one failure) of one contender in one case of one scenario.

    ``value`` is in base units (``unit`` is ``"s"``, ``"bytes"`` or ``"x"``); ``ok=False`` rows
    carry ``error`` (``"TypeName: first line"``) and no value; ``ok=True`` rows with no value
    are "not applicable" and say why in ``note``. ``equal_to_eager`` is ``None`` when no output
    was compared (eager itself is its own reference and reports ``True``).

    Example::

        Result("overhead", "16 kernels", "graphtree", "cpu_per_call", 9.1e-6, "s")
    """

    scenario: str
    case: str
    contender: str
    metric: str
    value: float | None
    unit: str
    ok: bool = True
    error: str | None = None
    equal_to_eager: bool | None = None
    stats: dict[str, float] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of this row (see ``RESULT_FIELDS``)."""
        d = asdict(self)
        v = d["value"]
        if v is not None and not isinstance(v, (bool, int)):
            d["value"] = float(v)  # numpy or torch scalars become plain floats
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Result:
        """Build a row back from its JSON form (missing optional keys take their defaults)."""
        values = {k: d.get(k, RESULT_DEFAULTS.get(k)) for k in RESULT_FIELDS}
        values["extra"] = dict(values["extra"] or {})
        return cls(**values)


RESULT_DEFAULTS: dict[str, Any] = {"ok": True, "note": ""}


def format_error(exc: BaseException) -> str:
    """``"TypeName: first non-empty line of the message"`` (just the type name if no message).

    Example::

        >>> format_error(ValueError("bad shape\\nmore detail"))
        'ValueError: bad shape'
    """
    name = type(exc).__name__
    for line in str(exc).splitlines():
        line = line.strip()
        if line:
            if len(line) > 300:
                line = line[:297] + "..."
            return f"{name}: {line}"
    return name


def failed(scenario: str, case: str, contender: str, exc: BaseException | str, metric: str = "*") -> Result:
    """A failed row for ``contender`` (``exc`` is an exception or an already formatted error).

    Example::

        failed("decode", "batch 8", "compile-cudagraphs", RuntimeError("boom"))
    """
    error = exc if isinstance(exc, str) else format_error(exc)
    return Result(scenario, case, contender, metric, None, "", ok=False, error=error)


def run_contender(
    results: list[Result],
    scenario: str,
    case: str,
    contender: str,
    fn: Callable[[], Any],
    metric: str = "*",
    on_error: Callable[[BaseException], None] | None = None,
) -> Any:
    """Call ``fn()``; on any ``Exception`` append a failed row to ``results`` and return ``None``.

    Whatever ``fn`` returns is returned, and if it is a :class:`Result` or a list of them they are
    appended to ``results`` too. ``on_error`` (say a memory clean-up) runs after a failure.
    ``KeyboardInterrupt`` is not caught, so a person can still stop the run.

    Example::

        rows: list[Result] = []
        run_contender(rows, "overhead", "1 kernel", "eager", lambda: 1 / 0)
        assert rows[0].error == "ZeroDivisionError: division by zero"
    """
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - any failure is a result, the run goes on
        results.append(failed(scenario, case, contender, exc, metric))
        if on_error is not None:
            try:
                on_error(exc)
            except Exception:  # noqa: BLE001
                pass
        return None
    if isinstance(out, Result):
        results.append(out)
    elif isinstance(out, list) and out and all(isinstance(r, Result) for r in out):
        results.extend(out)
    return out


# --------------------------------------------------------------------------------------------
# interleaving


@dataclass
class Timings:
    """Samples per contender from :func:`interleaved`, and the error of each one that failed."""

    samples: dict[str, list[float]]
    errors: dict[str, str]

    def summary(self, name: str) -> dict[str, float] | None:
        """:func:`summarize` of ``name``'s samples, or ``None`` if it failed or has none."""
        xs = self.samples.get(name)
        if name in self.errors or not xs:
            return None
        return summarize(xs)


def _default_timer(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    contenders: Mapping[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    stop: Callable[[], bool] | None = None,
    min_repeats: int = 1,
) -> Timings:
    """Time every contender round-robin so that drift (clocks, heat, other load) hits all equally.

    There are ``warmup`` rounds whose samples are dropped, then ``repeats`` measured rounds. In
    round ``r`` (counting warm-up rounds) the contenders run in their given order rotated left by
    ``r``, so none always runs right after the same other one. ``timer(fn)`` returns one sample
    in seconds (default: ``perf_counter`` around one call). A contender that raises is recorded
    in ``errors`` (as :func:`format_error`) and left out of later rounds; the others go on.
    ``stop()`` is asked after each measured round from the ``min_repeats``-th on; if it
    returns true, measuring ends early (a time budget).

    Example::

        t = interleaved({"eager": f, "graphtree": g}, repeats=10, warmup=2)
        print(t.summary("graphtree")["median"])
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    timer = timer or _default_timer
    names = list(contenders)
    samples: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    total = warmup + repeats
    for r in range(total):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if name in errors:
                continue
            try:
                sample = timer(contenders[name])
            except Exception as exc:  # noqa: BLE001
                errors[name] = format_error(exc)
                samples[name] = []
                continue
            if r >= warmup:
                samples[name].append(float(sample))
        if r + 1 - warmup >= min_repeats and stop is not None and stop():
            break
    return Timings(samples, errors)


# --------------------------------------------------------------------------------------------
# time budget and progress


class Budget:
    """A wall-clock budget split between named parts (scenarios), rolling unused time forward.

    ``begin(part)`` gives that part a deadline: its weight's share of the time still left among
    the parts not yet begun. ``expired()`` says whether the current part's deadline has passed
    (or the total one), and ``check(what)`` raises :class:`BudgetExceeded` if so.

    Example::

        b = Budget(450, {"overhead": 1, "decode": 3})
        b.begin("overhead")
        b.check("compile-reduce-overhead")   # raises once overhead's share is spent
    """

    def __init__(
        self, total_s: float, weights: Mapping[str, float], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_s = float(total_s)
        self.weights = dict(weights)
        self.clock = clock
        self.start = clock()
        self.part: str | None = None
        self.part_share = self.total_s
        self.part_deadline = self.start + self.total_s
        self._pending = dict(weights)

    def elapsed(self) -> float:
        """Seconds since the budget was created."""
        return self.clock() - self.start

    def remaining(self) -> float:
        """Seconds left of the whole budget (may be negative)."""
        return self.total_s - self.elapsed()

    def begin(self, part: str) -> float:
        """Start ``part``; returns the seconds it is given."""
        weight = self._pending.pop(part, self.weights.get(part, 1.0))
        left_weight = weight + sum(self._pending.values())
        share = max(self.remaining(), 0.0) * (weight / left_weight if left_weight > 0 else 1.0)
        self.part = part
        self.part_share = share
        self.part_deadline = self.clock() + share
        return share

    def expired(self) -> bool:
        """Whether the current part's deadline, or the whole budget, has passed."""
        now = self.clock()
        return now >= self.part_deadline or now - self.start >= self.total_s

    def check(self, what: str) -> None:
        """Raise :class:`BudgetExceeded` naming ``what`` if the budget is spent."""
        if self.expired():
            part = f"{self.part}'s {self.part_share:.0f}s" if self.part else "the run's"
            raise BudgetExceeded(
                f"skipped {what}: {part} time budget is spent "
                f"({self.elapsed():.0f}s of the run's {self.total_s:.0f}s elapsed)"
            )


class Progress:
    """Prints ``[ elapsed s] message`` lines, flushed, so a person watching sees the run move.

    Example::

        log = Progress()
        log("overhead: 16 kernels: timing 5 contenders")
    """

    def __init__(self, stream: Any = None, clock: Callable[[], float] = time.monotonic, quiet: bool = False) -> None:
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        stream = self.stream if self.stream is not None else sys.stdout
        print(f"[{self.clock() - self.start:7.1f}s] {message}", file=stream, flush=True)


# --------------------------------------------------------------------------------------------
# JSON


def to_json(results: Sequence[Result], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The benchmark document: ``{"schema_version", "meta", "results"}`` (see ``benchmarks/README.md``).

    ``meta`` must hold the keys of ``REQUIRED_META``; it may hold more (``scenarios`` and
    ``contenders``, when present, make :func:`validate_json` check that every pair has a row).

    Example::

        doc = to_json(rows, {"device": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0",
                             "python": "3.12.3", "date": "2025-01-01T00:00:00+00:00",
                             "graphtree": "0.1.0", "command": "graphtree bench",
                             "duration_s": 301.5})
        validate_json(doc)
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "meta": dict(meta),
        "results": [r.to_dict() for r in results],
    }


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _check_type(where: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass: only accept it where bool is named
    if isinstance(value, bool) and bool not in types:
        raise SchemaError(f"{where} must be {_type_names(types)}, not bool")
    if not isinstance(value, types):
        raise SchemaError(f"{where} must be {_type_names(types)}, not {type(value).__name__}")


def validate_json(obj: Any) -> None:
    """Raise :class:`SchemaError` if ``obj`` is not a valid benchmark document.

    Checks the top-level keys and schema version, the ``meta`` keys and types (``date`` must be
    ISO 8601), every result's keys and types, and consistency: a failed row has an error and no
    value, an ok row has no error, a finite value or a note saying why not, and ``stats`` (when
    present) has ``median, p10, p90, mean, n`` with ``p10 <= median <= p90``. If ``meta`` lists
    ``scenarios`` and ``contenders``, every (scenario, contender) pair must have a row.

    Example::

        validate_json(json.load(open("results/bench-.../bench.json")))
    """
    if not isinstance(obj, dict):
        raise SchemaError("document must be an object")
    missing = {"schema_version", "meta", "results"} - set(obj)
    if missing:
        raise SchemaError(f"document lacks {sorted(missing)}")
    if obj["schema_version"] != SCHEMA_VERSION:
        raise SchemaError(f"schema_version must be {SCHEMA_VERSION}, not {obj['schema_version']!r}")
    meta = obj["meta"]
    if not isinstance(meta, dict):
        raise SchemaError("meta must be an object")
    for key, types in REQUIRED_META.items():
        if key not in meta:
            raise SchemaError(f"meta lacks {key!r}")
        _check_type(f"meta.{key}", meta[key], types)
    try:
        datetime.fromisoformat(meta["date"])
    except ValueError as exc:
        raise SchemaError(f"meta.date is not ISO 8601: {meta['date']!r}") from exc
    if meta["duration_s"] < 0:
        raise SchemaError("meta.duration_s must be >= 0")
    results = obj["results"]
    if not isinstance(results, list):
        raise SchemaError("results must be a list")
    for i, row in enumerate(results):
        where = f"results[{i}]"
        if not isinstance(row, dict):
            raise SchemaError(f"{where} must be an object")
        missing = set(RESULT_FIELDS) - set(row)
        if missing:
            raise SchemaError(f"{where} lacks {sorted(missing)}")
        unknown = set(row) - set(RESULT_FIELDS)
        if unknown:
            raise SchemaError(f"{where} has unknown keys {sorted(unknown)}")
        for key, types in RESULT_FIELDS.items():
            _check_type(f"{where}.{key}", row[key], types)
        for key in ("scenario", "case", "contender", "metric"):
            if not row[key]:
                raise SchemaError(f"{where}.{key} must not be empty")
        if row["ok"]:
            if row["error"] is not None:
                raise SchemaError(f"{where} is ok but has an error")
            if row["value"] is None:
                if not row["note"]:
                    raise SchemaError(f"{where} is ok with no value and no note saying why")
            elif not math.isfinite(row["value"]):
                raise SchemaError(f"{where}.value must be finite")
            elif not row["unit"]:
                raise SchemaError(f"{where} has a value but no unit")
        else:
            if not row["error"]:
                raise SchemaError(f"{where} failed without an error message")
            if row["value"] is not None:
                raise SchemaError(f"{where} failed but has a value")
        stats = row["stats"]
        if stats is not None:
            missing = set(STATS_KEYS) - set(stats)
            if missing:
                raise SchemaError(f"{where}.stats lacks {sorted(missing)}")
            for key in STATS_KEYS:
                _check_type(f"{where}.stats.{key}", stats[key], (int, float))
            if not stats["p10"] <= stats["median"] <= stats["p90"]:
                raise SchemaError(f"{where}.stats must have p10 <= median <= p90")
            if stats["n"] < 1:
                raise SchemaError(f"{where}.stats.n must be >= 1")
    scenarios = meta.get("scenarios")
    contenders = meta.get("contenders")
    if scenarios is not None and contenders is not None:
        seen = {(r["scenario"], r["contender"]) for r in results}
        absent = [f"{s}/{c}" for s in scenarios for c in contenders if (s, c) not in seen]
        if absent:
            raise SchemaError(f"no result for scenario/contender {', '.join(absent)}")


def results_from_json(obj: Mapping[str, Any]) -> list[Result]:
    """The :class:`Result` rows of a document written by :func:`to_json`."""
    return [Result.from_dict(r) for r in obj["results"]]


# --------------------------------------------------------------------------------------------
# table


def format_value(value: float | None, unit: str) -> str:
    """A readable value: seconds as ns/us/ms/s, bytes as B/KiB/MiB/GiB, ratios as ``1.23x``.

    Example::

        >>> format_value(2.5e-5, "s")
        '25.0 us'
    """
    if value is None:
        return "n/a"
    if unit == "s":
        a = abs(value)
        if a == 0:
            return "0 s"
        if a < 1e-6:
            return f"{value * 1e9:.0f} ns"
        if a < 1e-3:
            return f"{value * 1e6:.1f} us"
        if a < 1.0:
            return f"{value * 1e3:.2f} ms"
        return f"{value:.2f} s"
    if unit == "bytes":
        a = abs(value)
        for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if a >= div:
                return f"{value / div:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "x":
        return f"{value:.2f}x"
    if unit:
        return f"{value:.4g} {unit}"
    return f"{value:.4g}"


def _vs_eager(row: Result, eager: Mapping[tuple[str, str, str], Result]) -> str:
    """Speedup over eager for time rows (eager / this; above 1 is faster), else ``-``."""
    if not row.ok or row.value is None or row.unit != "s" or row.contender == "eager":
        return "-"
    ref = eager.get((row.scenario, row.case, row.metric))
    if ref is None or not ref.ok or not ref.value or not row.value:
        return "-"
    return f"{ref.value / row.value:.2f}x"


def _equal_mark(row: Result) -> str:
    if not row.ok:
        return "-"
    if row.contender == "eager":
        return "ref"
    if row.equal_to_eager is None:
        return "-"
    return "yes" if row.equal_to_eager else "NO"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def render_table(results: Sequence[Result], max_error: int = 70) -> str:
    """A fixed-width text table: scenario | case | contender | metric | value | vs eager | equal?

    Failed rows print ``FAILED: <error>`` in the value column (errors clipped to ``max_error``
    characters; the JSON keeps them whole). ``vs eager`` is eager's time divided by the row's
    (a speedup; only for time metrics). ``equal?`` says whether the contender's output matched
    eager's (``ref`` for eager itself, ``-`` when not compared).

    Example::

        print(render_table(results))
    """
    eager = {(r.scenario, r.case, r.metric): r for r in results if r.contender == "eager"}
    header = ("scenario", "case", "contender", "metric", "value", "vs eager", "equal?")
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.ok:
            value = format_value(r.value, r.unit)
            if r.value is None and r.note:
                value = _clip(f"n/a ({r.note})", max_error)
        else:
            value = _clip(f"{FAILED_MARK}: {r.error}", max_error + len(FAILED_MARK) + 2)
        rows.append((r.scenario, r.case, r.contender, r.metric, value, _vs_eager(r, eager), _equal_mark(r)))
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [line(header), "-+-".join("-" * w for w in widths)]
    prev_scenario = None
    for row in rows:
        if prev_scenario is not None and row[0] != prev_scenario:
            out.append("-+-".join("-" * w for w in widths))
        prev_scenario = row[0]
        out.append(line(row))
    return "\n".join(out)


def correctness_summary(results: Sequence[Result]) -> str:
    """One paragraph: how many (scenario, case, contender) outputs matched eager, and which not.

    Example::

        print(correctness_summary(results))
    """
    verdict: dict[tuple[str, str, str], bool | None] = {}
    for r in results:
        if r.contender == "eager" or not r.ok:
            continue
        key = (r.scenario, r.case, r.contender)
        if r.equal_to_eager is not None:
            verdict[key] = bool(verdict.get(key, True)) and r.equal_to_eager
    checked = len(verdict)
    bad = sorted(k for k, v in verdict.items() if v is False)
    failures = sorted({(r.scenario, r.case, r.contender) for r in results if not r.ok})
    lines = [f"correctness: {checked - len(bad)}/{checked} checked outputs equal to eager"]
    if bad:
        lines.append("  differs from eager: " + ", ".join("/".join(k) for k in bad))
    if failures:
        lines.append(f"failed: {len(failures)} contender runs (see FAILED rows)")
    return "\n".join(lines)
