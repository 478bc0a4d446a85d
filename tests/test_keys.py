from __future__ import annotations

import pytest

from tierswap.errors import InvalidKeyError
from tierswap.keys import validate_key


@pytest.mark.parametrize(
    "key", ["a", "model.layers.0.mlp.weight/exp_avg", "x/y/z", "ünïcode/ключ", "with space", "..a"]
)
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "empty"),
        ("/abs", "absolute"),
        ("a//b", "empty segment"),
        ("a/", "empty segment"),
        ("a/../b", "'..'"),
        ("..", "'..'"),
        ("./a", "'.'"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a\\b", "backslash"),
        ("a/zarr.json", "reserved"),
        (".tierswap/x", "reserved"),
        ("x" * 201, "longer than"),
        ("/".join(["abcdefgh"] * 200), "longer than"),
        (3, "must be a str"),
        ("bad\udc80", "UTF-8"),
    ],
)
def test_invalid_keys(key: object, why: str) -> None:
    with pytest.raises(InvalidKeyError, match=why):
        validate_key(key)


def test_key_hierarchy_counts_reasons_and_groups() -> None:
    from tierswap.keys import KeyHierarchy

    names = KeyHierarchy()
    names.add("a/b/c")
    names.add("a/b/c")  # stored and being overwritten
    with pytest.raises(InvalidKeyError, match="group"):
        names.check("a/b")
    with pytest.raises(InvalidKeyError, match="nest"):
        names.check("a/b/c/d")
    names.check("a/x")
    names.remove("a/b/c")
    with pytest.raises(InvalidKeyError):
        names.check("a")
    names.remove("a/b/c")
    names.check("a")
    names.check("a/b/c/d")
