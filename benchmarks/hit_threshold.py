"""Where Blend starts to pay: TTFT of one request alone against the share of its passages cached.

For each question, k of its passages (k in --hits) are indexed alone under a tenant of their own,
then the question's prompt (passages in order) is sent once with Blend (min_hit_share 0: blended
whatever the hits) and compared with full prefill of the same prompt (Blend off, a tenant with
nothing cached). The hit share below which Blend is slower than full prefill is where
`min_hit_share` belongs (docs/serving.md). One engine, one request at a time.

    python benchmarks/hit_threshold.py                       # 3 MuSiQue questions, k = 0,1,2,3,5,10
    python benchmarks/hit_threshold.py --out benchmarks/results/hit_threshold.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from ucm.eval.prompts import build_prompt, chunk_end_token_id
from ucm.argparse_help import HelpFormatter

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL_PATH"),
                   help="model directory or a name of python -m ucm.models list (env MODEL_PATH; default: the "
                        "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-questions", type=int, default=3)
    p.add_argument("--hits", default="0,1,2,3,5,10", help="passages cached per measurement (comma-separated)")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--generated", action="store_true", help="generated questions even if MuSiQue is present")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "hit_threshold.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    from vllm import SamplingParams

    from ucm.eval.datasets import generate_synthetic, load_dataset
    from ucm.integration.vllm.llm import make_llm, shutdown, ucm_transfer_config
    from ucm.models import model_path

    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the engine computes on every core
    hits = [int(k) for k in args.hits.split(",")]
    examples = (load_dataset(DEFAULT_DATASET, limit=args.num_questions)
                if DEFAULT_DATASET.is_file() and not args.generated else generate_synthetic(args.num_questions))
    from transformers import AutoTokenizer

    model = model_path(args.model)
    marker = chunk_end_token_id(AutoTokenizer.from_pretrained(model))  # the model's own <|im_end|>
    store = tempfile.mkdtemp(prefix="ucm-hit-threshold-")
    ktc = ucm_transfer_config(store, blend_ratio=args.ratio, chunk_end_token_id=marker)
    ktc.kv_connector_extra_config["ucm_sparse_config"]["Blend"]["min_hit_share"] = 0.0
    llm = make_llm(model, kv_transfer_config=ktc, dtype=args.dtype)
    tok = llm.get_tokenizer()

    def timed(token_ids, salt, **kv):
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": kv})
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": token_ids, "cache_salt": salt}], params, use_tqdm=False)[0]
        return time.perf_counter() - start, (out.kv_transfer_params or {}).get("ucm", {})

    rows = []
    try:
        for q, ex in enumerate(examples):
            prompt = build_prompt(tok, ex, marker)
            full_s, _ = timed(prompt.token_ids, f"full-{q}", ucm_disable_blend=True)
            for k in hits:
                salt = f"q{q}-k{k}"
                offset = prompt.chunk_lengths[0]
                for n in prompt.chunk_lengths[1:1 + k]:  # each passage alone: its chunk KV
                    timed(prompt.token_ids[offset:offset + n], salt)
                    offset += n
                time.sleep(2)  # the indexing dumps land: the request would wait for them (dump_waits)
                blend_s, report = timed(prompt.token_ids, salt)
                region = report["prompt_tokens"] - report["external_prefix_tokens"]
                rows.append({"question": q, "passages_cached": k, "prompt_tokens": report["prompt_tokens"],
                             "hit_share": report["chunk_hit_tokens"] / region if region else 0.0,
                             "blended": report["blended"], "blend_s": blend_s, "full_s": full_s})
                print(f"q{q} k={k:2d}: hit share {rows[-1]['hit_share']:.2f}, Blend {blend_s:.2f} s, "
                      f"full prefill {full_s:.2f} s ({full_s / blend_s:.2f}x)", flush=True)
                Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    finally:
        shutdown(llm)
    print("\n| passages cached | hit share | Blend TTFT | full prefill TTFT | speed-up |\n|---|---|---|---|---|")
    for k in hits:
        sel = [r for r in rows if r["passages_cached"] == k]
        b, f = statistics.median(r["blend_s"] for r in sel), statistics.median(r["full_s"] for r in sel)
        share = statistics.median(r["hit_share"] for r in sel)
        print(f"| {k} | {share:.2f} | {b:.2f} s | {f:.2f} s | {f / b:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
