"""A store root's identity: a lost mount or a deleted directory must not move the store to
whatever is at the same path now (the local disk, a fresh empty tree)."""

from __future__ import annotations

import os
import secrets

# Written at a backend's root when a store opens it; a root without it is not the one opened.
ROOT_MARKER = ".ucm-store"
FILE_MODE, DIR_MODE = 0o644, 0o755  # explicit: a umask of 000 must not make blocks world-writable

RootIdentity = tuple[int, int, bytes]  # device, inode, the marker's content


def open_root(directory: str) -> RootIdentity:
    """Create the backend and its marker, which proves it writable (a bad mount fails at
    startup, not per dump). Returns the root's identity (device, inode, the marker's random
    content: inodes of a re-created directory are often reused), checked before every write."""
    try:
        os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
        marker = os.path.join(directory, ROOT_MARKER)
        tmp = f"{marker}~{os.getpid()}~{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        os.write(fd, f"ucm-blend KV store root {secrets.token_hex(16)}\n".encode())
        os.close(fd)
        try:
            os.link(tmp, marker)  # the first store to open the root sets its identity; others keep it
        except FileExistsError:
            pass
        except OSError:  # no hard links on this file system
            if not os.path.lexists(marker):
                os.replace(tmp, marker)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        st = os.stat(directory)
        return st.st_dev, st.st_ino, _read_marker(directory)
    except OSError as e:
        raise ValueError(f"storage_backends: directory {directory!r} cannot be created or written: {e}") from e


def lost_root(roots: dict[str, RootIdentity]) -> str | None:
    """The first backend that is no longer the directory opened (device, inode or marker
    changed, or gone); None when all are intact. A stat and a read each: call it under a deadline."""
    for backend, identity in roots.items():
        try:
            st = os.stat(backend)
            intact = (st.st_dev, st.st_ino, _read_marker(backend)) == identity
        except OSError:
            intact = False
        if not intact:
            return backend
    return None


def _read_marker(directory: str) -> bytes:
    fd = os.open(os.path.join(directory, ROOT_MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.read(fd, 128)
    finally:
        os.close(fd)
