"""``python -m tierswap``: the same CLI as the ``tierswap`` console script."""

from __future__ import annotations

from tierswap.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
