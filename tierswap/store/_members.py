"""The folders of one store, each on its own: private folder, lock, marker, and the checks that
a list of folders is one store's.

A store on one folder is what it always was. A store on several folders (one per drive) has a
*home*, the first folder, holding the zarr group, the journal and every metadata document; the
other folders hold chunk files only. Each folder's private ``.tierswap/zarr.json`` is its
*marker*: for a store on several folders it names the store (a random id) and the folder's place
in the list, and the home's marker lists every folder, relative to the home when inside it, so
that the home alone opens the whole store::

    {"tierswap": {"internal": true, "store": "<id>", "folder": 0, "folders": [".", "/nvme1/run"]}}
    {"tierswap": {"internal": true, "store": "<id>", "folder": 1, "home": "/nvme0/run"}}

A store on one folder keeps ``{"tierswap": {"internal": true}}``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierswap.errors import ConfigError, StoreLockedError
from tierswap.store import _journal as journal
from tierswap.store._layout import INTERNAL_DIR, group_document

__all__ = [
    "Folder",
    "check_apart_folders",
    "discover",
    "folder_hints",
    "marker_tags",
    "new_store_id",
    "store_paths",
    "unwritable",
]

_TAG = "tierswap"
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


class Folder:
    """One folder of a store: its private folder, lock and marker.

    Thread safety: none; the store opens and closes its folders from one thread.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.internal = root / INTERNAL_DIR
        self.staging = self.internal / journal.STAGING
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ writer side
    def prepare(self) -> None:
        """Create the folder and its private folder (refusing a folder that holds files but
        no store, and naming a folder that cannot be written)."""
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"store path {str(self.root)!r} is a file; pass a folder")
        is_store = (self.root / "zarr.json").exists() or self.internal.exists()
        if self.root.exists() and not is_store and any(self.root.iterdir()):
            raise ConfigError(
                f"folder {str(self.root)!r} is not empty and holds no store; pick an empty folder"
            )
        try:
            journal.mkdirs_durable(self.internal)
        except OSError as exc:
            raise unwritable(self.root, exc) from exc

    def lock(self) -> None:
        fd = os.open(self.internal, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise StoreLockedError(
                f"store {str(self.root)!r} is open for writing elsewhere; close that writer, "
                "or open with mode='r' to read"
            ) from exc
        self._lock_fd = fd

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def wipe(self) -> None:
        """Delete everything but the private folder (and the journal inside it)."""
        for child in self.root.iterdir():
            if child.name == INTERNAL_DIR:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.internal / journal.JOURNAL).unlink()

    def blank(self) -> bool:
        """Whether the folder holds nothing but its private folder (or nothing at all)."""
        if not self.root.is_dir():
            return True
        return all(child.name == INTERNAL_DIR for child in self.root.iterdir())

    # ------------------------------------------------------------------ marker
    def marker(self) -> dict[str, Any] | None:
        """The tierswap tag of the folder's marker; ``None`` when there is none."""
        try:
            doc = json.loads((self.internal / "zarr.json").read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        tag = doc.get("attributes", {}).get(_TAG) if isinstance(doc, dict) else None
        return tag if isinstance(tag, dict) else {}

    def write_marker(self, tag: dict[str, Any]) -> None:
        """Replace the marker (atomically) unless it already says ``tag``."""
        if self.marker() == tag:
            return
        data = json.dumps(group_document({_TAG: tag})).encode()
        try:
            journal.atomic_write_bytes(self.internal / "zarr.json", data)
        except OSError as exc:
            raise unwritable(self.root, exc) from exc


def unwritable(root: Path, exc: OSError) -> Exception:
    """The error for a store folder that cannot be written: ConfigError naming it (a
    permission problem or a read-only filesystem), else ``exc`` itself."""
    if exc.errno in _UNWRITABLE:
        return ConfigError(
            f"store folder {str(root)!r} cannot be written ({exc.strerror}); fix its "
            "permissions or mount, or pick another folder"
        )
    return exc


def new_store_id() -> str:
    return uuid.uuid4().hex


def discover(roots: Sequence[Path]) -> list[Path]:
    """The folders of the store whose folders are ``roots``: ``roots`` itself, or, for the
    home of a store on several folders given alone, the folders its marker lists."""
    if len(roots) != 1:
        return list(roots)
    hints = Folder(roots[0]).marker() or {}
    listed = hints.get("folders")
    if not isinstance(listed, list) or len(listed) < 2:
        return list(roots)
    return [roots[0] / hint if not Path(hint).is_absolute() else Path(hint) for hint in listed]


def marker_tags(roots: Sequence[Path], store_id: str) -> list[dict[str, Any]]:
    """The markers of the folders ``roots`` (home first) of the store ``store_id``."""
    home = {"internal": True, "store": store_id, "folder": 0, "folders": folder_hints(roots)}
    return [home] + [
        {"internal": True, "store": store_id, "folder": index, "home": str(roots[0])}
        for index in range(1, len(roots))
    ]


def folder_hints(roots: Sequence[Path]) -> list[str]:
    """How the home's marker lists ``roots``: relative to the home when inside it."""
    home = roots[0]
    return [str(r.relative_to(home)) if r.is_relative_to(home) else str(r) for r in roots]


def check_apart_folders(roots: Sequence[Path]) -> None:
    """Raise ConfigError when a folder is listed twice or lies inside another one (other than
    inside the home's private folder, where a snapshot nests its folders)."""
    for i, a in enumerate(roots):
        for b in roots[i + 1 :]:
            if a == b:
                raise ConfigError(f"store folder {str(a)!r} is listed twice; list each drive once")
            nested = b.is_relative_to(roots[0] / INTERNAL_DIR)
            if not nested and (a.is_relative_to(b) or b.is_relative_to(a)):
                raise ConfigError(
                    f"store folders {str(a)!r} and {str(b)!r} overlap; pass folders side by "
                    "side (one per drive)"
                )


def store_paths(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> tuple[Path, ...]:
    """The store's folders as absolute paths (one path, or a non-empty list of them)."""
    if isinstance(path, (str, os.PathLike)):
        return (Path(path).absolute(),)
    listed = isinstance(path, Sequence) and not isinstance(path, bytes) and path
    if not listed or not all(isinstance(p, (str, os.PathLike)) for p in path):
        raise ConfigError(
            f"store path {path!r} must be a folder or a non-empty list of folders (one per drive)"
        )
    return tuple(Path(p).absolute() for p in path)
