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
    assert "warm-ups in a row" in churn.reason("step")
