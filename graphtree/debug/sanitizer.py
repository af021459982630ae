"""Re-run a dump under NVIDIA's compute-sanitizer and say, per kernel, what it found and where.

``graphtree debug rerun DUMP --sanitizer memcheck|racecheck|initcheck|synccheck [--kernel NAME]``
runs the dumped call eagerly in a fresh process under ``compute-sanitizer --tool TOOL``, with:

- ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: torch's caching allocator hands out pieces of large
  blocks, so an access past the end of a tensor usually lands in the same block and memcheck
  cannot see it; without the cache every tensor is its own allocation.
- ``CUDA_LAUNCH_BLOCKING=1``, as the plain re-run.
- ``--xml --save DUMP.TOOL.xml``: the report is parsed from the XML (kept beside the dump),
  not from the text, which changes between releases; the text goes to ``DUMP.TOOL.log``.
- ``--kernel-name kns=NAME`` for ``--kernel NAME``: only kernels whose (mangled) name holds NAME
  are checked, which is much faster on a large model.

compute-sanitizer 2025.x records the Python frames of each launch's host stack, so every finding
is shown with the innermost Python line outside torch, Triton and graphtree. Reports whose host
stack is inside cuDNN or cuBLAS (their probing of API calls that fail on purpose, their
workspaces) are set aside as noise and counted (``--all`` shows them).

Example::

    cmd = sanitizer_command("step.gtdump", "memcheck", report="step.gtdump.memcheck.xml")
    report = parse_report(open("step.gtdump.memcheck.xml").read())
    print(render(report))
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "NOISE_LIBRARIES",
    "SANITIZER_ENV",
    "TOOLS",
    "Finding",
    "Group",
    "Report",
    "parse_report",
    "read_report",
    "render",
    "run_sanitizer",
    "sanitizer_command",
]

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
NOISE_LIBRARIES = ("libcudnn", "libcublas")
"""A report whose host stack runs through one of these libraries is set aside as noise."""

_INTERNAL_MARKERS = ("site-packages/torch/", "site-packages/triton/", "site-packages/graphtree/")
_INTERNAL_FILES = ("graphtree/debug/rerun.py",)
_FINDING_LINE = re.compile(r"=+ (Invalid|Program hit|Warp|Race|Uninitialized|Barrier|Error: )")
_SUMMARY = re.compile(r"ERROR SUMMARY: ([\d,]+) error")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One record of the sanitizer's report."""

    text: str  # "Invalid __global__ write of size 4 bytes is out of bounds", "Program hit cudaErrorAssert ..."
    kernel: str  # the kernel's name as reported ("" for an API error)
    source: str  # "file:line" of the faulting instruction in the kernel's source, when known
    python: str  # "file:line in function" of the launch, innermost outside torch/Triton/graphtree
    thread: str
    block: str
    address: str
    noise: bool  # its host stack runs through cuDNN or cuBLAS


@dataclasses.dataclass
class Group:
    """Findings of one kind in one kernel, launched from one Python line."""

    text: str
    kernel: str
    source: str
    python: str
    count: int
    first: Finding


@dataclasses.dataclass
class Report:
    """A parsed report: groups of real findings, and how many were set aside as noise."""

    groups: list[Group]
    noise: list[Group]
    total: int  # findings in the XML (the text summary may count more: see Report.summary_total)
    summary_total: int | None = None  # "ERROR SUMMARY: N errors" of the text log, when read


def _text(el: ET.Element | None, path: str) -> str:
    if el is None:
        return ""
    found = el.find(path)
    return (found.text or "").strip() if found is not None else ""


def _triple(el: ET.Element | None) -> str:
    if el is None:
        return ""
    return "(" + ",".join(_text(el, k) or "0" for k in ("x", "y", "z")) + ")"


def _is_internal(path: str) -> bool:
    p = path.replace(os.sep, "/")
    return any(m in p for m in _INTERNAL_MARKERS) or p.endswith(_INTERNAL_FILES) or _in_packages(p)


def _in_packages(path: str) -> bool:
    """Inside this process's torch, Triton or graphtree (the report was made on this machine)."""
    from graphtree.debug.launches import internal_dirs

    return path.startswith(tuple(d.replace(os.sep, "/") for d in internal_dirs()))


def _finding(record: ET.Element) -> Finding:
    what = record.find("what")
    text = _text(what, "text") or _text(what, "exception") or _text(record, "text")
    where = record.find("where")
    kernel = _text(where, "func")
    path, line = _text(where, "path"), _text(where, "line")
    source = f"{os.path.basename(path)}:{line}" if path and line and line != "0" else ""
    python = ""
    noise = False
    for frame in record.iter("frame"):
        module = _text(frame, "module")
        if any(lib in os.path.basename(module) for lib in NOISE_LIBRARIES):
            noise = True
        fpath, fline = _text(frame, "path"), _text(frame, "line")
        if not python and fpath.endswith(".py") and fline and not _is_internal(fpath):
            python = f"{fpath}:{fline} in {_text(frame, 'func') or '?'}"
    who = record.find("who")
    return Finding(
        text=text,
        kernel=kernel,
        source=source,
        python=python,
        thread=_triple(who.find("threadIdx") if who is not None else None),
        block=_triple(who.find("blockIdx") if who is not None else None),
        address=_text(what, "address"),
        noise=noise,
    )


def parse_report(xml_text: str, log_text: str = "") -> Report:
    """Parse compute-sanitizer's ``--xml`` report (and, if given, its text log for the error total).

    Raises ``ValueError`` for text that is not such a report.

    Example::

        report = parse_report(Path("step.gtdump.memcheck.xml").read_text())
        for g in report.groups:
            print(g.count, g.text, g.kernel, g.python)
    """
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not a compute-sanitizer XML report: {e}") from None
    if root.tag != "ComputeSanitizerOutput":
        raise ValueError(f"not a compute-sanitizer XML report (its root is <{root.tag}>)")
    findings = [_finding(r) for r in root.iter("record") if _text(r, "level") != "Info"]
    groups: dict[tuple[str, str, str, str, bool], Group] = {}
    for f in findings:
        key = (f.text, f.kernel, f.source, f.python, f.noise)
        g = groups.get(key)
        if g is None:
            groups[key] = Group(f.text, f.kernel, f.source, f.python, 1, f)
        else:
            g.count += 1
    found = _SUMMARY.findall(log_text)
    summary = int(found[-1].replace(",", "")) if found else None
    return Report(
        groups=[g for k, g in groups.items() if not k[-1]],
        noise=[g for k, g in groups.items() if k[-1]],
        total=len(findings),
        summary_total=summary,
    )


def render(report: Report, tool: str = "memcheck", show_noise: bool = False) -> str:
    """The report for people: one block per group, the Python line of each launch."""
    from graphtree.debug.launches import demangle, short_name

    n = sum(g.count for g in report.groups)
    head = f"compute-sanitizer {tool}: {n} finding{'s' * (n != 1)} in {len(report.groups)} group(s)"
    aside = sum(g.count for g in report.noise)
    if aside:
        head += f"; {aside} inside cuDNN/cuBLAS set aside as noise" + ("" if show_noise else " (--all shows them)")
    if report.summary_total is not None and report.summary_total > report.total:
        head += f"; the sanitizer counted {report.summary_total}, of which the first {report.total} are in its report"
    lines = [head]
    for g in report.groups + (report.noise if show_noise else []):
        if g.kernel == "__assertfail":  # the assert's device function: memcheck does not name its kernel
            kernel = "not named by the sanitizer (a device-side assert: a plain `graphtree debug rerun` names it)"
        else:
            kernel = short_name(demangle(g.kernel)) if g.kernel else "(none: a CUDA API call that failed)"
        lines.append(f"  {g.count} x {g.text}")
        lines.append(f"      kernel {kernel}" + (f" (at {g.source})" if g.source else ""))
        if g.python:
            lines.append(f"      launched from {g.python}")
        f = g.first
        if f.thread or f.address:
            at = f" at {f.address}" if f.address else ""
            lines.append(f"      first: thread {f.thread} in block {f.block}{at}")
    return "\n".join(lines)


def sanitizer_command(
    dump: str | os.PathLike[str],
    tool: str,
    report: str | os.PathLike[str],
    kernel: str | None = None,
    exe: str = "compute-sanitizer",
) -> list[str]:
    """The compute-sanitizer command that re-runs ``dump`` eagerly and writes its XML report to ``report``."""
    if tool not in TOOLS:
        raise ValueError(f"--sanitizer takes one of {', '.join(TOOLS)}, not {tool!r}")
    cmd = [exe, "--tool", tool, "--xml", "--save", os.fspath(report), "--print-limit", "1000"]
    if kernel:
        cmd += ["--kernel-name", f"kns={kernel}"]
    return [*cmd, sys.executable, "-m", "graphtree.debug.rerun", "--inner", os.fspath(dump)]


SANITIZER_ENV = {
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",  # every tensor its own allocation (see the module's docstring)
    "GRAPHTREE_RERUN_WATCH": "0",  # the sanitizer names kernels itself; leave CUPTI alone
}
"""What a sanitizer re-run adds to a re-run's environment."""


def run_sanitizer(
    cmd: Sequence[str], log: Path, timeout: float, tool: str, env: dict[str, str]
) -> tuple[int | None, float]:
    """Run ``cmd`` with its output to ``log``, showing a progress line (elapsed time, findings so
    far, counted in the output as it grows) while it runs; returns (exit status or ``None`` on
    timeout, seconds)."""
    from tqdm import tqdm

    start = time.monotonic()
    found, partial = 0, ""
    bar_format = "{desc}: {elapsed}{postfix}"
    with (
        open(log, "w") as out,
        open(log, errors="replace") as reading,
        tqdm(total=None, desc=f"compute-sanitizer {tool}", bar_format=bar_format) as bar,
    ):
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                status: int | None = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - start > timeout:
                    proc.kill()
                    proc.wait()
                    status = None
                    break
                *lines, partial = (partial + reading.read()).split("\n")
                found += sum(1 for line in lines if _FINDING_LINE.match(line))
                bar.set_postfix_str(f"{found} finding(s) so far", refresh=False)
                bar.update(0)
    return status, time.monotonic() - start


def read_report(xml_path: Path, log_text: str) -> tuple[Report | None, str]:
    """The parsed report (``log_text`` is the run's text output, for the error total), or
    ``None`` and why not."""
    if not xml_path.is_file() or xml_path.stat().st_size == 0:
        return None, "compute-sanitizer wrote no report"
    try:
        return parse_report(xml_path.read_text(errors="replace"), log_text), ""
    except ValueError as e:
        return None, str(e)
