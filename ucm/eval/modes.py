"""What the evaluation compares: full prefill and Blend at each ratio and selection rule."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ucm.config import BLEND_SELECTIONS, QUERY_SELECTION
from ucm.sparse.blend.vocabulary import MAX_SHIFT_SAMPLE, Selection, check_ratio, shift_sample_share

DEFAULT_CHECK_LAYER = 1  # the layer whose deviation ranks (compute_meta's key names it)
DEFAULT_RATIO = 0.3  # docs/research.md, "Every rule on the 1.5B": the larger models need it
SWEEP_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
REPORT_KEY = "ucm"  # RequestOutput.kv_transfer_params[REPORT_KEY]: what the cache did


@dataclass(frozen=True)
class Mode:
    name: str
    ratio: float | None  # None: full prefill (Blend disabled for the request)
    selection: str | None = None  # how Blend ranks the tokens it recomputes; None: ratio 0 or 1 (no ranking)
    # Tokens per loaded chunk recomputed first: the "chunk_start" selection's k (all it recomputes),
    # or EPIC's rows combined with a ranked rule (within the ratio); None: the rule's default.
    chunk_start_tokens: int | None = None
    # Share of its chunk's mean error the reused KV is moved by (sparse/blend/kv_shift.py); None: the engine's.
    kv_shift: float | None = None
    # Share of every loaded chunk's tokens, evenly spaced, recomputed to estimate that shift alone; None: the engine's.
    kv_shift_sample: float | None = None

    @property
    def is_full(self) -> bool:
        return self.ratio is None


FULL_PREFILL = Mode("full prefill", None)


def blend_mode(ratio: float, selection: str = QUERY_SELECTION) -> Mode:
    """"blend R" ranks by the question's attention (the default), "hkvd R" by deviation alone
    (CacheBlend's rule), "oracle R" by a full prefill (diagnostic); ratio 0 ("full reuse") and 1 ("blend 1") rank
    nothing, so they are one mode."""
    check_ratio(ratio, "Blend ratio")
    if Selection.parse(selection) is None:
        raise ValueError(f"selection must be one of {', '.join(BLEND_SELECTIONS)}, got {selection!r}")
    if ratio == 0:
        return Mode("full reuse", 0.0)
    if ratio == 1:
        return Mode("blend 1", 1.0)
    prefix = "blend" if selection == QUERY_SELECTION else selection
    return Mode(f"{prefix} {ratio:g}", float(ratio), selection)


def modes_for(ratios: Iterable[float], selections: Iterable[str] = (QUERY_SELECTION,)) -> list[Mode]:
    """Full prefill (the reference every other mode is compared with) first, then each ratio
    for each selection rule."""
    modes = [FULL_PREFILL]
    for selection in selections:
        for r in ratios:
            m = blend_mode(r, selection)
            if m not in modes:
                modes.append(m)
    return modes


def chunk_start_mode(k: int) -> Mode:
    """EPIC's rule: the first k tokens of every loaded chunk, whatever the ratio (shown as 0)."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"chunk_start tokens must be a positive int, got {k!r}")
    return Mode(f"chunk_start {k}", 0.0, Selection.CHUNK_START.label, k)


def plus_chunk_start(modes: Iterable[Mode], k: int) -> list[Mode]:
    """Each ranked mode again with EPIC's first k tokens of every chunk recomputed first, within
    its ratio ("blend 0.15 +start 16")."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"chunk_start tokens must be a positive int, got {k!r}")
    return [Mode(f"{m.name} +start {k}", m.ratio, m.selection, k) for m in modes
            if m.selection not in (None, Selection.CHUNK_START.label) and m.chunk_start_tokens is None]


def plus_kv_shift(modes: Iterable[Mode], share: float = 1.0) -> list[Mode]:
    """Each ranked mode again with the chunk-mean KV shift at `share` ("blend 0.15 +shift" for the
    whole mean, "blend 0.15 +shift 0.5" for half of it, "+shift 0" for none)."""
    check_ratio(share, "kv_shift share")
    suffix = "+shift" if share == 1 else f"+shift {share:g}"
    return [Mode(f"{m.name} {suffix}", m.ratio, m.selection, m.chunk_start_tokens, float(share)) for m in modes
            if m.selection not in (None, Selection.CHUNK_START.label) and m.kv_shift is None]


def plus_shift_sample(modes: Iterable[Mode], sample: float, share: float = 1.0) -> list[Mode]:
    """Each ranked mode again with the KV shift at `share` estimated from an evenly spaced `sample`
    of every loaded chunk's tokens, recomputed within its ratio ("blend 0.15 +sample 0.03")."""
    check_ratio(share, "kv_shift share")
    if not (sample > 0 and shift_sample_share(sample) is not None):
        raise ValueError(f"kv_shift_sample must be in (0, {MAX_SHIFT_SAMPLE:g}], got {sample!r}")
    suffix = f"+sample {sample:g}" + ("" if share == 1 else f" shift {share:g}")
    return [Mode(f"{m.name} {suffix}", m.ratio, m.selection, m.chunk_start_tokens, float(share), float(sample))
            for m in modes if m.selection not in (None, Selection.CHUNK_START.label) and m.kv_shift is None]


def pareto_modes(ratios: Iterable[float], selections: Iterable[str], chunk_start_ks: Iterable[int]) -> list[Mode]:
    """Full prefill, full reuse, every ranked rule at every ratio in (0, 1), EPIC at every k, and
    ratio 1: the points of a quality-vs-TTFT frontier."""
    modes = modes_for([0.0], [QUERY_SELECTION])
    for selection in selections:
        if selection == Selection.CHUNK_START.label:
            continue
        modes += [blend_mode(r, selection) for r in ratios if 0 < r < 1]
    modes += [chunk_start_mode(k) for k in chunk_start_ks]
    return modes + [blend_mode(1.0)]


def parse_selections(text: str) -> list[str]:
    """'query,hkvd' -> ['query', 'hkvd'] (argparse type; any of BLEND_SELECTIONS)."""
    selections = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in selections if x not in BLEND_SELECTIONS]
    if bad or not selections:
        raise ValueError(f"selections must be a comma-separated list of {', '.join(BLEND_SELECTIONS)}, got {text!r}")
    return selections


def parse_ratios(text: str) -> list[float]:
    """'0,0.15,1' -> [0.0, 0.15, 1.0] (argparse type)."""
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"ratios must be comma-separated numbers, got {text!r}") from exc
    for r in ratios:
        blend_mode(r)
    if not ratios:
        raise ValueError("no ratio given")
    return ratios
