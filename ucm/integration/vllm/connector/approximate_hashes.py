"""Blocks holding blended (approximate) KV get hashes no other request can match.

vLLM registers a request's full blocks in its prefix cache under `request.block_hashes` when it
allocates them; approximate KV must never be served as an exact prefix, so the hashes from the
first approximate block on are replaced by request-unique ones (blocks appended later chain from
them and are unique too), and restored when the request is planned again or preempted.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


class ApproximateHashes:
    def __init__(self):
        self._originals: dict[str, list[bytes]] = {}  # req_id -> block hashes before salting

    def salt(self, request: Request, from_block: int, generation: int = 0) -> None:
        """Request-unique hashes from `from_block` on. A preempted request blends anew under a new
        `generation`: its old blended blocks may still sit in vLLM's cache."""
        if request.request_id in self._originals:
            return
        original = list(request.block_hashes)
        self._originals[request.request_id] = original
        salt = b"ucm-blend-approx" + request.request_id.encode() + generation.to_bytes(4, "little")
        for i in range(from_block, len(original)):
            request.block_hashes[i] = hashlib.sha256(salt + original[i]).digest()[: len(original[i])]

    def restore(self, request: Request) -> None:
        original = self._originals.pop(request.request_id, None)
        if original is not None:
            request.block_hashes[:len(original)] = original

    def original(self, request: Request) -> list[bytes]:
        """The request's exact-prefix hashes, also after its tail was salted."""
        original = self._originals.get(request.request_id)
        return original if original is not None else list(request.block_hashes)

    def forget(self, req_id: str) -> None:
        self._originals.pop(req_id, None)
