"""The Blend store of a stream behind a FUSE mount that misbehaves on a schedule (tests/fault_mount.py):
what rag_traffic.py's --mount does, and what it reports about the window the fault lasted.

A spec is comma-free words separated by ';':
    latency_ms=5                         every file operation 5 ms slower, for the whole run
    bandwidth_mb_s=200                   reads and writes capped
    hang=open+read+write@60/300          those calls hang 60 s into each run, released 300 s later
    eio=read@60/300                      those calls fail with EIO in that window
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fault_mount import KINDS, FaultMount  # noqa: E402

_WINDOWED = re.compile(r"^(hang|eio)=([a-z+]+)@([\d.]+)/([\d.]+)$")


@dataclass
class MountSchedule:
    steady: dict = field(default_factory=dict)  # latency_ms, bandwidth_mb_s: the whole run
    window: dict = field(default_factory=dict)  # hang / eio kinds, in [at, at + duration)
    at: float = 0.0
    duration: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> MountSchedule:
        out = cls()
        for word in filter(None, (w.strip() for w in spec.split(";"))):
            if m := _WINDOWED.match(word):
                kinds = m.group(2).split("+")
                if unknown := set(kinds) - set(KINDS):
                    raise ValueError(f"--mount {word!r}: unknown kinds {sorted(unknown)}; known: {KINDS}")
                out.window[m.group(1)] = kinds
                out.at, out.duration = float(m.group(3)), float(m.group(4))
            elif word.startswith(("latency_ms=", "bandwidth_mb_s=")):
                name, _, value = word.partition("=")
                out.steady[name] = float(value)
            else:
                raise ValueError(f"--mount {word!r}: expected latency_ms=MS, bandwidth_mb_s=MB, "
                                 "hang=KIND+KIND@START/SECONDS or eio=KIND@START/SECONDS")
        return out

    def start(self, mount: FaultMount, events: list) -> list[asyncio.TimerHandle]:
        """Applies the steady faults now and the window's at its times (call in the run's event loop);
        `events` gets (seconds into the run, what was set)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        def apply(state: dict) -> None:
            mount.set(**state)
            events.append((round(loop.time() - t0, 1), state))

        apply(dict(self.steady))
        if not self.window:
            return []
        return [loop.call_later(self.at, apply, {**self.steady, **self.window}),
                loop.call_later(self.at + self.duration, apply, dict(self.steady))]


@contextlib.contextmanager
def mounted_store(spec: str | None):
    """(store directory, mount or None): a temporary store, behind a FaultMount when `spec` is set."""
    source = tempfile.mkdtemp(prefix="ucm-rag-traffic-")
    try:
        if not spec:
            yield source, None
            return
        why = FaultMount.available()
        if why:
            raise SystemExit(f"--mount: no FUSE mount can be made here: {why}")
        mountpoint = tempfile.mkdtemp(prefix="ucm-rag-traffic-mnt-")
        try:
            with FaultMount(source, mountpoint) as mount:
                yield mountpoint, mount
        finally:
            shutil.rmtree(mountpoint, ignore_errors=True)
    finally:
        shutil.rmtree(source, ignore_errors=True)


def window_summary(records: list[dict], at: float, duration: float) -> dict:
    """Requests finished in the fault's window and in the minute after it (per second), and how
    long after the release the first request started that blended."""
    def rate(lo, hi):
        return sum(lo <= r["end_s"] < hi for r in records) / (hi - lo)

    end = at + duration
    blended_after = [r["start_s"] - end for r in records if r["start_s"] >= end and r.get("blended")]
    return {"window_requests_per_s": rate(at, end), "after_window_requests_per_s": rate(end, end + 60),
            "first_blend_after_release_s": min(blended_after) if blended_after else None}
