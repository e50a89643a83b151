"""LoRA adapter identity by content, for the store keys of a request served with an adapter.

vLLM's block hashes name an adapter by its name and path only, so an adapter retrained in place
(same name, same path, new weights) would read the old adapter's KV from a persistent store. Its
requests' keys therefore also carry this digest, taken as `model_digest` takes a model's:

- `adapter_config.json`, canonicalised, without `base_model_name_or_path` (a path; the base model
  is in the store namespace already) and `peft_version` (the writer's version);
- every weight file directly in the directory, by name, size and sampled windows.

The directory's path does not enter: one adapter's files at two paths give one digest. A digest
is reused while its files keep their sizes, mtimes and inodes, so a request costs a directory
listing and a few stats. An adapter that cannot be read (no such directory, no adapter_config.json
or no weight file, a hub id not downloaded yet) has no digest: its requests are neither looked up
nor stored, rather than stored under a guessed identity.

The digest is of the files as they are when a request is planned, while vLLM keeps an adapter it
has loaded (by id) until it is evicted or reloaded (`load_inplace`): reload an adapter retrained in
place, or its KV would be computed with the old weights and stored under the new digest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections import OrderedDict

from ucm.integration.vllm.connector.model_identity import DIGEST_BYTES, WEIGHT_SUFFIXES, hash_directory, resolve_local

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
# adapter_config.json keys that say where or by what the file was written, not what the adapter is.
_CONFIG_IGNORED = ("base_model_name_or_path", "peft_version")
CACHE_LIMIT = 256  # adapters whose digest is kept; the least recently used beyond it is recomputed when met again

# What the digest was taken from: (name, size, mtime_ns, inode) of the config and each weight file.
Stamp = tuple[tuple[str, int, int, int], ...]


def _stamp(local: str) -> Stamp:
    """What the digest would be taken from; raises OSError for a directory vLLM could not load."""
    out = []
    for name in sorted(os.listdir(local)):
        if name == ADAPTER_CONFIG or name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(local, name))
            if stat.S_ISREG(st.st_mode):
                out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    if not any(name == ADAPTER_CONFIG for name, *_ in out):
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {local}")
    if not any(name != ADAPTER_CONFIG for name, *_ in out):
        raise FileNotFoundError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {local}")
    return tuple(out)


def _resolve(lora_path: str) -> str:
    """The adapter's local directory: the path (`~` expanded) or the Hugging Face cache snapshot
    of a hub id that vLLM downloaded (never downloads anything)."""
    local = resolve_local(os.path.expanduser(lora_path), None, None)
    if local is None:
        raise FileNotFoundError(f"{lora_path} is neither a local directory nor a downloaded hub id")
    return local


def _digest(local: str) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ucm-lora-id")
    hash_directory(h, local, ADAPTER_CONFIG, _CONFIG_IGNORED)
    return h.hexdigest()


def adapter_digest(lora_path: str) -> str:
    """Hex digest (32 characters) of the adapter's config and weight files (module doc); raises
    OSError when the adapter cannot be read."""
    local = _resolve(lora_path)
    _stamp(local)  # refuses a directory without config or weights
    return _digest(local)


class AdapterDigests:
    """Adapter digests by local path, taken again only when the files' stamp changes."""

    def __init__(self, limit: int = CACHE_LIMIT):
        self.limit = limit
        self._cache: OrderedDict[str, tuple[Stamp, str]] = OrderedDict()
        self._warned: set[str] = set()

    def digest(self, lora_path: str) -> str | None:
        """The adapter's digest; None when it cannot be read (logged once per path)."""
        try:
            local = _resolve(lora_path)
            stamp = _stamp(local)
            cached = self._cache.get(local)
            if cached is not None and cached[0] == stamp:
                self._cache.move_to_end(local)
                return cached[1]
            digest = _digest(local)
        except OSError as exc:
            if lora_path not in self._warned:
                self._warned.add(lora_path)
                logger.warning("LoRA adapter %s cannot be read (%s): its requests are computed without the KV "
                               "store (fallback adapter_unreadable)", lora_path, exc)
            return None
        self._warned.discard(lora_path)
        self._cache[local] = (stamp, digest)  # the stamp from before hashing: a change meanwhile is hashed again
        self._cache.move_to_end(local)
        while len(self._cache) > self.limit:
            self._cache.popitem(last=False)
        return digest
