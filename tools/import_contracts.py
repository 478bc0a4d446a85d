"""An import-linter contract type: a package's underscore modules stay inside that package.

The rule (STYLE habit 13): a module whose name, or the name of a package above it, starts with
one underscore is private to the package that holds it. ``tierswap.store._layout`` may be
imported by ``tierswap.store`` and every module inside it, never by ``tierswap.optim`` or
``tierswap.cli``: those import the names ``tierswap.store`` re-exports. A root-level private
module such as ``tierswap._lifetime`` may be imported from anywhere in ``tierswap``. Dunder
modules (``__main__``) are not private.

import-linter's wildcards replace whole module names (``tierswap.store.*``), so a built-in
``forbidden`` contract cannot say "the modules starting with an underscore" without listing
them; this contract type applies the rule to every module, new ones included. It is registered
in ``pyproject.toml`` (``contract_types``) and run by ``lint-imports`` from the repository root.
"""

from __future__ import annotations

from typing import Any

import grimp
from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils

__all__ = ["PrivateModulesContract", "private_owner"]


def private_owner(module: str) -> str | None:
    """The package that ``module`` is private to, or ``None`` for a public module.

    >>> private_owner("tierswap.store._layout")
    'tierswap.store'
    >>> private_owner("tierswap.store.swapstore") is None
    True
    """
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


class PrivateModulesContract(Contract):
    """Direct imports of a private module come only from inside the package it belongs to.

    Options: ``ignore_imports`` (optional), import expressions to leave out, as for the
    built-in contract types.
    """

    type_name = "private_modules"

    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=contract_utils.AlertLevel.ERROR,
        )
        illegal: list[dict[str, Any]] = []
        for importer in sorted(graph.modules):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                owner = private_owner(imported)
                if owner is None or _inside(importer, owner):
                    continue
                details = graph.get_import_details(importer=importer, imported=imported)
                lines = tuple(detail["line_number"] for detail in details)
                illegal.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(
            kept=not illegal,
            metadata={"illegal": illegal},
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
        )

    def render_broken_contract(self, check: ContractCheck) -> None:
        for item in check.metadata["illegal"]:
            owner = private_owner(item["imported"])
            lines = ", ".join(map(str, item["lines"]))
            output.print_error(
                f"- {item['importer']} -> {item['imported']} (l.{lines}): private to {owner}; "
                f"import what {owner} re-exports instead",
                bold=False,
            )
        output.new_line()
