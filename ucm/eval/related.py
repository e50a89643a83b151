"""FusionRAG-style indexing: each passage's KV computed with its most related passages before it.

Chunk KV stored after the system message alone has never attended to any other document, which
is what Blend's recompute must make up for at query time. FusionRAG prepares a chunk's KV with
the chunks most similar to it as context, so the stored KV already holds some cross-document
attention. Which passages are related is decided from the corpus alone (TF-IDF cosine over the
run's whole passage pool), never from the prompt a question will later be asked with.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

_WORD = re.compile(r"\w+")


def related_passages(passages: Sequence[str], k: int) -> list[list[int]]:
    """For each passage, the indices of the `k` others most similar to it by TF-IDF cosine, most
    similar first (ties: lower index first); identical texts are not each other's context."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    bags = [Counter(_WORD.findall(p.lower())) for p in passages]
    vocab = {w: i for i, w in enumerate(sorted({w for b in bags for w in b}))}
    n = len(passages)
    df = np.zeros(len(vocab))
    for b in bags:
        df[[vocab[w] for w in b]] += 1
    idf = np.log((1 + n) / (1 + df)) + 1.0
    m = np.zeros((n, len(vocab)))
    for i, b in enumerate(bags):
        for w, c in b.items():
            m[i, vocab[w]] = (1 + math.log(c)) * idf[vocab[w]]
    m /= np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)
    sim = m @ m.T
    out = []
    for i in range(n):
        order = sorted((j for j in range(n) if passages[j] != passages[i]), key=lambda j: (-sim[i, j], j))
        out.append(order[:k])
    return out
