"""The engine's resident book: what a tier keeps, and the ledger bytes that go with it."""

from __future__ import annotations

import pytest

from tierswap.engine import Ledger, ResidentSet


def test_items_keep_their_reserved_bytes_until_dropped() -> None:
    ledger = Ledger("host", 100)
    book: ResidentSet[str, str] = ResidentSet(ledger)
    for key, nbytes in (("a", 30), ("b", 20)):
        assert ledger.try_reserve(nbytes)
        book.keep(key, key.upper(), nbytes)
    assert (book.nbytes, ledger.used, len(book)) == (50, 50, 2)
    assert book.drop("a") == "A"
    assert (book.nbytes, ledger.used, "a" in book) == (20, 20, False)


def test_an_item_that_leaves_hands_its_bytes_on() -> None:
    ledger = Ledger("device", 64)
    book: ResidentSet[str, int] = ResidentSet(ledger)
    assert ledger.try_reserve(64)
    book.keep("x", 1, 64)
    assert book.leave("x") == (1, 64)
    assert (book.nbytes, ledger.used) == (0, 64)  # still reserved: the caller moves them on
    ledger.release(64)


def test_clear_releases_every_item_and_a_key_joins_once() -> None:
    ledger = Ledger("host", 10)
    book: ResidentSet[str, int] = ResidentSet(ledger)
    for key in "abc":
        assert ledger.try_reserve(2)
        book.keep(key, ord(key), 2)
    with pytest.raises(AssertionError, match="resident already"):
        book.keep("a", 0, 0)
    assert sorted(book.clear()) == [97, 98, 99]
    assert (ledger.used, book.nbytes, list(book)) == (0, 0, [])
