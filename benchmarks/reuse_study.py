"""What to reuse, not which tokens to rank: a plain-PyTorch study of stored-KV variants.

The Blend forward's quality at a ratio is bounded by the ranking ceiling (the "oracle" selection
reaches what "query" does at 0.15 on the generated set): the loss comes from the stale KV of the
tokens that are not recomputed. This study changes what is reused, on the embedded model's own
weights in plain PyTorch (no vLLM: every variant is a mask over the same layer code), and measures
each variant against full prefill on the benchmark's prompts:

- ``reuse``: every chunk's stored KV (computed after the system message alone, delta-rotated).
- ``oracle R``: the oracle ranking of the Blend forward (the question's attention under full
  prefill times the V error, summed over layers); the top R of the loaded tokens are recomputed at
  every layer. The ranking ceiling.
- ``oracle R +start K``: the first K tokens of every chunk recomputed first, within R (EPIC + rule).
- ``chunks R``: whole chunks, most attended by the question first, then the oracle's tokens, R in all.
- ``band L``: every loaded token recomputed from layer L on, from its stored residual stream at
  layer L (a hidden state per token stored beside the KV); layers below L keep the stored KV.
  Costs (30 - L) / 30 of the context's prefill, like a ratio of that size.
- ``related K``: every chunk's KV computed after its K most related passages (FusionRAG), reused whole.
- ``+shift`` (``--shift``): the stored KV of every token not recomputed moved, at each layer, by the
  mean error of its chunk's recomputed tokens (ucm/sparse/blend/kv_shift.py); ``+true shift``: by
  the mean error of all the chunk's tokens against full prefill (a reference, not a method).

Metrics per question, as blend_bench.py: next-token KL to full prefill, teacher-forced over full
prefill's first 2 answer tokens, and whether the 16-token greedy answer is the same.

    python benchmarks/reuse_study.py --num-questions 50          # ~1.9k-token generated prompts -> JSON
"""

from __future__ import annotations

import argparse
import tempfile
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ucm.eval.datasets import generate_synthetic, load_dataset  # noqa: E402
from ucm.argparse_help import HelpFormatter  # noqa: E402
from ucm.eval.metrics import normalize_answer, short_answer  # noqa: E402
from ucm.eval.prompts import RELATED, build_prompt, chunk_end_token_id  # noqa: E402
from ucm.eval.related import related_passages  # noqa: E402
from ucm.sparse.blend.kv_shift import sampled_offsets  # noqa: E402
from ucm.sparse.blend.vocabulary import sample_stride  # noqa: E402

PROBE_QUERIES = 32  # the oracle's question rows, as the Blend forward's


class Llama:
    """The decoder's layers as plain functions over HF weights (gpt-fast style)."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cfg = self.hf.config
        self.layers = self.hf.model.layers
        self.n_layers, self.hq, self.hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [n, h, d] rotated by positions pos [n] (HF's rotate_half layout)."""
        ang = pos.double()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
        half = self.d // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def qkv(self, i: int, h: torch.Tensor, pos: torch.Tensor):
        layer = self.layers[i]
        x = self.norm(h, layer.input_layernorm.weight)
        a = layer.self_attn
        q = self.rope(a.q_proj(x).view(-1, self.hq, self.d), pos)
        k = self.rope(a.k_proj(x).view(-1, self.hkv, self.d), pos)
        return q, k, a.v_proj(x).view(-1, self.hkv, self.d)

    def attend(self, q, q_pos, k, v, k_pos, want_probs=False):
        g = self.hq // self.hkv
        kk = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [hq, nk, d]
        vv = v.repeat_interleave(g, dim=1).transpose(0, 1)
        s = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) / self.d ** 0.5  # [hq, nq, nk]
        s.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        p = s.softmax(-1)
        out = torch.matmul(p, vv).transpose(0, 1).reshape(q.shape[0], -1)
        return out, (p if want_probs else None)

    def finish(self, i: int, h, attn_out):
        layer = self.layers[i]
        h = h + layer.self_attn.o_proj(attn_out)
        x = self.norm(h, layer.post_attention_layernorm.weight)
        m = layer.mlp
        return h + m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))

    def logits(self, h):
        return self.hf.lm_head(self.norm(h, self.hf.model.norm.weight))

    def embed(self, ids):
        return self.hf.model.embed_tokens(torch.tensor(ids))


@dataclass
class Cache:
    """Per layer K (after RoPE at the prompt's positions) and V of every prompt token, and the
    residual stream entering each layer (hidden[i] is layer i's input)."""
    k: list
    v: list
    hidden: list


@dataclass
class Shift:
    """A KV shift variant: each row's chunk (-1 outside loaded chunks) and a reference Cache (the
    true error, from full prefill) or None (the computed rows' error); which of K and V move, the
    share of the estimate added, a distance scale for a position-local estimate (None: the chunk
    mean) and the rows allowed to estimate it (None: every computed row of the chunk)."""
    chunk_of: torch.Tensor
    reference: Cache | None = None
    parts: str = "kv"
    share: float = 1.0
    tau: float | None = None
    sources: torch.Tensor | None = None


def forward(model: Llama, ids: list[int], computed: list[torch.Tensor], stale: Cache | None,
            probe_rows: torch.Tensor | None = None, shift: Shift | None = None):
    """One prefill over `ids` where layer i computes only the rows `computed[i]` ([n] bool); the
    others keep `stale`'s KV. A row computed at layer i but not at i - 1 starts from `stale`'s
    residual stream at layer i. Returns (Cache of the result, hidden of the last layer, attention
    mass the `probe_rows` pay each row per layer or None).

    `shift` moves the stored K (before RoPE) and V of every row not computed by its chunk's
    error at that layer: measured on the chunk's computed rows, or with a reference, on all of its
    rows (`Shift`)."""
    n = len(ids)
    pos = torch.arange(n)
    h = model.embed(ids)
    ks, vs, hs, masses = [], [], [], []
    have = torch.ones(n, dtype=torch.bool)  # rows whose h is current at this layer
    for i in range(model.n_layers):
        rows = computed[i]
        if stale is not None:
            fresh_start = rows & ~have
            h = torch.where(fresh_start[:, None], stale.hidden[i], h)
        hs.append(h.clone())
        k = stale.k[i].clone() if stale is not None else torch.zeros(n, model.hkv, model.d)
        v = stale.v[i].clone() if stale is not None else torch.zeros(n, model.hkv, model.d)
        idx = torch.nonzero(rows).flatten()
        q, k_new, v_new = model.qkv(i, h[idx], pos[idx])
        k[idx], v[idx] = k_new, v_new
        if shift is not None and stale is not None:
            _shift_chunks(model, i, k, v, rows, stale, shift, pos)
        want = probe_rows is not None
        out, p = model.attend(q, pos[idx], k, v, pos, want_probs=want)
        if want:
            sel = probe_rows[idx]
            masses.append(p[:, sel, :].sum(dim=(0, 1)))
        h_new = h.clone()
        h_new[idx] = model.finish(i, h[idx], out)
        h = h_new
        have = rows.clone()
        ks.append(k)
        vs.append(v)
    return Cache(ks, vs, hs), h, (masses if probe_rows is not None else None)


def _shift_chunks(model, i, k, v, rows, stale, shift: Shift, pos) -> None:
    chunk_of, reference, sources, tau = shift.chunk_of, shift.reference, shift.sources, shift.tau
    for c in chunk_of.unique().tolist():
        if c < 0:
            continue
        mine = chunk_of == c
        src = mine if reference is not None else mine & rows
        if sources is not None:
            src = src & sources
        dst = mine & ~rows
        if not bool(src.any()) or not bool(dst.any()):
            continue
        fk = (reference.k[i] if reference is not None else k)[src]
        fv = (reference.v[i] if reference is not None else v)[src]
        ek = model.rope(fk, -pos[src]) - model.rope(stale.k[i][src], -pos[src])
        ev = fv - stale.v[i][src]
        if tau is None:
            dk, dv = ek.mean(0), ev.mean(0)
        else:  # each target's own estimate: nearby recomputed tokens' errors, shrunk to the chunk mean
            gap = (pos[dst][:, None] - pos[src][None, :]).abs().float()
            w = torch.exp(-gap / tau)
            prior = 1.0  # weight of the chunk mean, as one token at distance 0
            denom = w.sum(1, keepdim=True) + prior
            dk = (torch.einsum("ts,shd->thd", w, ek) + prior * ek.mean(0)) / denom[:, :, None]
            dv = (torch.einsum("ts,shd->thd", w, ev) + prior * ev.mean(0)) / denom[:, :, None]
        if "k" in shift.parts:
            k[dst] = model.rope(model.rope(k[dst], -pos[dst]) + shift.share * dk, pos[dst])
        if "v" in shift.parts:
            v[dst] = v[dst] + shift.share * dv


def chunk_spans(lengths: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return spans


def stale_cache(model: Llama, ids: list[int], spans, contexts: list[list[int]] | None = None) -> Cache:
    """Every chunk computed after the system chunk (and its related context), placed at its prompt
    positions: K delta-rotated, V and residual streams as computed."""
    n = len(ids)
    sys_a, sys_b = spans[0]
    ks = [torch.zeros(n, model.hkv, model.d) for _ in range(model.n_layers)]
    vs = [torch.zeros(n, model.hkv, model.d) for _ in range(model.n_layers)]
    hs = [torch.zeros(n, model.hq * model.d) for _ in range(model.n_layers)]
    for c, (a, b) in enumerate(spans):
        ctx = [] if c == 0 or contexts is None else contexts[c - 1]
        local = ids[sys_a:sys_b] + ctx + ids[a:b] if c else ids[a:b]
        m = len(local)
        cache, _, _ = forward(model, local, [torch.ones(m, dtype=torch.bool)] * model.n_layers, None)
        off = m - (b - a)  # where the chunk starts in its own run
        delta = torch.full((b - a,), a - off)
        for i in range(model.n_layers):
            ks[i][a:b] = model.rope(cache.k[i][off:], delta)
            vs[i][a:b] = cache.v[i][off:]
            hs[i][a:b] = cache.hidden[i][off:]
    return Cache(ks, vs, hs)


def answer_with(model: Llama, ids: list[int], computed, stale, forced: list[int], max_tokens: int, tok,
                shift: Shift | None = None):
    """(log-probs after the prompt and after each token of `forced`, greedy answer ids): the
    prompt's rows as `computed` says, answer rows computed at every layer (teacher-forced on
    `forced` for the log-probs, greedy from the prompt alone for the answer)."""
    n = len(ids)
    m = n + len(forced)
    ext = [torch.cat([c, torch.ones(m - n, dtype=torch.bool)]) for c in computed]
    stale_ext = None
    if stale is not None:
        pad = m - n
        stale_ext = Cache([torch.cat([k, torch.zeros(pad, *k.shape[1:])]) for k in stale.k],
                          [torch.cat([v, torch.zeros(pad, *v.shape[1:])]) for v in stale.v],
                          [torch.cat([h, torch.zeros(pad, h.shape[1])]) for h in stale.hidden])
    if shift is not None:  # the answer rows are in no chunk, have no reference and estimate nothing
        pad = m - n
        reference = shift.reference
        if reference is not None:
            reference = Cache([torch.cat([k, torch.zeros(pad, *k.shape[1:])]) for k in reference.k],
                              [torch.cat([v, torch.zeros(pad, *v.shape[1:])]) for v in reference.v], reference.hidden)
        sources = shift.sources
        shift = replace(shift, chunk_of=torch.cat([shift.chunk_of, torch.full((pad,), -1, dtype=torch.long)]),
                        reference=reference,
                        sources=None if sources is None else torch.cat([sources, sources.new_zeros(pad)]))
    cache, h, _ = forward(model, ids + forced, ext, stale_ext, shift=shift)
    lps = torch.log_softmax(model.logits(h[n - 1:]), -1)
    # Greedy: decode row by row over the prompt's KV, the first token from its last row.
    out = [int(lps[0].argmax())]
    ks = [k[:n] for k in cache.k]
    vs = [v[:n] for v in cache.v]
    while len(out) < max_tokens and out[-1] != tok.eos_token_id:
        p = len(ks[0])
        h1 = model.embed([out[-1]])
        pos = torch.tensor([p])
        for i in range(model.n_layers):
            q, k1, v1 = model.qkv(i, h1, pos)
            ks[i] = torch.cat([ks[i], k1])
            vs[i] = torch.cat([vs[i], v1])
            o, _ = model.attend(q, pos, ks[i], vs[i], torch.arange(p + 1))
            h1 = model.finish(i, h1, o)
        out.append(int(model.logits(h1)[0].argmax()))
    return lps, [t for t in out if t != tok.eos_token_id]


def kl(ref, other) -> float:
    return float(sum((r.exp() * (r - o)).sum() for r, o in zip(ref, other)) / len(ref))


def topk_mask(score: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    s = torch.where(candidates, score, torch.full_like(score, -float("inf")))
    out = torch.zeros_like(candidates)
    if k > 0:
        out[torch.topk(s, k).indices] = True
    return out & candidates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--num-questions", type=int, default=50)
    p.add_argument("--passages", type=int, default=6)
    p.add_argument("--passage-words", type=int, default=250)
    p.add_argument("--ratios", default="0.15,0.3")
    p.add_argument("--bands", default="26,21", help="first recomputed layer of the band variants")
    p.add_argument("--start-tokens", type=int, default=16)
    p.add_argument("--related", type=int, default=2)
    p.add_argument("--kl-tokens", type=int, default=2)
    p.add_argument("--shift", action="store_true", help="also the chunk-mean KV shift variants ('+shift': the "
                   "mean error of the recomputed tokens; '+true shift': of all the chunk's tokens under full prefill)")
    p.add_argument("--shift-parts", action="store_true", help="also the shift of V alone and of K alone")
    p.add_argument("--share", type=float, default=1.0, help="share of the estimated error the '+shift' variants add")
    p.add_argument("--local-shift", default="", help="comma-separated scales (tokens): '+local T' variants estimate "
                   "each token's error from its chunk's recomputed tokens weighted by exp(-distance / T), shrunk to the "
                   "chunk mean")
    p.add_argument("--sample", default="", help="comma-separated shares of the loaded tokens: '+sample F' variants "
                   "recompute every (1/F)-th token of each chunk within the ratio (the rest by the oracle) and estimate "
                   "the shift from those evenly spaced tokens alone, an unbiased sample of the chunk")
    p.add_argument("--model", default=None, help="a model of ucm.models' catalogue (default: the embedded one)")
    p.add_argument("--data", default=None, help="a data set (CacheBlend JSON) instead of the generated questions")
    p.add_argument("--skip-questions", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated variant name prefixes to run (default: all)")
    p.add_argument("--no-chunks", action="store_true", help="leave out the whole-chunk variants")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "reuse_study.json"),
                   help="JSON (committed results: benchmarks/results/reuse_study*.json, named explicitly)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    from ucm.models import prepare

    path = str(prepare(model=args.model) if args.model else prepare())
    model = Llama(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    marker = chunk_end_token_id(tok)
    if args.data:
        examples = load_dataset(args.data, limit=args.num_questions, skip=args.skip_questions)
    else:
        examples = generate_synthetic(num_examples=args.num_questions + args.skip_questions,
                                      passages_per_example=args.passages,
                                      passage_words=args.passage_words)[args.skip_questions:]
    pool = list(dict.fromkeys(q for ex in examples for q in ex.passages))
    related = {pool[i]: [pool[j] for j in js] for i, js in enumerate(related_passages(pool, args.related))}
    ratios = [float(r) for r in args.ratios.split(",") if r]
    bands = [int(b) for b in args.bands.split(",") if b]
    rows, started = [], time.time()
    for qi, ex in enumerate(examples):
        prompt = build_prompt(tok, ex, marker)
        ids, spans = prompt.token_ids, chunk_spans(prompt.chunk_lengths)
        n, L = len(ids), model.n_layers
        loaded = torch.zeros(n, dtype=torch.bool)
        for a, b in spans[1:]:
            loaded[a:b] = True  # the system chunk is an exact prefix: its stored KV is full prefill's
        question = torch.zeros(n, dtype=torch.bool)
        question[spans[-1][1]:] = True
        probe = torch.zeros(n, dtype=torch.bool)
        probe[max(spans[-1][1], n - PROBE_QUERIES):] = True
        everything = [torch.ones(n, dtype=torch.bool)] * L
        full_cache, _, masses = forward(model, ids, everything, None, probe_rows=probe)
        _, full_ids = answer_with(model, ids, everything, None, [], args.max_tokens, tok)
        forced = full_ids[:args.kl_tokens - 1]
        ref_lp, _ = answer_with(model, ids, everything, None, forced, 1, tok)
        full_text = tok.decode(full_ids)
        stale = stale_cache(model, ids, spans)
        # The oracle's score: the question's attention under full prefill x V error, over layers.
        score = torch.zeros(n)
        for i in range(L):
            err = (full_cache.v[i] - stale.v[i]).flatten(1).norm(dim=1)
            score += masses[i] * err
        starts = torch.zeros(n, dtype=torch.bool)
        for a, b in spans[1:]:
            starts[a:min(b, a + args.start_tokens)] = True
        num_loaded = int(loaded.sum())
        variants: dict[str, tuple] = {"reuse": ([~loaded] * L, stale)}
        chunk_of = torch.full((n,), -1, dtype=torch.long)
        for c, (a, b) in enumerate(spans[2:]):  # the first passage's stored KV is exact
            chunk_of[a:b] = c
        if args.shift:  # the whole error's mean, known from full prefill: no recompute at all
            variants["reuse +true shift"] = ([~loaded] * L, stale, Shift(chunk_of, full_cache))

        # Whole chunks, most attended per token first (under full prefill, as the oracle), until
        # the ratio's token count is reached; the rest of the budget by the oracle's ranking.
        attention = sum(masses[1:])
        chunk_order = sorted(spans[1:], key=lambda ab: -float(attention[ab[0]:ab[1]].mean()))
        for r in ratios:
            k = round(r * num_loaded)
            sel = topk_mask(score, loaded, k)
            variants[f"oracle {r:g}"] = ([~loaded | sel] * L, stale)
            if args.shift:
                variants[f"oracle {r:g} +shift"] = ([~loaded | sel] * L, stale, Shift(chunk_of, share=args.share))
                variants[f"oracle {r:g} +true shift"] = ([~loaded | sel] * L, stale, Shift(chunk_of, full_cache))
            for f in [float(t) for t in args.sample.split(",") if t]:
                even = torch.zeros(n, dtype=torch.bool)
                for a, b in spans[2:]:
                    even[a:b] = sampled_offsets(torch.arange(b - a), sample_stride(f))
                even &= loaded
                rest = topk_mask(score, loaded & ~even, max(0, k - int(even.sum())))
                chosen = [~loaded | even | rest] * L
                variants[f"oracle {r:g} +sample {f:g}"] = (chosen, stale, Shift(chunk_of, sources=even))
                variants[f"oracle {r:g} +sample {f:g} s{args.share:g}"] = (
                    chosen, stale, Shift(chunk_of, share=args.share, sources=even))
                variants[f"oracle {r:g} +sample {f:g} all"] = (chosen, stale, Shift(chunk_of, share=args.share))
            for tau in [float(t) for t in args.local_shift.split(",") if t]:
                variants[f"oracle {r:g} +local {tau:g}"] = ([~loaded | sel] * L, stale,
                                                           Shift(chunk_of, share=args.share, tau=tau))
            if args.shift_parts:
                variants[f"oracle {r:g} +shift v"] = ([~loaded | sel] * L, stale, Shift(chunk_of, parts="v"))
                variants[f"oracle {r:g} +shift k"] = ([~loaded | sel] * L, stale, Shift(chunk_of, parts="k"))
            if args.start_tokens:
                pinned = starts & loaded
                rest = topk_mask(score, loaded & ~pinned, max(0, k - int(pinned.sum())))
                variants[f"oracle {r:g} +start {args.start_tokens}"] = ([~loaded | pinned | rest] * L, stale)
            if args.no_chunks:
                continue
            whole = torch.zeros(n, dtype=torch.bool)
            for a, b in chunk_order:
                if int(whole.sum()) + (b - a) > k:
                    break
                whole[a:b] = True
            rest = topk_mask(score, loaded & ~whole, max(0, k - int(whole.sum())))
            variants[f"chunks {r:g}"] = ([~loaded | whole | rest] * L, stale)
        for b0 in bands:
            variants[f"band {b0}"] = ([~loaded] * b0 + [torch.ones(n, dtype=torch.bool)] * (L - b0), stale)
        if args.related:
            contexts = [[t for text in related[ex.passages[c]]
                         for t in tok.encode(RELATED.format(passage=text), add_special_tokens=False)]
                        for c in range(len(ex.passages))]
            rel = stale_cache(model, ids, spans, contexts)
            variants[f"related {args.related}"] = ([~loaded] * L, rel)
        if args.only:
            variants = {k: v for k, v in variants.items() if any(k.startswith(o) for o in args.only.split(","))}
        row = {"question": qi, "prompt_tokens": n, "full_answer": short_answer(full_text), "variants": {}}
        for name, (computed, cache, *shift) in variants.items():
            lp, out_ids = answer_with(model, ids, computed, cache, forced, args.max_tokens, tok,
                                      shift=shift[0] if shift else None)
            text = tok.decode(out_ids)
            cost = sum(int((c & loaded).sum()) for c in computed) / (L * num_loaded)
            row["variants"][name] = {
                "kl": kl(ref_lp, lp), "answer": short_answer(text),
                "agrees": normalize_answer(short_answer(text)) == normalize_answer(short_answer(full_text)),
                "cost": cost}
        rows.append(row)
        names = list(row["variants"])
        print(f"q{qi + 1}/{len(examples)} {n} tok {time.time() - started:.0f}s  " + "  ".join(
            f"{k}: {v['kl']:.3f}{'' if v['agrees'] else '*'}" for k, v in row["variants"].items()), flush=True)
        summary = {k: {"kl": statistics.fmean(r["variants"][k]["kl"] for r in rows),
                       "agree_pct": 100 * statistics.fmean(r["variants"][k]["agrees"] for r in rows),
                       "cost": statistics.fmean(r["variants"][k]["cost"] for r in rows)} for k in names}
        Path(args.out).write_text(json.dumps({"config": vars(args), "n": len(rows), "summary": summary,
                                              "questions": rows}, indent=1) + "\n")
    for k, v in summary.items():
        print(f"{k:<28} KL {v['kl']:.4f}  agree {v['agree_pct']:5.1f}%  cost {v['cost']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
