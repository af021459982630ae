"""A graphed callable whose signatures keep changing runs new ones eagerly (issue 27): the rule."""

from graphtree.tree.churn import Churn


def test_new_signatures_run_eagerly_after_a_run_of_warm_ups_and_a_repeated_one_warms_up():
    churn = Churn(limit=3)
    skipped = []
    for key in range(6):  # a new signature every call: warmed up until the run reaches the limit
        skipped.append(churn.skip(key))
        if not skipped[-1]:
            churn.warmed_up()
    assert skipped == [False, False, False, True, True, True]
    assert churn.skip(4) is False  # met before: the shapes settle, it warms up...
    churn.warmed_up()
    churn.recorded()  # ...and is recorded, which ends the run
    assert churn.skip(100) is False


def test_a_callable_whose_signatures_come_again_never_churns():
    churn = Churn(limit=8)
    warmed: set[int] = set()
    for step in range(200):  # four signatures in turn: each warmed up once, then recorded
        key = step % 4
        assert not churn.skip(key), step
        if key in warmed:
            churn.recorded()
        else:
            warmed.add(key)
            churn.warmed_up()


def test_it_remembers_a_bounded_number_of_signatures():
    churn = Churn(limit=0, keep=4)
    for key in range(10):
        churn.skip(key)
    assert churn.skip(9) is False and churn.skip(0) is True  # 0 was forgotten: new again
    assert "in a row without a recording" in churn.reason("step")


def test_a_signature_warmed_up_again_does_not_count_toward_churn():
    # a step's micro-batches: the same signature warmed up at each call (its gradients made anew)
    churn = Churn(limit=4)
    for _ in range(10):
        assert not churn.skip("micro")
        churn.warmed_up()
    assert churn.streak == 1
    for key in range(3):  # then new signatures, one per call: the run counts them only
        assert not churn.skip(key)
        churn.warmed_up()
    assert churn.streak == 4 and churn.skip("new")


def test_a_bounded_set_within_the_limit_never_churns_in_its_first_round():
    churn = Churn()  # the default limit
    for key in range(churn.limit):  # as many signatures as the limit, each met once, then recorded
        assert not churn.skip(key)
        churn.warmed_up()
    assert not churn.skip(0)


def test_the_reason_names_what_changes_between_the_last_two_signatures():
    import torch

    def key(n, step):
        return (((n, 8), torch.float32, (8, 1)), ("reads", (("SCALE", float, 2.0), ("step", int, step))))

    churn = Churn(limit=1)
    churn.skip(key(3, 0))
    churn.skip(key(4, 0))
    first = churn.reason("f")
    assert "the shape of tensor argument 0 changes: [3, 8] -> [4, 8]" in first
    churn.skip(key(5, 0))
    assert churn.reason("f") is first  # (one reason per run: one line in stats() and the log)
    churn.recorded()
    churn.skip(key(5, 1))
    assert "`step`, which its code reads, changes: 0 -> 1" in churn.reason("f")
    churn.recorded()
    churn.skip((((4, 8), torch.float32, (8, 1)), (int, 5)))
    churn.skip((((4, 8), torch.float32, (8, 1)), (int, 6)))
    assert "argument 1 changes: 5 -> 6" in churn.reason("f")
    churn.recorded()
    model = ("reads", (("NET", torch.nn.Linear, 1),))
    churn.skip((model,))
    churn.skip((("reads", (("NET", torch.nn.Linear, 2),)),))
    assert "`NET`, which its code reads, is rebound to another object" in churn.reason("f")
