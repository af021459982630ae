"""A fresh cache is no new recording (issue 27): a new object of the same layout moves into the
storages a recording keeps (graphtree/tree/adoption.py), with one device copy and no capture.

Each test places the new cache at other addresses than the old one on purpose (``_elsewhere``):
the caching allocator often hands a new cache the blocks the old one freed, which hides the
problem (the decode step then replays by luck)."""

import pytest
import torch

import graphtree

DEV = "cuda"


class Cache:
    def __init__(self, rows: int = 4) -> None:
        self.k = torch.zeros(rows, 64, device=DEV)
        self.n = torch.zeros((), dtype=torch.long, device=DEV)


def step(x: torch.Tensor, cache: Cache) -> torch.Tensor:
    cache.k.index_copy_(0, (cache.n % 4).view(1), x.view(1, -1))
    cache.n.add_(1)
    return cache.k.sum(0) * 2


def _elsewhere() -> list[torch.Tensor]:
    """Take the blocks a dropped cache freed, so that the next cache lands elsewhere."""
    return [torch.empty(4, 64, device=DEV), torch.empty((), dtype=torch.long, device=DEV)]


def _run(f, cache: Cache, twin: Cache, xs: list[torch.Tensor]) -> None:
    for x in xs:
        graphtree.mark_step()
        torch.testing.assert_close(f(x, cache), step(x, twin))
    torch.testing.assert_close(cache.k, twin.k)
    assert int(cache.n) == int(twin.n)


def test_a_fresh_cache_of_the_same_layout_is_adopted_not_recorded_again():
    f = graphtree.graphed(step)
    xs = [torch.randn(64, device=DEV) for _ in range(6)]
    _run(f, Cache(), Cache(), xs)  # dropped at once, as generate() drops its cache
    recorded = graphtree.stats().recordings
    assert recorded == 1, graphtree.stats()
    blockers = []
    for _ in range(3):
        blockers.append(_elsewhere())
        cache = Cache()
        first_ptr = cache.k.data_ptr()
        _run(f, cache, Cache(), xs)
        assert cache.k.data_ptr() != first_ptr  # it moved into the recording's memory
        del cache
    s = graphtree.stats()
    assert s.recordings == recorded and s.adopted == 3 and not s.eager, s
    assert s.replays >= 3 * len(xs) + 4, s
    assert s.kept_bytes == 4 * 64 * 4 + 8, s  # one cache's tensors, kept by the recording


def test_caches_of_many_layouts_keep_a_few_caches_worth_of_memory_not_one_per_layout():
    """Each layout (generate() with prompts of many lengths makes one per length) gets its recording,
    which keeps its cache for the next of its layout; past MAX_ORPHANED dropped ones, the oldest
    are let go."""
    from graphtree.tree.adoption import MAX_ORPHANED

    f = graphtree.graphed(step)
    xs = [torch.randn(64, device=DEV) for _ in range(3)]
    sizes = []
    for rows in range(4, 12):  # eight layouts, each cache dropped after its calls
        _run(f, Cache(rows), Cache(rows), xs)
        sizes.append(rows * 64 * 4 + 8)
    s = graphtree.stats()
    assert not s.eager and s.recordings == 8, s
    assert 0 < s.kept_bytes <= sum(sizes[-(MAX_ORPHANED + 1) :]), (s, sizes)


def test_a_cache_still_held_is_not_adopted_and_both_stay_right():
    f = graphtree.graphed(step)
    xs = [torch.randn(64, device=DEV) for _ in range(4)]
    a, a_twin = Cache(), Cache()
    _run(f, a, a_twin, xs)
    b, b_twin = Cache(), Cache()
    _run(f, b, b_twin, xs)  # `a` is alive: its memory is not the recording's to give away
    s = graphtree.stats()
    assert s.adopted == 0 and s.recordings == 2, s
    _run(f, a, a_twin, xs)  # each cache replays its own recording
    _run(f, b, b_twin, xs)
    assert graphtree.stats().recordings == 2, graphtree.stats()


def test_a_cache_whose_tensors_are_views_of_one_buffer_is_recorded_again_not_adopted():
    class Shared:
        def __init__(self) -> None:
            buf = torch.zeros(2, 4, 64, device=DEV)
            self.k, self.v = buf[0], buf[1]
            self.n = torch.zeros((), dtype=torch.long, device=DEV)

    def kv(x, c):
        c.k.index_copy_(0, (c.n % 4).view(1), x.view(1, -1))
        c.v.index_copy_(0, (c.n % 4).view(1), -x.view(1, -1))
        c.n.add_(1)
        return (c.k + c.v * 2).sum(0)

    f = graphtree.graphed(kv)
    xs = [torch.randn(64, device=DEV) for _ in range(4)]
    blockers = []
    for _ in range(3):
        blockers.append(torch.empty(2, 4, 64, device=DEV))
        c, twin = Shared(), Shared()
        for x in xs:
            graphtree.mark_step()
            torch.testing.assert_close(f(x, c), kv(x, twin))
        del c
    s = graphtree.stats()
    assert s.adopted == 0 and not s.eager and s.replays >= 3 * 2, s


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_with_hf_defaults_records_the_decode_step_once_wherever_each_new_cache_lands(kind):
    pytest.importorskip("transformers")
    from _tiny_hf import tiny_model

    model = tiny_model(kind)
    ids = torch.randint(1, 256, (1, 6), device=DEV)
    static = {"max_new_tokens": 12, "do_sample": False, "cache_implementation": "static"}
    with torch.inference_mode():
        want = model.generate(ids, **static, disable_compile=True)
        model.forward = graphtree.graphed(model.forward)
        for _ in range(3):  # the decode step recorded; the prefill eager (a lazy cache), warmed up, recorded
            got = model.generate(ids, **static)
            assert torch.equal(got, want), (got, want)
        recorded, adopted = graphtree.stats().recordings, graphtree.stats().adopted
        blockers = []
        for _ in range(3):
            # the small blocks the last cache freed, taken: the next cache lands elsewhere
            sizes = [n for n in range(512, 8193, 512) for _ in range(32)]
            blockers.append([torch.empty(n, dtype=torch.uint8, device=DEV) for n in sizes])
            got = model.generate(ids, **static)
            assert torch.equal(got, want), (got, want)
    s = graphtree.stats()
    assert s.recordings == recorded, s
    assert s.adopted - adopted == 3, s  # one copy of each new cache, for the prefill and the decode steps
    assert s.replays >= 6 * 11 - 4, s
