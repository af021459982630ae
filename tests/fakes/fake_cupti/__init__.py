"""A fake ``cupti`` package (NVIDIA cupti-python) for graphtree.profile's CPU tests.

Installed under the names ``cupti`` / ``cupti.cupti`` in ``sys.modules`` by the ``fake_cupti``
fixture of ``tests/fakes/gt_profile_testkit.py``; never put on ``sys.path`` as ``cupti``.

Example::

    from fake_cupti import cupti
    cupti.SIM.launch_kernel("k")
"""

__graphtree_profile_internal__ = True

from fake_cupti import cupti  # noqa: F401
