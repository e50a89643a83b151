"""A FUSE passthrough mount that misbehaves on demand: the store's tests' NFS server.

Mounted over a real directory in a process of its own, it passes every call through and, as a
control file says at the time of each call, adds latency, caps read and write bandwidth (one
link shared by all calls), holds calls of named kinds until released (what a hung NFS server
does: stats answered from cached attributes while opens and reads hang), or fails them with EIO.

    with FaultMount(source_dir, mount_dir) as mount:
        mount.set(hang=["open", "read"])     # opens and reads block until set() lifts it
        mount.set(latency_ms=5)              # every call 5 ms slower
        mount.set(eio=["read"])              # reads fail
        mount.set()                          # healthy again

Kinds: "stat" (getattr, access, statfs), "list" (readdir), "open" (open, create), "read",
"write" (write, truncate, fsync, flush), "meta" (rename, unlink, mkdir, rmdir, utimens, chmod).
`FaultMount.available()` says why a mount cannot be made here (no /dev/fuse, no libfuse, not root).

Run as a script it is the mount's server: python fault_mount.py SOURCE MOUNTPOINT CONTROL_FILE.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

KINDS = ("stat", "list", "open", "read", "write", "meta")
HANG_LIMIT_S = 900.0  # a held call gives up (EIO) after this: a forgotten release must not wedge a host
# Calls the server answers at once (libfuse's default is 10): an NFS client keeps many RPCs in
# flight, so a server that takes ten at a time would queue a lookup's parallel stats.
MAX_THREADS = 64


class FaultMount:
    """The mount's server process and its control file (see the module)."""

    def __init__(self, source: str | os.PathLike, mountpoint: str | os.PathLike):
        self.source = Path(source)
        self.mountpoint = Path(mountpoint)
        self.control = self.mountpoint.parent / f".{self.mountpoint.name}.faults.json"
        self._proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> str | None:
        """None when a mount can be made here, else why not."""
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse"
        if os.geteuid() != 0:
            return "FUSE mounts need root here"
        if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
            return "no fusermount (apt-get install fuse3)"
        try:
            importlib.import_module("mfusepy")  # loads libfuse: fails without it
        except (ImportError, OSError, EnvironmentError) as e:
            return f"mfusepy not usable ({e}; pip install mfusepy, apt-get install fuse3)"
        return None

    def __enter__(self) -> FaultMount:
        self.source.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.set()
        self._proc = subprocess.Popen([sys.executable, __file__, str(self.source), str(self.mountpoint),
                                       str(self.control)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mountpoint):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                err = self._proc.stderr.read().decode() if self._proc.poll() is not None else "timed out"
                self.__exit__()
                raise RuntimeError(f"FUSE mount at {self.mountpoint} failed: {err}")
            time.sleep(0.05)
        return self

    def set(self, hang: list[str] = (), eio: list[str] = (), latency_ms: float = 0.0,
            bandwidth_mb_s: float = 0.0) -> None:
        """What the mount does from its next call on (see the module)."""
        unknown = (set(hang) | set(eio)) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; known: {KINDS}")
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"hang": list(hang), "eio": list(eio), "latency_ms": latency_ms,
                                   "bandwidth_mb_s": bandwidth_mb_s}))
        os.replace(tmp, self.control)

    def cpu_seconds(self) -> float | None:
        """CPU time the mount's server has used so far (user and system), None once it is gone: on
        a 2-core host it shares the cores with what it serves, where an NFS server would not."""
        try:
            fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (AttributeError, OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def read_bytes(self) -> int | None:
        """Bytes the mount's server has read so far (what it sent over the "link", with the
        requests it took from the kernel), None once it is gone."""
        try:
            io = dict(line.split(": ") for line in Path(f"/proc/{self._proc.pid}/io").read_text().splitlines())
        except (AttributeError, OSError, ValueError):
            return None
        return int(io["rchar"])

    def __exit__(self, *exc) -> None:
        self.set()  # release held calls first: an unmount waits for them
        fusermount = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
        subprocess.run([fusermount, "-u", "-z", str(self.mountpoint)], capture_output=True)
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.control.unlink(missing_ok=True)


def mounted_or_skip(source, mountpoint):
    """A FaultMount for a test, which skips where FUSE is present but mounting is refused (a
    container without the right to mount)."""
    from skip_if_refused import entered_or_skip

    return entered_or_skip(FaultMount(source, mountpoint))


def _serve(source: str, mountpoint: str, control: str) -> None:
    import mfusepy as fuse

    class Faults:
        """The control file, reread when it changes."""

        def __init__(self):
            self._mtime = None
            self.state = {"hang": [], "eio": [], "latency_ms": 0.0, "bandwidth_mb_s": 0.0}
            self._lock = threading.Lock()
            self._link = threading.Lock()
            self._link_free_at = 0.0  # when the capped link has sent every byte asked of it so far

        def current(self) -> dict:
            try:
                mtime = os.stat(control).st_mtime_ns
            except OSError:
                return self.state
            with self._lock:
                if mtime != self._mtime:
                    try:
                        self.state = json.loads(Path(control).read_text())
                        self._mtime = mtime
                    except (OSError, ValueError):
                        pass
                return self.state

        def apply(self, kind: str, nbytes: int = 0) -> None:
            state = self.current()
            start = time.monotonic()
            while kind in state["hang"] and time.monotonic() - start < HANG_LIMIT_S:
                time.sleep(0.02)
                state = self.current()
            if kind in state["hang"]:
                raise fuse.FuseOSError(errno.EIO)
            if state["latency_ms"]:
                time.sleep(state["latency_ms"] / 1000)
            if state["bandwidth_mb_s"] and nbytes:  # one link shared by every call, as a network's
                with self._link:
                    now = time.monotonic()
                    self._link_free_at = max(now, self._link_free_at) + nbytes / (state["bandwidth_mb_s"] * 1e6)
                    wait = self._link_free_at - now
                time.sleep(wait)
            if kind in state["eio"]:
                raise fuse.FuseOSError(errno.EIO)

    faults = Faults()

    def real(path: str) -> str:
        return os.path.join(source, path.lstrip("/"))

    def oserror(fn):
        def call(*args):
            try:
                return fn(*args)
            except OSError as e:
                raise fuse.FuseOSError(e.errno or errno.EIO) from None
        return call

    def metadata_call(fn):
        """An operation on one path that changes metadata: (path, *args) -> fn(real path, *args)."""
        @oserror
        def call(self, path, *args):
            faults.apply("meta")
            fn(real(path), *args)
            return 0
        return call

    class Passthrough(fuse.Operations):
        @oserror
        def getattr(self, path, fh=None):
            faults.apply("stat")
            st = os.fstat(fh) if fh is not None else os.lstat(real(path))
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size",
                                                "st_atime", "st_mtime", "st_ctime", "st_ino")}

        @oserror
        def access(self, path, amode):
            faults.apply("stat")
            if not os.access(real(path), amode):
                raise fuse.FuseOSError(errno.EACCES)
            return 0

        @oserror
        def statfs(self, path):
            faults.apply("stat")
            sv = os.statvfs(real(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        @oserror
        def readdir(self, path, fh):
            faults.apply("list")
            return [".", ".."] + os.listdir(real(path))

        @oserror
        def open(self, path, flags):
            faults.apply("open")
            return os.open(real(path), flags & ~os.O_DIRECT if hasattr(os, "O_DIRECT") else flags)

        @oserror
        def create(self, path, mode, fi=None):
            faults.apply("open")
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        @oserror
        def read(self, path, size, offset, fh):  # registers reads with libfuse; DirectReads.read serves them
            faults.apply("read", size)
            return os.pread(fh, size, offset)

        @oserror
        def write(self, path, data, offset, fh):
            faults.apply("write", len(data))
            return os.pwrite(fh, data, offset)

        @oserror
        def truncate(self, path, length, fh=None):
            faults.apply("write")
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(real(path), length)
            return 0

        @oserror
        def flush(self, path, fh):
            faults.apply("write")
            return 0

        @oserror
        def fsync(self, path, datasync, fh):
            faults.apply("write")
            os.fsync(fh)
            return 0

        @oserror
        def release(self, path, fh):
            os.close(fh)
            return 0

        @oserror
        def rename(self, old, new):
            faults.apply("meta")
            os.rename(real(old), real(new))
            return 0

        unlink, rmdir = metadata_call(os.unlink), metadata_call(os.rmdir)
        mkdir, chmod = metadata_call(os.mkdir), metadata_call(os.chmod)
        utimens = metadata_call(os.utime)  # (path, None or (atime, mtime) in seconds)

    class DirectReads(fuse.FUSE):
        """Reads land in the kernel's buffer (no bytes object, no copy): the server's CPU per read,
        which an NFS server on another host would not take from the client's cores, stays small."""

        def read(self, path, buf, size, offset, fip):
            try:
                faults.apply("read", size)
                dest = (ctypes.c_char * size).from_address(ctypes.cast(buf, ctypes.c_void_p).value)
                return os.preadv(fip.contents.fh, [dest], offset)
            except OSError as e:
                raise fuse.FuseOSError(e.errno or errno.EIO) from None

    DirectReads(Passthrough(), mountpoint, foreground=True, nothreads=False, allow_other=True,
                max_threads=MAX_THREADS)


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
