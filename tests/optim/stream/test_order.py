"""The recorded order of module uses (``tierswap.optim.stream._order.UseOrder``): what comes
next, how soon a parameter is used again, and Belady's choice of those kept."""

from __future__ import annotations

from tierswap.optim.stream._order import UseOrder

#: Module position -> the slot indices it uses: module 0 and module 3 share slot 0 (a tied
#: embedding, used first and last).
OWNED = [[0], [1], [2], [0, 3]]
#: Forward 0, 1, 2, 3, then backward 3, 2, 1, 0.
ITERATION = [0, 1, 2, 3, 3, 2, 1, 0]


def _recorded() -> UseOrder:
    order = UseOrder()
    for position in ITERATION:
        assert order.used(position, 2) == []  # nothing to read ahead while recording
    order.step_begins(OWNED)
    return order


def test_the_order_is_recorded_until_the_first_step() -> None:
    order = UseOrder()
    assert order.recording
    order = _recorded()
    assert not order.recording
    assert order.used(0, 2) == [1, 2]
    assert order.used(3, 3) == [3, 2, 1]  # forward's use of module 3 comes first


def test_a_module_used_twice_is_found_from_the_current_use_on() -> None:
    order = _recorded()
    for position in (0, 1, 2, 3):
        order.used(position, 2)
    assert order.used(3, 2) == [2, 1]  # backward's use, not forward's again
    assert order.used(0, 2) == []  # the last use: nothing follows in this iteration
    order.step_begins(OWNED)  # the next iteration starts the order again
    assert order.used(1, 1) == [2]


def test_next_use_counts_uses_until_the_slot_is_used_again_cyclically() -> None:
    order = _recorded()
    order.used(0, 0)
    order.used(1, 0)  # now after place 1
    assert order.next_use(2) == 0  # module 2, forward, next
    assert order.next_use(3) == 1  # module 3, forward
    assert order.next_use(1) == 4  # backward's use of module 1 at place 6
    assert order.next_use(0) == 1  # the tied slot: module 3's forward use
    order.used(2, 0)
    order.used(3, 0)
    order.used(3, 0)
    order.used(2, 0)
    order.used(1, 0)
    order.used(0, 0)  # the iteration's last use: the next is in the next iteration
    assert order.next_use(1) == 1
    assert order.next_use(9) == 2 * len(ITERATION)  # a slot the order lacks: last


def test_keep_soonest_takes_the_next_used_that_fit() -> None:
    order = _recorded()
    order.used(0, 0)  # after place 0: slot 1 next, then 2, then 0 and 3 (module 3)
    sizes = {0: 4, 1: 8, 2: 3, 3: 4}
    assert order.keep_soonest(sizes, 11, sizes.__getitem__) == {1, 2}
    # slot 1 does not fit in 7: the next used of those that do are taken
    assert order.keep_soonest(sizes, 7, sizes.__getitem__) == {2, 0}
    assert order.keep_soonest(sizes, 2, sizes.__getitem__) == set()


def test_restart_records_again() -> None:
    order = _recorded()
    order.restart()
    assert order.recording
    assert order.used(0, 2) == []
    order.step_begins([[5]])
    assert order.next_use(5) == 0
