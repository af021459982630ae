"""Developer tools, not part of graphtree's API: each module is run with ``python -m``.

- :mod:`graphtree._dev.profile_fixture`: record the profiler's ingest calls to JSON and replay
  them into a profile (the CPU tests' fixtures).
- :mod:`graphtree._dev.record_profile_fixture`: the GPU scenario behind
  ``tests/fixtures/profile_graph_replay.json``, its expectations, and the recorder
  (``python -m graphtree._dev.record_profile_fixture tests/fixtures/profile_graph_replay.json``).
- :mod:`graphtree._dev.profile_overhead`: what profiling costs a graphed decode loop
  (``python -m graphtree._dev.profile_overhead --workload gpt``).

Nothing in graphtree imports this package; it imports graphtree. Its frames are graphtree's
machinery to :mod:`graphtree.profile`, never a call site.
"""
