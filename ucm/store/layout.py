"""Where blocks and temp files live: `<backend>/<hex[0:2]>/<hex[2:4]>/<hex>.kvb`.

Two shard levels keep directories small (65536 leaves) on NFS servers with slow big-directory
lookups. Temp files sit next to their final name so the publishing rename stays in one directory.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from ucm.store.block_format import BLOCK_SUFFIX

TEMP_SUFFIX = ".tmp"
_SEP = "~"


@dataclass(frozen=True)
class TempOwner:
    """Who wrote a temp file, parsed from its name."""

    host: str
    pid: int


@dataclass(frozen=True)
class ScannedFile:
    path: str
    size: int
    mtime: float


class BlockLayout:
    def __init__(self, backends: tuple[str, ...]):
        self.backends = tuple(os.path.abspath(b) for b in backends)
        self.host = _safe_host(socket.gethostname())

    def backend_of(self, key: bytes) -> str:
        if len(self.backends) == 1:
            return self.backends[0]
        return self.backends[int.from_bytes(key[:8], "little") % len(self.backends)]

    def block_path(self, key: bytes) -> str:
        h = key.hex()
        return f"{self.backend_of(key)}/{h[0:2]}/{h[2:4]}/{h}{BLOCK_SUFFIX}"

    def temp_path(self, key: bytes) -> str:
        """Unique per writer and attempt: `.<hex>~<host>~<pid>~<random>.tmp` (hidden, never a block)."""
        h = key.hex()
        name = f".{h}{_SEP}{self.host}{_SEP}{os.getpid()}{_SEP}{secrets.token_hex(4)}{TEMP_SUFFIX}"
        return f"{self.backend_of(key)}/{h[0:2]}/{h[2:4]}/{name}"

    def scan(self) -> Iterator[tuple[ScannedFile, TempOwner | None]]:
        """Every block and temp file under the backends; owner is None for blocks.

        Files that vanish while scanning (evicted, renamed) are skipped.
        """
        for backend in self.backends:
            for shard1 in _subdirs(backend):
                for shard2 in _subdirs(shard1):
                    try:
                        entries = list(os.scandir(shard2))
                    except OSError:
                        continue
                    for entry in entries:
                        name = entry.name
                        if name.endswith(BLOCK_SUFFIX):
                            owner = None
                        elif name.endswith(TEMP_SUFFIX):
                            owner = parse_temp_owner(name)
                            if owner is None:
                                continue
                        else:
                            continue
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        yield ScannedFile(entry.path, st.st_size, st.st_mtime), owner


def parse_temp_owner(name: str) -> TempOwner | None:
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    parts = name[1 : -len(TEMP_SUFFIX)].split(_SEP)
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    return TempOwner(host=parts[1], pid=int(parts[2]))


def _safe_host(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in host) or "unknown"


def _subdirs(path: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(path) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
