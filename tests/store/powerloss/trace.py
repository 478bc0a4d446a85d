"""Record the file-system calls of a process with ``strace`` and read them back as events.

Every call that changes a file or a directory under the watched folder becomes one
:class:`Event` (path-level: which inode a path names is the model's business). Calls are
ordered by the line on which strace reports their completion; ``start`` is the line on which
they began (the same line unless another thread's call interleaved). A sync barrier covers
what completed before it started.

A mutating call the harness does not understand (``fallocate``, ``copy_file_range``, a
``renameat2`` exchange, a write through an fd whose offset it cannot know) on a watched path
raises :class:`TraceError`: the model must never silently miss an operation.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

#: A ``stat`` of a path under this prefix is a marker the traced program leaves in the trace.
MARKER = "/tierswap-powerloss-marker/"

#: The calls strace records; mutating ones not in :data:`_HANDLED` fail the trace if watched.
SYSCALLS = (
    "open,openat,creat,write,pwrite64,writev,pwritev,pwritev2,lseek,fsync,fdatasync,syncfs,"
    "sync,rename,renameat,renameat2,link,linkat,unlink,unlinkat,mkdir,mkdirat,rmdir,ftruncate,"
    "truncate,fallocate,copy_file_range,sendfile,splice,symlink,symlinkat,newfstatat,stat"
)
_UNSUPPORTED = {"fallocate", "copy_file_range", "sendfile", "splice", "symlink", "symlinkat"}


class TraceError(RuntimeError):
    """The trace holds an operation the model cannot represent."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One completed call that touches the watched folder.

    ``kind`` is one of ``open`` (``flags`` holds ``O_CREAT``/``O_TRUNC``), ``write`` (``data``
    at ``offset``), ``truncate`` (to ``size``), ``rename``/``link`` (``path`` -> ``dest``),
    ``unlink``, ``rmdir``, ``mkdir``, ``fsync``/``fdatasync``/``syncfs``/``sync`` (barriers),
    and ``marker`` (``path`` is the marker's text).
    """

    kind: str
    start: int
    end: int
    path: str = ""
    dest: str = ""
    data: bytes = b""
    offset: int = 0
    size: int = 0
    flags: frozenset[str] = frozenset()


def can_trace() -> str | None:
    """Why this machine cannot trace a process (strace missing, ptrace refused), or None."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace is not installed (.ci/run installs it: apt-get install strace)"
    probe = subprocess.run(
        [strace, "-qq", "-o", os.devnull, "true"], check=False, capture_output=True
    )
    if probe.returncode != 0:
        return f"strace cannot trace here: {probe.stderr.decode(errors='replace').strip()}"
    return None


def run_traced(cmd: Sequence[str], trace_file: Path, **popen: object) -> None:
    """Run ``cmd`` to completion under strace, writing the raw trace to ``trace_file``."""
    strace = shutil.which("strace")
    if strace is None:
        raise TraceError("strace is not installed (apt-get install strace)")
    args = [strace, "-f", "-qq", "-xx", "-y", "-s", str(64 << 20), "-e", f"trace={SYSCALLS}"]
    proc = subprocess.run([*args, "-o", str(trace_file), *cmd], check=False, **popen)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise TraceError(f"traced command failed ({proc.returncode}): {proc.stderr}")


# -- strace's text ---------------------------------------------------------------------------

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_DONE = re.compile(r"^(.*)\)\s+=\s+(.*)$")
_HEX = re.compile(r"((?:\\x[0-9a-f]{2})*)")


def _calls(lines: Iterator[str]) -> Iterator[tuple[str, str, str, int, int]]:
    """(name, args, ret, start, end) for each finished call, in order of completion."""
    pending: dict[str, tuple[str, str, int]] = {}
    for pos, line in enumerate(lines):
        m = _LINE.match(line.rstrip("\n"))
        if not m:
            continue
        pid, rest = m.groups()
        if rest.startswith(("---", "+++")):
            continue
        resumed = _RESUMED.match(rest)
        if resumed:
            name, tail = resumed.groups()
            _, head, start = pending.pop(pid)
            rest, whole = head + tail, (name, start)
        elif rest.endswith("<unfinished ...>"):
            call = _CALL.match(rest)
            assert call, line
            pending[pid] = (call[1], call[2][: -len("<unfinished ...>")].rstrip(), pos)
            continue
        else:
            call = _CALL.match(rest)
            if not call:
                continue
            rest, whole = call[2], (call[1], pos)
        done = _DONE.match(rest)
        if done:  # "= ?" (a call cut by the process's end) has no result: it did not finish
            yield whole[0], done[1], done[2], whole[1], pos


def _split(args: str) -> list[str]:
    """Top-level comma-separated arguments (strings are hex-escaped: no quote inside)."""
    out, depth, cur, quoted = [], 0, [], False
    for ch in args:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "[{<":
            depth += 1
        elif not quoted and ch in "]}>":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace("\\x", ""))


def _string(tok: str) -> bytes:
    """A quoted, hex-escaped strace string; a truncated one (``"..."...``) is an error."""
    if not (tok.startswith('"') and tok.endswith('"')):
        raise TraceError(f"truncated or unexpected string argument: {tok[:80]}")
    return _bytes(tok[1:-1])


def _fd_path(tok: str) -> str:
    """The path strace shows for an fd argument (``3</a/b>``, ``AT_FDCWD</cwd>``)."""
    m = re.match(r"^(?:-?\d+|AT_FDCWD)<(.*)>$", tok)
    if not m:
        raise TraceError(f"fd without a path: {tok[:80]}")
    return _bytes(m[1]).decode()


def _at(dir_tok: str, path_tok: str) -> str:
    path = _string(path_tok).decode()
    return os.path.normpath(path if path.startswith("/") else os.path.join(_fd_path(dir_tok), path))


def _iov_data(tok: str) -> bytes:
    return b"".join(_bytes(m) for m in re.findall(r'iov_base="((?:\\x[0-9a-f]{2})*)"', tok))


def _ok(ret: str) -> bool:
    return not ret.startswith("-1")


def _int(ret: str) -> int:
    return int(ret.split(maxsplit=1)[0].split("<", maxsplit=1)[0], 0)


# -- calls as events -------------------------------------------------------------------------


class _Reader:
    """Turns calls into events; keeps each fd's file offset for ``write``/``writev``."""

    def __init__(self, watched: Sequence[Path]) -> None:
        self.watched = [str(w) for w in watched]
        self.offsets: dict[int, int] = {}

    def inside(self, path: str) -> bool:
        return any(path == w or path.startswith(w + "/") for w in self.watched)

    def event(self, name: str, args: str, ret: str, start: int, end: int) -> Event | None:
        a = _split(args)
        span = {"start": start, "end": end}
        if name in ("newfstatat", "stat"):
            path = _string(a[1] if name == "newfstatat" else a[0]).decode()
            if path.startswith(MARKER):
                return Event("marker", path=path[len(MARKER) :], **span)
            return None
        if name in ("open", "openat", "creat"):
            return self._open(name, a, ret, span)
        if name == "lseek":
            if _ok(ret):
                self.offsets[int(a[0].split("<")[0])] = _int(ret)
            return None
        if not _ok(ret):
            return None
        return self._change(name, a, ret, span)

    def _open(self, name: str, a: list[str], ret: str, span: dict[str, int]) -> Event | None:
        if not _ok(ret):
            return None
        path = _at(a[0], a[1]) if name == "openat" else _at("AT_FDCWD</>", a[0])
        fd = int(ret.split("<", maxsplit=1)[0])
        flag_text = (
            "O_CREAT|O_WRONLY|O_TRUNC" if name == "creat" else a[2 if name == "openat" else 1]
        )
        flags = frozenset(flag_text.split("|"))
        self.offsets[fd] = -1 if "O_APPEND" in flags else 0
        if not self.inside(path) or not flags & {"O_CREAT", "O_TRUNC"}:
            return None
        return Event("open", path=path, flags=flags, **span)

    def _change(self, name: str, a: list[str], ret: str, span: dict[str, int]) -> Event | None:
        if name in ("write", "writev", "pwrite64", "pwritev", "pwritev2"):
            return self._write(name, a, ret, span)
        if name in ("rename", "link", "renameat", "renameat2", "linkat"):
            return self._move(name, a, span)
        if name in ("unlink", "rmdir", "mkdir"):
            path = _at("AT_FDCWD</>", a[0])
            return Event(name, path=path, **span) if self.inside(path) else None
        if name in ("unlinkat", "mkdirat"):
            path = _at(a[0], a[1])
            kind = "rmdir" if name == "unlinkat" and "AT_REMOVEDIR" in a[2] else name[:-2]
            return Event(kind, path=path, **span) if self.inside(path) else None
        if name in ("ftruncate", "truncate"):
            path = _fd_path(a[0]) if name == "ftruncate" else _at("AT_FDCWD</>", a[0])
            return (
                Event("truncate", path=path, size=int(a[1]), **span) if self.inside(path) else None
            )
        if name in ("fsync", "fdatasync", "syncfs"):
            path = _fd_path(a[0])
            return Event(name, path=path, **span) if self.inside(path) else None
        if name == "sync":
            return Event("sync", **span)
        if name in _UNSUPPORTED and any(self.inside(p) for p in _paths_in(a)):
            raise TraceError(f"{name} on a watched path is not modelled: {a}")
        return None

    def _write(self, name: str, a: list[str], ret: str, span: dict[str, int]) -> Event | None:
        fd, path = int(a[0].split("<")[0]), _fd_path(a[0])
        data = _string(a[1]) if name in ("write", "pwrite64") else _iov_data(a[1])
        done = _int(ret)
        if name in ("write", "writev"):
            offset = self.offsets.get(fd, -1)
            if offset >= 0:
                self.offsets[fd] = offset + done
        else:
            offset = int(a[3])
        if not self.inside(path):
            return None
        if offset < 0:
            raise TraceError(f"{name} on {path}: the file offset is unknown (O_APPEND or dup)")
        if len(data) < done:
            raise TraceError(f"{name} on {path}: strace cut the data ({len(data)} < {done})")
        return Event("write", path=path, offset=offset, data=data[:done], **span)

    def _move(self, name: str, a: list[str], span: dict[str, int]) -> Event | None:
        if name in ("rename", "link"):
            src, dst = _at("AT_FDCWD</>", a[0]), _at("AT_FDCWD</>", a[1])
        else:
            src, dst = _at(a[0], a[1]), _at(a[2], a[3])
            exchange = name == "renameat2" and "RENAME_EXCHANGE" in a[4]
            if exchange and (self.inside(src) or self.inside(dst)):
                raise TraceError(f"renameat2 RENAME_EXCHANGE is not modelled: {src} {dst}")
        kind = "link" if name.startswith("link") else "rename"
        if self.inside(src) != self.inside(dst):
            raise TraceError(f"{kind} across the watched folder's edge: {src} -> {dst}")
        return Event(kind, path=src, dest=dst, **span) if self.inside(src) else None


def _paths_in(args: list[str]) -> Iterator[str]:
    for tok in args:
        for m in re.finditer(r'<((?:\\x[0-9a-f]{2})+)>|"((?:\\x[0-9a-f]{2})+)"', tok):
            yield _bytes(m[1] or m[2]).decode(errors="replace")


def read_trace(trace_file: Path, watched: Sequence[Path]) -> list[Event]:
    """The events under ``watched`` (real paths), in order of completion."""
    reader = _Reader(watched)
    with open(trace_file, encoding="ascii", errors="replace") as fh:
        events = [reader.event(*call) for call in _calls(fh)]
    return sorted((e for e in events if e is not None), key=lambda e: e.end)


def marker(text: str) -> None:
    """Leave ``text`` in the trace (a failing ``stat``; it costs nothing untraced)."""
    os.path.exists(MARKER + text)
