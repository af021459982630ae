"""The error graphtree raises when a CUDA error surfaces at one of its replays (CPU: the message;
the manager's hook runs on the GPU)."""

import pytest

from graphtree.tree.replay_error import GraphReplayError, explain, is_cuda_error


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported",
        "CUDA error: device-side assert triggered",
        "graphtree: cudaMemcpyAsync of an input failed: an illegal memory access was encountered (700)",
        "CUDA error: unspecified launch failure",
    ],
)
def test_cuda_errors_are_recognised(text):
    assert is_cuda_error(RuntimeError(text))


def test_other_errors_pass_through_untouched():
    assert not is_cuda_error(RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"))
    assert not is_cuda_error(ValueError("CUDA error: not a RuntimeError"))
    assert not is_cuda_error(GraphReplayError("CUDA error: already explained"))


def test_the_message_names_the_recording_the_previous_graph_and_the_way_to_the_kernel():
    e = RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
    err = explain(e, recording="step(float32[4, 8])", previous="embed(int64[4])", debug_dir=None)
    text = str(err)
    assert isinstance(err, GraphReplayError) and isinstance(err, RuntimeError)
    assert "replaying the recording of step(float32[4, 8]): CUDA error: an illegal memory access" in text
    assert "embed(int64[4])" in text and "more lines" not in text
    assert "graphtree.graphed(fn, debug=DIR)" in text and "graphtree debug rerun" in text
    with_dir = str(explain(e, recording="step()", previous=None, debug_dir="/tmp/dumps"))
    assert "/tmp/dumps" in with_dir and "this graph" in with_dir
