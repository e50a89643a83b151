"""A slow disk the kernel makes: an ext4 file system on a loop device whose reads a blkio cgroup caps.

The FUSE mount (fault_mount.py) caps bandwidth in a Python server that shares the host's cores with
what it serves; here the cap costs no user-space CPU, as a remote NFS server's work costs the client
none. The process that enters joins the cgroup, and so does every process it starts afterwards (vLLM's
engine core and workers), so all their reads of the disk are capped; writes are not (a cgroup v1
throttle does not see buffered writeback).

    with ThrottledDisk(size_gb=4, read_mb_s=200) as disk:
        ...  # write a store under disk.path
        disk.evict()                 # its pages leave the page cache: the next read goes to the disk
        disk.read_bytes()            # bytes read from the disk so far, through the cap

`ThrottledDisk.available()` says why one cannot be made here (not root, no loop devices, no blkio cgroup).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")


class ThrottledDisk:
    """A loop-mounted ext4 image with a read cap for this process and its later children (see the module)."""

    def __init__(self, size_gb: float, read_mb_s: float):
        if size_gb <= 0 or read_mb_s <= 0:
            raise ValueError(f"size_gb and read_mb_s must be positive, got {size_gb} and {read_mb_s}")
        self.size_gb = size_gb
        self.read_mb_s = read_mb_s
        self.path: Path | None = None  # the mounted file system, while entered
        self._work: Path | None = None
        self._device: str | None = None
        self._devno = ""  # "major:minor" of the loop device, as the cgroup's files name it
        self._cgroup: Path | None = None

    @staticmethod
    def available() -> str | None:
        """None when a disk can be made here, else why not."""
        if os.geteuid() != 0:
            return "a loop device and a cgroup need root"
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"no {tool} (apt-get install util-linux e2fsprogs mount)"
        if not os.path.exists("/dev/loop-control"):
            return "no /dev/loop-control"
        if not (BLKIO / "blkio.throttle.read_bps_device").exists():
            return f"no cgroup v1 blkio controller at {BLKIO}"
        return None

    def __enter__(self) -> ThrottledDisk:
        why = self.available()
        if why:
            raise RuntimeError(f"no throttled disk here: {why}")
        self._work = Path(tempfile.mkdtemp(prefix="ucm-disk-"))
        try:
            image = self._work / "disk.img"
            with open(image, "wb") as f:
                f.truncate(int(self.size_gb * 2**30))
            _run("mkfs.ext4", "-q", "-F", str(image))
            # Direct I/O on the image: its pages are not cached twice, so an eviction reaches the disk.
            self._device = _run("losetup", "--find", "--show", "--direct-io=on", str(image)).strip()
            self.path = self._work / "mnt"
            self.path.mkdir()
            _run("mount", "-o", "noatime", self._device, str(self.path))
            rdev = os.stat(self._device).st_rdev
            self._devno = f"{os.major(rdev)}:{os.minor(rdev)}"
            self._cgroup = BLKIO / f"ucm-disk-{os.getpid()}-{Path(self._device).name}"
            self._cgroup.mkdir()
            (self._cgroup / "blkio.throttle.read_bps_device").write_text(f"{self._devno} {int(self.read_mb_s * 1e6)}")
            (self._cgroup / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:  # a container that refuses the loop device, the mount or the cgroup
            self.__exit__()
            raise RuntimeError(f"no throttled disk here: {e}") from e
        except BaseException:
            self.__exit__()
            raise
        return self

    def evict(self, settle_s: float = 0.3, timeout_s: float = 60.0) -> None:
        """Once no file has changed for `settle_s` (a store's writers finished: a file written after
        an eviction would be read from the page cache), written pages to the disk and every file's
        pages out of the page cache."""
        deadline = time.monotonic() + timeout_s
        files = self._files()
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            files, before = self._files(), files
            if files == before:
                break
        _run("sync", "-f", str(self.path))
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # removed meanwhile (an eviction, a rename)
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _files(self) -> dict[str, tuple[int, int]]:
        out = {}
        for root, _dirs, names in os.walk(self.path):
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                out[path] = (st.st_size, st.st_mtime_ns)
        return out

    def read_bytes(self) -> int:
        """Bytes read from the disk so far by the cgroup's processes."""
        for line in (self._cgroup / "blkio.throttle.io_service_bytes").read_text().splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[0] == self._devno and fields[1] == "Read":
                return int(fields[2])
        return 0

    def __exit__(self, *exc) -> None:
        if self._cgroup is not None:
            (BLKIO / "cgroup.procs").write_text(str(os.getpid()))  # back to the root group
            for pid in (self._cgroup / "cgroup.procs").read_text().split():  # children still alive
                try:
                    (BLKIO / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            deadline = time.monotonic() + 5
            while True:  # busy until the kernel has let go of the tasks that left it
                try:
                    self._cgroup.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # an empty group left behind costs nothing
                    time.sleep(0.05)
            self._cgroup = None
        if self.path is not None and os.path.ismount(self.path):
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        if self._device is not None:
            subprocess.run(["losetup", "-d", self._device], capture_output=True)
            self._device = None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
        self.path = None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def throttled_or_skip(size_gb: float, read_mb_s: float):
    """A ThrottledDisk for a test, which skips where the host has the parts but refuses them."""
    from skip_if_refused import entered_or_skip

    return entered_or_skip(ThrottledDisk(size_gb, read_mb_s))
