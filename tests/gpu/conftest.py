import gc

import pytest
import torch

import graphtree


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_trees():
    graphtree.reset()
    yield
    graphtree.reset()
    gc.collect()


def pytest_runtest_logreport(report):
    """Print a failure as soon as it happens: a later crash must not swallow the report."""
    if report.failed:
        print(f"\n--- FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n", flush=True)
