"""CPU tests of the benchmark harness: statistics, interleaving, failure capture, budget,
JSON schema, table and timers (no GPU needed)."""

from __future__ import annotations

import copy
import json
import math

import pytest

from graphtree.bench import timing
from graphtree.bench.harness import (
    FAILED_MARK,
    SCHEMA_VERSION,
    Budget,
    BudgetExceeded,
    Progress,
    Result,
    SchemaError,
    correctness_summary,
    format_error,
    format_value,
    interleaved,
    render_table,
    results_from_json,
    run_contender,
    summarize,
    to_json,
    validate_json,
)

# ---------------------------------------------------------------------------------------------
# statistics


def test_summarize_odd_count_known_values():
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])  # unsorted on purpose
    assert s["median"] == 3.0
    assert s["p10"] == pytest.approx(1.4)
    assert s["p90"] == pytest.approx(4.6)
    assert s["mean"] == 3.0
    assert s["n"] == 5


def test_summarize_even_count_interpolates():
    s = summarize([4, 1, 3, 2])
    assert s["median"] == 2.5
    assert s["p10"] == pytest.approx(1.3)
    assert s["p90"] == pytest.approx(3.7)
    assert s["mean"] == 2.5


def test_summarize_median_ignores_outlier():
    s = summarize([1.0, 1.0, 1.0, 1.0, 1000.0])
    assert s["median"] == 1.0
    assert s["mean"] == pytest.approx(200.8)


def test_summarize_single_sample():
    assert summarize([7.5]) == {"median": 7.5, "p10": 7.5, "p90": 7.5, "mean": 7.5, "n": 1}


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_summarize_rejects_empty_and_non_finite(bad):
    with pytest.raises(ValueError, match=r"summarize\(\) (needs at least one|got a non-finite) sample"):
        summarize(bad)


# ---------------------------------------------------------------------------------------------
# interleaving


def _logging_contenders(names, log):
    return {n: (lambda n=n: log.append(n)) for n in names}


def test_interleaved_rotates_round_robin_and_drops_warmup():
    log: list[str] = []
    t = interleaved(_logging_contenders("abc", log), repeats=2, warmup=1, timer=lambda fn: (fn(), 1.0)[1])
    # warm-up round, then two measured rounds, each rotated left by one more
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert t.samples == {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]}
    assert t.errors == {}


def test_interleaved_uses_timer_samples_per_contender():
    values = {"fast": iter([9.0, 1.0, 2.0, 3.0]), "slow": iter([99.0, 10.0, 20.0, 30.0])}
    contenders = {"fast": "fast", "slow": "slow"}
    t = interleaved(contenders, repeats=3, warmup=1, timer=lambda name: next(values[name]))
    assert t.samples["fast"] == [1.0, 2.0, 3.0]  # the warm-up sample 9.0 is dropped
    assert t.samples["slow"] == [10.0, 20.0, 30.0]
    assert t.summary("fast")["median"] == 2.0
    assert t.summary("slow")["median"] == 20.0


def test_interleaved_failure_is_recorded_and_others_continue():
    calls = {"ok": 0, "bad": 0}

    def ok():
        calls["ok"] += 1

    def bad():
        calls["bad"] += 1
        if calls["bad"] == 2:
            raise ValueError("boom\nsecond line")

    t = interleaved({"ok": ok, "bad": bad}, repeats=4, warmup=1)
    assert t.errors == {"bad": "ValueError: boom"}
    assert calls["bad"] == 2  # never called again after failing
    assert calls["ok"] == 5
    assert len(t.samples["ok"]) == 4
    assert t.samples["bad"] == []
    assert t.summary("bad") is None
    assert t.summary("ok")["n"] == 4


def test_interleaved_stop_ends_after_a_measured_round():
    t = interleaved({"a": lambda: None, "b": lambda: None}, repeats=10, warmup=2, stop=lambda: True)
    assert len(t.samples["a"]) == 1
    assert len(t.samples["b"]) == 1


def test_interleaved_stop_waits_for_min_repeats():
    asked: list[int] = []

    def stop():
        asked.append(1)
        return True

    t = interleaved({"a": lambda: None}, repeats=10, warmup=2, stop=stop, min_repeats=3)
    assert len(t.samples["a"]) == 3
    assert len(asked) == 1  # not asked before the third measured round


def test_interleaved_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleaved({"a": lambda: None}, repeats=0)


# ---------------------------------------------------------------------------------------------
# failure capture


def test_format_error_type_and_first_line():
    assert format_error(ValueError("bad shape\nmore detail")) == "ValueError: bad shape"
    assert format_error(RuntimeError("\n\n  CUDA error: oops  \nx")) == "RuntimeError: CUDA error: oops"
    assert format_error(KeyError()) == "KeyError"
    assert len(format_error(RuntimeError("x" * 1000))) < 330


def test_run_contender_records_failure_and_run_continues():
    rows: list[Result] = []
    cleaned: list[BaseException] = []

    def boom():
        raise RuntimeError("CUDA error: out of memory\nTried to allocate 2 GiB")

    out = run_contender(rows, "decode", "batch 8", "compile-cudagraphs", boom, metric="setup", on_error=cleaned.append)
    assert out is None
    assert len(rows) == 1 and len(cleaned) == 1
    r = rows[0]
    assert (r.scenario, r.case, r.contender, r.metric) == ("decode", "batch 8", "compile-cudagraphs", "setup")
    assert r.ok is False
    assert r.value is None
    assert r.error == "RuntimeError: CUDA error: out of memory"
    # the next contender still runs, and its rows are collected
    good = Result("decode", "batch 8", "graphtree", "time_per_token", 1e-3, "s")
    assert run_contender(rows, "decode", "batch 8", "graphtree", lambda: [good]) == [good]
    assert rows[-1] is good
    assert run_contender(rows, "decode", "batch 8", "eager", lambda: 42) == 42
    assert len(rows) == 2


def test_run_contender_lets_keyboard_interrupt_through():
    def stop():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_contender([], "s", "c", "x", stop)


# ---------------------------------------------------------------------------------------------
# time budget and progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_shares_roll_unused_time_forward():
    clock = _Clock()
    b = Budget(100, {"a": 1, "b": 1, "c": 2}, clock=clock)
    assert b.begin("a") == pytest.approx(25.0)
    clock.now = 5.0  # "a" used 5 of its 25 s
    assert b.begin("b") == pytest.approx(95.0 / 3)
    assert not b.expired()
    clock.now = 50.0
    assert b.expired()
    with pytest.raises(BudgetExceeded, match="skipped compile in b"):
        b.check("compile in b")
    assert b.begin("c") == pytest.approx(50.0)
    b.check("anything")  # fresh share: no raise


def test_budget_total_deadline():
    clock = _Clock()
    b = Budget(10, {"a": 1}, clock=clock)
    b.begin("a")
    clock.now = 11
    assert b.expired()
    assert b.remaining() == pytest.approx(-1)


def test_progress_prints_elapsed_prefix(capsys):
    clock = _Clock()
    log = Progress(clock=clock)
    clock.now = 12.34
    log("overhead: starting")
    out = capsys.readouterr().out
    assert out.strip() == "[   12.3s] overhead: starting"


# ---------------------------------------------------------------------------------------------
# JSON


def _meta(**over):
    meta = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "python": "3.12.3",
        "date": "2025-06-01T12:00:00+00:00",
        "graphtree": "0.1.0",
        "command": "graphtree bench --quick",
        "duration_s": 123.4,
        "scenarios": ["overhead", "memory"],
        "contenders": ["eager", "graphtree"],
    }
    meta.update(over)
    return meta


def _rows():
    s = summarize([1e-5, 1.1e-5, 1.2e-5])
    return [
        Result(
            "overhead",
            "1 kernel",
            "eager",
            "wall_per_call",
            2e-5,
            "s",
            equal_to_eager=True,
            stats=summarize([2e-5, 2.1e-5]),
        ),
        Result(
            "overhead",
            "1 kernel",
            "graphtree",
            "wall_per_call",
            s["median"],
            "s",
            equal_to_eager=True,
            stats=s,
            extra={"bitwise": True, "max_abs_diff": 0.0},
        ),
        Result("memory", "buckets 1,8,32", "eager", "graph_bytes", 0, "bytes", equal_to_eager=True),
        Result(
            "memory",
            "buckets 1,8,32",
            "graphtree",
            "*",
            None,
            "",
            ok=False,
            error="RuntimeError: CUDA error: out of memory",
        ),
        Result("capture", "32 buckets", "eager", "record_total_s", None, "s", note="eager records nothing"),
    ]


def test_good_document_validates_and_round_trips():
    doc = to_json(_rows(), _meta())
    validate_json(doc)
    assert doc["schema_version"] == SCHEMA_VERSION
    text = json.dumps(doc)
    again = json.loads(text)
    validate_json(again)
    assert [r.to_dict() for r in results_from_json(again)] == doc["results"]


def _bad(mutate):
    doc = json.loads(json.dumps(to_json(_rows(), _meta())))
    mutate(doc)
    return doc


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("results"), "lacks"),
        (lambda d: d.__setitem__("schema_version", 2), "schema_version"),
        (lambda d: d["meta"].pop("torch"), "meta lacks 'torch'"),
        (lambda d: d["meta"].__setitem__("duration_s", "fast"), "meta.duration_s"),
        (lambda d: d["meta"].__setitem__("duration_s", -1), "duration_s"),
        (lambda d: d["meta"].__setitem__("date", "yesterday"), "ISO"),
        (lambda d: d["meta"].__setitem__("device", None), "meta.device"),
        (lambda d: d.__setitem__("results", {}), "results must be a list"),
        (lambda d: d["results"][0].pop("unit"), "lacks"),
        (lambda d: d["results"][0].__setitem__("surprise", 1), "unknown keys"),
        (lambda d: d["results"][0].__setitem__("value", "fast"), "value"),
        (lambda d: d["results"][0].__setitem__("value", True), "not bool"),
        (lambda d: d["results"][0].__setitem__("ok", 1), "ok"),
        (lambda d: d["results"][0].__setitem__("contender", ""), "must not be empty"),
        (lambda d: d["results"][0].__setitem__("error", "x"), "ok but has an error"),
        (lambda d: d["results"][3].__setitem__("error", None), "without an error"),
        (lambda d: d["results"][3].__setitem__("value", 1.0), "failed but has a value"),
        (lambda d: d["results"][4].__setitem__("note", ""), "no note"),
        (lambda d: d["results"][1]["stats"].pop("p90"), "stats lacks"),
        (lambda d: d["results"][1]["stats"].__setitem__("p10", 1.0), "p10 <= median"),
        (lambda d: d["results"][1].__setitem__("unit", ""), "no unit"),
        (lambda d: d["meta"]["contenders"].append("handwritten"), "overhead/handwritten"),
    ],
)
def test_bad_documents_are_rejected(mutate, match):
    with pytest.raises(SchemaError, match=match):
        validate_json(_bad(mutate))


def test_non_finite_value_is_rejected():
    rows = _rows()
    rows[0].value = math.inf
    with pytest.raises(SchemaError, match="finite"):
        validate_json(to_json(rows, _meta()))


def test_validate_rejects_non_objects():
    for bad in (None, [], "doc", {"schema_version": 1, "meta": [], "results": []}):
        with pytest.raises(SchemaError):
            validate_json(bad)


def test_coverage_not_checked_without_lists():
    meta = _meta()
    del meta["scenarios"], meta["contenders"]
    validate_json(to_json(_rows()[:1], meta))


# ---------------------------------------------------------------------------------------------
# table


def test_format_value_units():
    assert format_value(2.5e-5, "s") == "25.0 us"
    assert format_value(3.2e-3, "s") == "3.20 ms"
    assert format_value(2.0, "s") == "2.00 s"
    assert format_value(5e-8, "s") == "50 ns"
    assert format_value(3 * 2**20, "bytes") == "3.0 MiB"
    assert format_value(512, "bytes") == "512 B"
    assert format_value(1.5, "x") == "1.50x"
    assert format_value(None, "s") == "n/a"


def test_table_renders_every_row_with_failed_marker_and_speedup():
    rows = _rows()
    rows.append(Result("overhead", "1 kernel", "compile-cudagraphs", "wall_per_call", 4e-5, "s", equal_to_eager=False))
    table = render_table(rows)
    lines = table.splitlines()
    header = lines[0]
    for col in ("scenario", "case", "contender", "metric", "value", "vs eager", "equal?"):
        assert col in header
    body = [ln for ln in lines[1:] if not set(ln) <= set("-+ ")]
    assert len(body) == len(rows)
    failed_line = next(ln for ln in body if FAILED_MARK in ln)
    assert "graphtree" in failed_line and "RuntimeError: CUDA error: out of memory" in failed_line
    graph_line = next(ln for ln in body if "graphtree" in ln and "wall_per_call" in ln)
    assert "11.0 us" in graph_line
    assert "1.82x" in graph_line  # 2e-5 / 1.1e-5
    assert graph_line.rstrip().endswith("yes")
    slow_line = next(ln for ln in body if "compile-cudagraphs" in ln)
    assert "0.50x" in slow_line and slow_line.rstrip().endswith("NO")
    eager_line = next(ln for ln in body if "eager" in ln and "wall_per_call" in ln)
    assert eager_line.rstrip().endswith("ref")
    assert "n/a (eager records nothing)" in table
    # columns line up: every body line has its separators at the header's positions
    seps = [i for i, ch in enumerate(header) if ch == "|"]
    for ln in body:
        assert [i for i, ch in enumerate(ln) if ch == "|"][: len(seps)] == seps


def test_table_clips_long_errors():
    rows = [Result("decode", "batch 1", "graphtree", "*", None, "", ok=False, error="RuntimeError: " + "x" * 500)]
    table = render_table(rows, max_error=40)
    assert "..." in table
    assert max(len(ln) for ln in table.splitlines()) < 150


def test_correctness_summary_names_mismatches():
    rows = _rows()
    rows.append(Result("overhead", "1 kernel", "compile-cudagraphs", "wall_per_call", 4e-5, "s", equal_to_eager=False))
    text = correctness_summary(rows)
    assert "1/2 checked outputs equal to eager" in text
    assert "overhead/1 kernel/compile-cudagraphs" in text
    assert "failed: 1" in text


def test_result_dict_round_trip_keeps_defaults():
    r = Result("memory", "b", "graphtree", "graph_bytes", 1024, "bytes")
    d = r.to_dict()
    assert d["value"] == 1024 and isinstance(d["value"], int)
    assert Result.from_dict(d) == r
    assert copy.deepcopy(d) == d


# ---------------------------------------------------------------------------------------------
# timers (the CPU-side logic; gpu_time needs CUDA and is exercised by the GPU test)


def test_cpu_per_call_syncs_only_before_the_clock():
    events: list[str] = []
    t = timing.cpu_per_call(lambda: events.append("call"), calls=4, sync=lambda: events.append("sync"))
    assert events == ["sync", "call", "call", "call", "call"]
    assert t >= 0


def test_wall_per_call_syncs_before_and_after():
    events: list[str] = []
    timing.wall_per_call(lambda: events.append("call"), calls=3, sync=lambda: events.append("sync"))
    assert events == ["sync", "call", "call", "call", "sync"]


def test_wall_per_call_divides_by_calls():
    import time

    t = timing.wall_per_call(lambda: time.sleep(0.002), calls=5)
    assert 0.0015 < t < 0.05


def test_per_unit_and_spin_cycles():
    timer = timing.per_unit(lambda fn: 8.0, 4)
    assert timer(lambda: None) == 2.0
    assert timing.spin_cycles_for(1e-3, 1.5e9) == 1_500_000
    with pytest.raises(ValueError, match="units must be >= 1"):
        timing.per_unit(lambda fn: 1.0, 0)
    with pytest.raises(ValueError, match="calls must be >= 1"):
        timing.cpu_per_call(lambda: None, calls=0)
