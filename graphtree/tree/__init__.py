"""Trees of CUDA graphs: recording, replay, liveness of outputs, and the shared memory pool.

See ``DESIGN.md`` beside this file for how the parts fit together.
"""
