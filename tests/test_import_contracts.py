"""The import-linter contract type of tools/import_contracts.py, on small graphs."""

from __future__ import annotations

import grimp
import pytest

from tools.import_contracts import PrivateModulesContract, private_owner


@pytest.mark.parametrize(
    ("module", "owner"),
    [
        ("tierswap.store._layout", "tierswap.store"),
        ("tierswap._lifetime", "tierswap"),
        ("tierswap.cli._x.y", "tierswap.cli"),
        ("tierswap.store.swapstore", None),
        ("tierswap.__main__", None),
        ("tierswap", None),
    ],
)
def test_private_owner(module: str, owner: str | None) -> None:
    assert private_owner(module) == owner


def _check(imports: list[tuple[str, str]]) -> list[tuple[str, str]]:
    graph = grimp.ImportGraph()
    for importer, imported in imports:
        for module in (importer, imported):
            graph.add_module(module)
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="")
    contract = PrivateModulesContract("private", {}, {})
    check = contract.check(graph, verbose=False)
    illegal = [(item["importer"], item["imported"]) for item in check.metadata["illegal"]]
    assert check.kept == (not illegal)
    return illegal


def test_imports_inside_the_package_and_of_root_private_modules_are_kept() -> None:
    assert (
        _check(
            [
                ("tierswap.store", "tierswap.store._layout"),
                ("tierswap.store.swapstore", "tierswap.store._gate"),
                ("tierswap.store._gate", "tierswap.store._index"),
                ("tierswap.cache.tiercache", "tierswap._lifetime"),
                ("tierswap.optim.optimizer", "tierswap.store"),
                ("tierswap", "tierswap.__main__"),
            ]
        )
        == []
    )


def test_an_import_of_another_package_private_module_breaks_it() -> None:
    assert _check(
        [
            ("tierswap.optim._snapshot", "tierswap.store._snapshot"),
            ("tierswap.integrations.hf", "tierswap.optim._snapshot"),
            ("tierswap.store._chunks", "tierswap.io"),
        ]
    ) == [
        ("tierswap.integrations.hf", "tierswap.optim._snapshot"),
        ("tierswap.optim._snapshot", "tierswap.store._snapshot"),
    ]
