"""Answer metrics: SQuAD-style F1 (what CacheBlend reports for MuSiQue and friends) and a
next-token KL from the top-k lists a server returns."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: list[str]) -> float:
    return max((token_f1(prediction, r) for r in references), default=0.0)


def short_answer(text: str) -> str:
    """Models keep talking after the answer; score its first sentence of the first line only."""
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    return _SENTENCE_END.split(line, maxsplit=1)[0].rstrip(".")


def bootstrap_ci(values: Sequence[float], level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean over questions (None below 2 values).

    Answer quality moves in steps of one question, so a mean over a few dozen questions needs its
    interval next to it before two modes or two runs are compared. Seeded: a report is reproducible.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.size < 2:
        return None
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)


def paired_speedup(reference: dict, other: dict) -> tuple[float, tuple[float, float] | None] | None:
    """The geometric mean over shared keys of reference / other (e.g. plain vLLM's TTFT over Blend's,
    request by request) with the bootstrap interval of it; None without shared keys. A median of a
    stream's TTFTs jumps when a few requests move between bursts; paired ratios do not."""
    logs = [math.log(reference[k] / other[k]) for k in reference.keys() & other.keys() if reference[k] > 0 < other[k]]
    if not logs:
        return None
    ci = bootstrap_ci(logs)
    return math.exp(sum(logs) / len(logs)), (None if ci is None else (math.exp(ci[0]), math.exp(ci[1])))


def top_k_kl(reference: dict[int, float], other: dict[int, float]) -> float:
    """KL(reference || other) from two top-k next-token lists (token id -> log-probability), as a
    server returns them: over the tokens both lists show, plus one bin for every other token.
    Merging tokens into one bin never increases a KL, so this is a lower bound of the full one,
    exact when both lists cover the vocabulary."""
    both = list(reference.keys() & other.keys())
    p = [math.exp(reference[t]) for t in both]
    q = [math.exp(other[t]) for t in both]
    kl = sum(a * (reference[t] - other[t]) for a, t in zip(p, both))
    p_rest, q_rest = 1.0 - sum(p), 1.0 - sum(q)
    if p_rest > 1e-9:  # rounding leaves ~1e-16 where the lists are the whole distribution
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
    return max(0.0, kl)
