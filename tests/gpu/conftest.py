import gc
import os

import pytest
import torch

import graphtree
from graphtree.tree import manager

# The tests' subprocesses (scripts in a temporary folder, torchrun's ranks) import the graphtree this
# process imported, installed or not: a checkout run with `python -m pytest` (the device's, the
# code before a change under `.before/`) put only its working directory on sys.path, and without
# this every subprocess failed at `import graphtree` (seventeenth session, call 4)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(graphtree.__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH")) if p)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def native_helpers_ready():
    """Run every GPU test with graphtree's native helpers as users get them once built (the
    first CUDA tree starts the build; tests that need the Python path switch it off)."""
    if torch.cuda.is_available():
        from graphtree import _native

        _native.wait(600)


@pytest.fixture(autouse=True)
def fresh_trees():
    """Each test starts with no recordings and no held outputs: the one before dropped them as it
    ended, failed or not (the first starts in a fresh process). One collection per test: with
    torch, transformers and dynamo loaded one took 0.18 s on the CI machine, and this fixture made
    three (a reset before, a reset and a collection after). In the eighteenth session's one-process
    suite the tests' calls (and setups over 1 s) took 475 s of its 1,075 s. ``reset()`` collects
    once per tree it drops; a test that made none is collected here."""
    yield
    made_trees = bool(manager.managers())
    graphtree.reset()
    if not made_trees:
        gc.collect()


def pytest_runtest_logreport(report):
    """Print a failure as soon as it happens: a later crash must not swallow the report. With
    ``GRAPHTREE_TEST_TIMES=path``, each test's duration is appended there as it ends, so a run
    killed by a time limit still says where its time went."""
    times = os.environ.get("GRAPHTREE_TEST_TIMES")
    if times and (report.when == "call" or report.duration > 1):
        with open(times, "a") as f:
            f.write(f"{report.duration:8.2f} {report.outcome:7} {report.nodeid} ({report.when})\n")
    if report.failed:
        print(f"\n--- FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n", flush=True)
