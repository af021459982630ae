"""graphtree/_streams.py on the CPU: a stream given back is the next one handed out."""

from __future__ import annotations

import torch

from graphtree import _streams


class _Fake:
    device = torch.device("cuda", 5)


def test_a_stream_given_back_is_handed_out_again_once():
    fake = _Fake()
    _streams.give_back(fake)  # type: ignore[arg-type]
    with _streams.borrowed(5) as s:
        assert s is fake
    assert _streams.own_stream(5) is fake  # given back by borrowed()
    assert not _streams._spare[5]
