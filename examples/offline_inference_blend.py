"""Main job: answer multi-document questions and report time-to-first-token and answer quality.

Runs with no argument on the embedded model (SmolLM2-135M-Instruct) and a generated data set.
Environment variables (UCM style) and flags:
  MODEL_PATH          --model      model directory (default: the embedded model, prepared on demand)
  DATA_DIR            --store-dir  KV store directory shared by all engines
  BLEND_DATASET_PATH  --dataset    CacheBlend JSON ({ctxs, question, answers}) or LongBench JSONL

Status: Blend (the UCM connector and the sparse forward) is not implemented yet, so this job runs
the full-prefill baseline only and says so in its output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

from ucm.eval.datasets import DatasetError, QAExample, load_dataset
from ucm.eval.metrics import best_f1, short_answer
from ucm.eval.prompts import build_prompt, chunk_end_token_id


@dataclass
class Answer:
    mode: str
    question: str
    text: str
    ttft_s: float
    f1: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL_PATH"), help="model directory (env MODEL_PATH)")
    p.add_argument("--store-dir", default=os.environ.get("DATA_DIR"), help="KV store directory (env DATA_DIR)")
    p.add_argument("--dataset", default=os.environ.get("BLEND_DATASET_PATH"), help="data set file (env BLEND_DATASET_PATH)")
    p.add_argument("--num-questions", type=int, default=4)
    p.add_argument("--passages", type=int, default=6, help="passages per generated question")
    p.add_argument("--passage-words", type=int, default=250, help="words per generated passage")
    p.add_argument("--max-tokens", type=int, default=16)
    return p.parse_args(argv)


def generate_one(llm, token_ids: list[int], max_tokens: int) -> tuple[str, float]:
    """One request at a time, so its TTFT is not shared with other requests of a batch."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    metrics = getattr(out, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", 0.0) or wall
    return out.outputs[0].text, ttft


def run_mode(llm, mode: str, examples: list[QAExample], max_tokens: int) -> list[Answer]:
    tokenizer = llm.get_tokenizer()
    marker = chunk_end_token_id(tokenizer)
    answers = []
    for i, ex in enumerate(examples, 1):
        prompt = build_prompt(tokenizer, ex, marker)
        text, ttft = generate_one(llm, prompt.token_ids, max_tokens)
        answers.append(Answer(mode, ex.question, text, ttft, best_f1(short_answer(text), list(ex.answers))))
        print(f"[{mode}] {i}/{len(examples)} ({len(prompt.token_ids)} tokens, TTFT {ttft:.2f}s) "
              f"Q: {ex.question} -> {short_answer(text)!r}  gold: {ex.answers[0]!r}", flush=True)
    return answers


def print_summary(answers: list[Answer]) -> None:
    print("\nmode            mean TTFT  median TTFT  mean F1")
    for mode in dict.fromkeys(a.mode for a in answers):
        rows = [a for a in answers if a.mode == mode]
        ttfts = [a.ttft_s for a in rows]
        print(f"{mode:<14} {statistics.mean(ttfts):9.2f}s {statistics.median(ttfts):11.2f}s "
              f"{statistics.mean(a.f1 for a in rows):8.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        examples = load_dataset(args.dataset, limit=args.num_questions, num_examples=args.num_questions,
                                passages_per_example=args.passages, passage_words=args.passage_words)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.model:
        from ucm.models import prepare

        args.model = str(prepare())
    print("NOTE: Blend is not implemented yet; this run computes the full-prefill baseline only.", flush=True)

    from ucm.integration.vllm.llm import make_llm

    llm = make_llm(args.model, disable_log_stats=False)
    answers = run_mode(llm, "full prefill", examples, args.max_tokens)
    print_summary(answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
