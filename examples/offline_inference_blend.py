"""Main job: answer multi-document questions by full prefill and by Blend; report TTFT and quality.

Runs with no argument on the embedded model (SmolLM2-135M-Instruct) and a generated data set
(4 questions x 6 passages x 250 words: a few minutes on 2 CPU cores).
Environment variables (UCM style) and flags:
  MODEL_PATH          --model      model directory (default: the embedded model, prepared on demand)
  DATA_DIR            --store-dir  KV store directory (default: a fresh temporary directory,
                                   removed at the end unless --keep-store)
  BLEND_DATASET_PATH  --dataset    CacheBlend JSON ({ctxs, question, answers}) or LongBench JSONL

Per question, one engine: every passage is first prefilled on its own (the indexing step that
stores each chunk's KV), then the whole prompt is answered three times, one request at a time:
by full prefill, by Blend at --ratio, and by full reuse (ratio 0). Before each answer vLLM's prefix
cache is emptied and the request leaves the store's exact prefix unused, so no answer is served
from an earlier one; Blend reuses chunk KV only.

Output: a progress bar with each question's answers above it (-q: the bar alone), then the tables.
vLLM logs at WARNING level and Python's deprecation warnings are hidden unless -v (or
VLLM_LOGGING_LEVEL / PYTHONWARNINGS say otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from ucm.eval.quiet import quiet_vllm

# Before vLLM is imported: the bar and the tables are what a user runs this for.
quiet_vllm(verbose=any(a in ("-v", "--verbose") for a in sys.argv[1:]))

from ucm.eval.modes import modes_for  # noqa: E402
from ucm.argparse_help import HelpFormatter  # noqa: E402
from ucm.eval.engine import (add_run_args, check_run_args, examples_and_model, kv_shift_note, run_on_engine,  # noqa: E402
                             run_store)
from ucm.eval.measure import BlendEvaluator, run_questions  # noqa: E402
from ucm.eval.summary import (TABLE_NOTES, format_counters, format_tables, summarize, unexpected_reports,  # noqa: E402
                              write_results_json)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL_PATH"),
                   help="model directory or a name of python -m ucm.models list (env MODEL_PATH)")
    p.add_argument("--store-dir", default=os.environ.get("DATA_DIR"), help="KV store directory (env DATA_DIR)")
    p.add_argument("--dataset", default=os.environ.get("BLEND_DATASET_PATH"), help="data set file (env BLEND_DATASET_PATH)")
    add_run_args(p, num_questions=4, passages=6, passage_words=250)
    p.add_argument("--keep-store", action="store_true", help="keep the temporary store directory")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print each question's answers")
    p.add_argument("-v", "--verbose", action="store_true", help="vLLM's INFO logs and Python's warnings too")
    p.add_argument("--out", default=None, help="also write the run as JSON (summary and every answer) to this file")
    args = p.parse_args(argv)
    check_run_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    examples, args.model = examples_and_model(args)
    modes = modes_for([args.ratio, 0.0], args.selections)
    started = time.time()
    with run_store(args, "ucm-blend-store-", keep=args.keep_store) as store:
        print(f"model: {args.model}\nstore: {store.path}{' (temporary)' if store.temporary else ''}\n"
              f"data:  {args.dataset or 'generated'} ({len(examples)} questions)\n"
              f"Blend: ratio {args.ratio:g}, {args.selections[0]} rule, {kv_shift_note(args)}", flush=True)
        results, counters = run_on_engine(args, store, lambda llm: run(llm, examples, modes, args))
    if not results:
        print("error: no question fits the engine (see the warnings above)", file=sys.stderr)
        return 1
    measurements = [m for r in results for m in r.measurements]

    tokens = [r.prompt_tokens for r in results]
    print(f"\n{len(results)} questions, prompts of {min(tokens)}-{max(tokens)} tokens "
          f"(mean {statistics.mean(tokens):.0f}); indexing step {statistics.mean(r.index_s for r in results):.2f}s "
          "per question (all passages, batched)\n")
    summaries = summarize(measurements, modes)
    print(format_tables(summaries))
    print("\n" + TABLE_NOTES)
    if counters:
        print("\nUCM connector counters of the whole run (indexing and warm-up included):\n" + format_counters(counters))
    problems = unexpected_reports(measurements)
    for line in problems:
        print(f"WARNING: {line}")
    if args.out:
        write_results_json(args.out, args, results, summaries, modes, started, counters)
        print(f"wrote {args.out}")
    return 0


def run(llm, examples, modes, args):
    from tqdm import tqdm

    def show(result, ex):
        if not args.quiet:
            tqdm.write(f"Q{result.question + 1} ({result.prompt_tokens} tokens): {ex.question}  gold: {ex.answers[0]!r}")
            for m in result.measurements:
                tqdm.write(f"    {m.mode:<12} TTFT {m.ttft_s:6.2f}s  -> {m.answer!r}")

    evaluator = BlendEvaluator(llm, max_tokens=args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                               index_alone=args.chunk_store == "alone")
    return run_questions(evaluator, examples, modes, on_question=show)


if __name__ == "__main__":
    sys.exit(main())
