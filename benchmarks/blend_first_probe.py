"""Head-of-line blocking, step by step: a blend request (its chunks stored, passages reordered)
arrives while a ~6k-token prefill of new text runs, alone or with another new prompt waiting
before it. Its TTFT there against its TTFT alone, under vLLM's scheduler and BlendFirstScheduler,
each in its own engine. Deterministic where the serving stream (rag_traffic.py) is not: the same
arrivals every run, one request pattern at a time.

    python benchmarks/blend_first_probe.py --out benchmarks/results/blend_first_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from ucm.argparse_help import HelpFormatter

SCHEDULERS = {"vllm": "vllm.v1.core.sched.scheduler.Scheduler",
              "blend_first": "ucm.integration.vllm.connector.blend_first_scheduler.BlendFirstScheduler"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--schedulers", default="vllm,blend_first", help=f"comma-separated, of {', '.join(SCHEDULERS)}")
    p.add_argument("--passages", type=int, default=10, help="passages per prompt")
    p.add_argument("--words", type=int, default=400, help="words per passage")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vLLM's step budget")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "blend_first_probe.json"))
    return p.parse_args(argv)


def prompt_ids(tok, seed: int, passages: int, words: int, reverse: bool = False) -> list[int]:
    from ucm.eval.datasets import generate_synthetic
    from ucm.eval.prompts import build_prompt, chunk_end_token_id

    ex = generate_synthetic(num_examples=1, passages_per_example=passages, passage_words=words, seed=seed)[0]
    order = list(range(passages))[::-1] if reverse else list(range(passages))
    return build_prompt(tok, ex, chunk_end_token_id(tok), order=order).token_ids


def measure(scheduler: str, args) -> dict:
    from vllm import SamplingParams

    from ucm.integration.vllm.llm import make_llm, shutdown, ucm_transfer_config
    from ucm.models import default_model_dir

    llm = make_llm(str(default_model_dir()), scheduler_cls=SCHEDULERS[scheduler], disable_log_stats=False,
                   kv_transfer_config=ucm_transfer_config(tempfile.mkdtemp(prefix="ucm-probe-"), blend_ratio=0.15),
                   max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        tok, engine = llm.get_tokenizer(), llm.llm_engine
        params = SamplingParams(max_tokens=2, temperature=0.0)
        blend = prompt_ids(tok, 150, args.passages, args.words, reverse=True)
        new = [prompt_ids(tok, 160 + i, args.passages, args.words) for i in range(3)]
        llm.generate([{"prompt_token_ids": prompt_ids(tok, 150, args.passages, args.words)}], params, use_tqdm=False)

        def run(case: list[tuple[str, list[int]]]) -> dict[str, float]:
            """The first request runs one step before the others arrive; TTFT of each (s)."""
            llm.reset_prefix_cache()
            outs = {}
            for i, (name, ids) in enumerate(case):
                engine.add_request(name, {"prompt_token_ids": ids}, params)
                if i == 0 and len(case) > 1:
                    outs.update({o.request_id: o for o in engine.step() if o.finished})
            while engine.has_unfinished_requests():
                outs.update({o.request_id: o for o in engine.step() if o.finished})
            assert (outs["blend"].kv_transfer_params or {}).get("ucm", {}).get("blended"), "the probe did not blend"
            return {name: round(o.metrics.first_token_latency, 2) for name, o in outs.items()}

        return {"scheduler": SCHEDULERS[scheduler], "prompt_tokens": len(blend),
                "alone": run([("blend", blend)]),
                "behind_running": run([("new", new[0]), ("blend", blend)]),
                "behind_running_and_waiting": run([("new", new[1]), ("waiting", new[2]), ("blend", blend)])}
    finally:
        shutdown(llm)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    results = {"config": vars(args), "runs": []}
    for name in args.schedulers.split(","):
        run = measure(name, args)
        alone = run["alone"]["blend"]
        run["blend_vs_alone"] = {case: round(run[case]["blend"] / alone, 2)
                                 for case in ("behind_running", "behind_running_and_waiting")}
        results["runs"].append(run)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(name, json.dumps({k: v for k, v in run.items() if k != "scheduler"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
