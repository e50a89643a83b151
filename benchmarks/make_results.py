"""Writes docs/results.md, and the headline table of README.md, from the JSON the benchmarks wrote.

    python benchmarks/make_results.py          # rewrite both from benchmarks/results/*.json

Numbers are never copied by hand: every table below is printed from a result file, next to the
command that wrote it. A result file that is absent is listed as not run.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ucm.eval.metrics import bootstrap_ci, paired_speedup

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs" / "results.md"
HISTORY = REPO / "docs" / "results-history.md"
README = REPO / "README.md"
HEADLINE_BEGIN, HEADLINE_END = "<!-- results:headline -->", "<!-- /results:headline -->"

# (file, title, command that wrote it)
HEADLINE_RUN = "blend_bench_musique100_bf16_query.json"  # the README's offline rows: all of MuSiQue, the defaults
EVAL_RUNS = [
    ("blend_bench_musique100_bf16_query.json", "MuSiQue, 100 questions, bfloat16, the defaults with the committed query "
     "rule (squared per-layer shares of the question's attention, 2026-11-29, a fifteenth session; AVX-512-BF16 "
     "host, a few unit tests beside it)",
     "python benchmarks/blend_bench.py --num-questions 100 --no-plot --dtype bfloat16 --selections query --ratio 0.15 "
     "--kl-tokens 1 --out benchmarks/results/blend_bench_musique100_bf16_query.json"),
    ("blend_bench_musique100_bf16_attention.json", "MuSiQue, 100 questions, bfloat16, the defaults with the query rule "
     "by attention alone (2026-11-28, an eleventh session; AVX-512-BF16 host, nothing else running but a few "
     "unit tests)",
     "python benchmarks/blend_bench.py --num-questions 100 --no-plot --dtype bfloat16 --selections query --ratio 0.15 "
     "--kl-tokens 1 --out benchmarks/results/blend_bench_musique100_bf16_attention.json"),
    ("blend_bench_musique100_bf16_shift.json", "MuSiQue, 100 questions, bfloat16, the default kv_shift (0.5)",
     "python benchmarks/blend_bench.py --num-questions 100 --no-plot --dtype bfloat16 --selections query "
     "--out benchmarks/results/blend_bench_musique100_bf16_shift.json"),
    ("blend_pareto_musique.json", "Quality against TTFT, every rule (MuSiQue, next-token KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --pareto --num-questions 8 --ratios 0.15,0.3 --chunk-start 16,32 "
     "--kl-tokens 2 --out benchmarks/results/blend_pareto_musique.json"),
    ("blend_pareto_generated.json", "Quality against TTFT, every rule (generated set, next-token KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --pareto --generated --num-questions 6 --ratios 0.15,0.3 --chunk-start 16 "
     "--kl-tokens 2 --out benchmarks/results/blend_pareto_generated.json"),
    ("blend_bench_musique100_bf16.json", "MuSiQue, 100 questions, bfloat16",
     "python benchmarks/blend_bench.py --num-questions 100 --no-plot --dtype bfloat16 --selections query "
     "--out benchmarks/results/blend_bench_musique100_bf16.json"),
    ("blend_bench_musique100.json", "MuSiQue, 100 questions, float32 (earlier host)",
     "python benchmarks/blend_bench.py --num-questions 100 --no-plot --out benchmarks/results/blend_bench_musique100.json"),
    ("blend_bench.json", "MuSiQue, 8 questions, every ratio, both rankings",
     "python benchmarks/blend_bench.py --num-questions 8 --sweep"),
    ("blend_bench_generated200_ratios.json", "Generated set, 200 questions, several ratios",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 200 --sweep "
     "--ratios 0,0.15,0.3,0.5 --selections query --no-plot --out benchmarks/results/blend_bench_generated200_ratios.json"),
    ("main_job_generated200_bf16.json", "Generated set, 200 questions, bfloat16 (main job)",
     "python examples/offline_inference_blend.py --num-questions 200 -q --dtype bfloat16 "
     "--out benchmarks/results/main_job_generated200_bf16.json"),
    ("chunk_store_any.json", "Chunk store policy 'any' (default), MuSiQue, 16 questions",
     "python examples/offline_inference_blend.py --dataset ../shared/data/musique_dev.json --num-questions 16 -q "
     "--chunk-store any --out benchmarks/results/chunk_store_any.json"),
    ("chunk_store_alone.json", "Chunk store policy 'alone', MuSiQue, 16 questions",
     "python examples/offline_inference_blend.py --dataset ../shared/data/musique_dev.json --num-questions 16 -q "
     "--chunk-store alone --out benchmarks/results/chunk_store_alone.json"),
]
# The latest quality runs, shown first: models that can answer, and the query rule's regression
# (2026-11-27, fourth session; an AVX2 host, float32).
_Q = "python benchmarks/blend_bench.py"
_VARIANTS = ("experiment modes (a patch not kept, the same forward otherwise): query_vn weighs each head's "
             "attention by the token's V norm over every layer after the check layer, query_late counts the second "
             "half of the layers, query_vnl both (the rule adopted), query_vnl3 / query_vnl23 from a third / two "
             "thirds of the depth, query_headmax the largest head's mass per layer, query_vnhl the largest head's "
             "V-weighted mass over the second half")
_HELD = (f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 "
         "--max-tokens 4 --kl-tokens 1 --sweep --ratios 0.15 --no-plot")
_SHARES = ("experiment modes (a patch not kept, the same forward otherwise; blend 0.15 is the rule before): "
           "query_all weighs V norms over every layer after the check layer, query_norm counts each scored layer's "
           "mass as shares of the request's total, query_maxl the largest share over the layers, query_sq the sum "
           "of squared shares (the rule adopted)")
_KERNEL = (f"{_Q} --dtype bfloat16 --num-questions 6 --sweep --ratios 0.15 --selections query --kl-tokens 1 "
           "--max-tokens 4 --no-plot --enforce-eager")
_KERNEL_HOST = "SmolLM2 on 6 MuSiQue questions, ratio 0.15, bfloat16, eager, an AMD EPYC host with AVX-512-BF16"
_AMX_HOST = "an Intel Xeon host with AMX (2026-12-01, a twentieth session), back to back, nothing else running"
_LW = f"{_Q} --dtype bfloat16 --num-questions 3 --sweep --ratios 0.15 --selections query,hkvd --kl-tokens 1 --max-tokens 4 --no-plot"
_LW_HOST = ("SmolLM2 on 3 MuSiQue questions, fully cached (every passage indexed), ratio 0.15, bfloat16, compiled, an "
            "AMD EPYC host with AVX-512-BF16 (2 cores), the four runs back to back (2026-12-07, a twenty-seventh session)")
_LW_HOST28 = ("SmolLM2 on the same 3 MuSiQue questions, fully cached, ratio 0.15, bfloat16, compiled, an AMD EPYC host "
              "with AVX-512-BF16 (2 cores), the three runs back to back (2026-12-07, a twenty-eighth session)")
_LW_HOST29 = ("SmolLM2 on the same 3 MuSiQue questions, fully cached, ratio 0.15, bfloat16, compiled, an AMD EPYC host "
              "with AVX-512-BF16 (2 cores), the four runs back to back (2026-12-07, a twenty-ninth session)")
QUALITY_RUNS = [
    ("layerwise_disk200_shared_s30_bf16.json", "Layer-wise loading from the disk capped at 200 MB/s with each stored block read once per "
     "step (shared reads), use_layerwise on by default (2026-12-07, a thirtieth session)",
     f"{_LW} --disk 200 --out benchmarks/results/layerwise_disk200_shared_s30_bf16.json"),
    ("layerwise_disk200_lw_s29_bf16.json", "Layer-wise loading from a disk whose reads the kernel caps at 200 MB/s (an ext4 "
     "loop device throttled by a blkio cgroup, its page cache emptied before every timed request: no server process on "
     f"the cores, unlike the FUSE mount), {_LW_HOST29}",
     f"{_LW} --disk 200 --layerwise --out benchmarks/results/layerwise_disk200_lw_s29_bf16.json"),
    ("layerwise_disk200_s29_bf16.json", "Whole blocks read before the forward from the same disk capped at 200 MB/s, right after",
     f"{_LW} --disk 200 --out benchmarks/results/layerwise_disk200_s29_bf16.json"),
    ("layerwise_dir_s29_bf16.json", "Whole blocks read before the forward on the plain directory (first of the four)",
     f"{_LW} --out benchmarks/results/layerwise_dir_s29_bf16.json"),
    ("layerwise_dir_lw_s29_bf16.json", "Layer-wise loading on the plain directory (second of the four)",
     f"{_LW} --layerwise --out benchmarks/results/layerwise_dir_lw_s29_bf16.json"),
    ("layerwise_200_lw_s28_bf16.json", "Layer-wise loading behind the FUSE test mount capped at 200 MB/s, a layer group's "
     f"read no longer read ahead past the group (the mount had served 1.85 times the group's bytes), {_LW_HOST28}",
     f"{_LW} --mount bandwidth_mb_s=200 --layerwise --out benchmarks/results/layerwise_200_lw_s28_bf16.json"),
    ("layerwise_dir_s28_bf16.json", "Whole blocks read before the forward on the plain directory, right after",
     f"{_LW} --out benchmarks/results/layerwise_dir_s28_bf16.json"),
    ("layerwise_dir_lw_s28_bf16.json", "Layer-wise loading on the plain directory, right after",
     f"{_LW} --layerwise --out benchmarks/results/layerwise_dir_lw_s28_bf16.json"),
    ("layerwise_200_lw_s27_bf16.json", f"Layer-wise loading (use_layerwise) behind the FUSE test mount capped at 200 MB/s, {_LW_HOST}",
     f"{_LW} --mount bandwidth_mb_s=200 --layerwise --out benchmarks/results/layerwise_200_lw_s27_bf16.json"),
    ("layerwise_200_s27_bf16.json", "Whole blocks read before the forward, the same mount capped at 200 MB/s, the same host",
     f"{_LW} --mount bandwidth_mb_s=200 --out benchmarks/results/layerwise_200_s27_bf16.json"),
    ("layerwise_dir_lw_s27_bf16.json", "Layer-wise loading on the plain directory, the same host",
     f"{_LW} --layerwise --out benchmarks/results/layerwise_dir_lw_s27_bf16.json"),
    ("layerwise_dir_s27_bf16.json", "Whole blocks read before the forward on the plain directory, the same host (first of the four)",
     f"{_LW} --out benchmarks/results/layerwise_dir_s27_bf16.json"),
    ("qwen05_long_amx_bf16_gen8.json", "Qwen2.5-Coder-0.5B-Instruct on long prompts (the 8 generated questions of "
     f"qwen05_long_shares_bf16_gen8.json), {_AMX_HOST}: the AMX attention and the KV shift by whole pages",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --num-questions 8 --selections query "
     "--max-tokens 8 --kl-tokens 1 --sweep --ratios 0.15,0.3 --no-plot --enforce-eager "
     "--out benchmarks/results/qwen05_long_amx_bf16_gen8.json"),
    ("qwen05_long_dot_amxhost_bf16_gen8.json", "The same questions, on the same host right after, with the code "
     "before (a worktree at 0774f04: bfloat16 dot products on AMX pages, the KV shift slot by slot)",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --num-questions 8 --selections query "
     "--max-tokens 8 --kl-tokens 1 --sweep --ratios 0.15,0.3 --no-plot --enforce-eager "
     "--out benchmarks/results/qwen05_long_dot_amxhost_bf16_gen8.json (from a worktree at 0774f04)"),
    ("kernel_amx_addpages_musique6_bf16.json", f"SmolLM2 on 6 MuSiQue questions, ratio 0.15, bfloat16, eager, "
     f"{_AMX_HOST}: the AMX attention and the KV shift's whole-page add on AMX pages (as committed)",
     f"{_KERNEL} --out benchmarks/results/kernel_amx_addpages_musique6_bf16.json"),
    ("kernel_amx_musique6_bf16.json", f"SmolLM2 on 6 MuSiQue questions, ratio 0.15, bfloat16, eager, {_AMX_HOST}: "
     "the AMX variant of Blend's attention (TDPBF16PS on vLLM's AMX pages), the KV shift as before",
     f"{_KERNEL} --out benchmarks/results/kernel_amx_musique6_bf16.json"),
    ("kernel_dot_amxhost_musique6_bf16.json", f"SmolLM2 on 6 MuSiQue questions, ratio 0.15, bfloat16, eager, "
     f"{_AMX_HOST}: the code before (bfloat16 dot products on AMX pages, run from a worktree at 0774f04)",
     f"{_KERNEL} --out benchmarks/results/kernel_dot_amxhost_musique6_bf16.json (from a worktree at 0774f04, "
     "--dataset naming ../shared/data/musique_dev.json)"),
    ("qwen15_musique8_shift_sample.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 0-7 (~6k tokens), the "
     "default rule at 0.15 against the KV shift estimated from an evenly spaced 3% of every chunk (kv_shift_sample "
     "0.03, recomputed within the ratio) at the whole mean (kv_shift 1.0), bfloat16, eager (2026-12-06, a "
     "twenty-first session; AVX-512-BF16 host, nothing else running but edits)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 8 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15 --selections query --plus-shift-sample 0.03 --no-plot --enforce-eager "
     "--out benchmarks/results/qwen15_musique8_shift_sample.json"),
    ("qwen15_musique8_shift_sample_half.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 0-7 (~6k tokens), "
     "the KV shift estimated from an evenly spaced 3% of every chunk at half the mean (kv_shift 0.5), bfloat16, "
     "eager (2026-12-06, a twenty-first session, right after the run above)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 8 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15 --selections query --plus-shift-sample 0.03,0.5 --only-added --no-plot --enforce-eager "
     "--out benchmarks/results/qwen15_musique8_shift_sample_half.json"),
    ("qwen15_musique8_shift1.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 0-7 (~6k tokens), the default "
     "kv_shift (0.5) against the whole chunk mean (1.0), the committed rule at 0.15, with the attention kernels of "
     "2026-11-29 (dot products, every run native), bfloat16, eager (other runs and tests shared the cores: TTFTs "
     "rough; a nineteenth session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 8 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15 --selections query --plus-kv-shift 1.0 --no-plot --enforce-eager "
     "--out benchmarks/results/qwen15_musique8_shift1.json"),
    ("kernel_dot_runs_mass_miss3_musique6_bf16.json", f"{_KERNEL_HOST}, 3 of 10 passages missed: the attention as "
     "committed (bfloat16 dot products, every run of rows native, the probe's mass read in place; 2026-11-29, a "
     "nineteenth session)", f"{_KERNEL} --chunk-store alone --miss-passages 3 "
     "--out benchmarks/results/kernel_dot_runs_mass_miss3_musique6_bf16.json"),
    ("kernel_dot_miss3_musique6_bf16.json", f"{_KERNEL_HOST}, 3 of 10 passages missed: bfloat16 dot products, runs of "
     "16 rows or more to vLLM's kernel (the step before every run went native)",
     f"{_KERNEL} --chunk-store alone --miss-passages 3 --out benchmarks/results/kernel_dot_miss3_musique6_bf16.json"),
    ("kernel_dot_runs_mass_musique6_bf16.json", f"{_KERNEL_HOST}: the attention as committed (bfloat16 dot products, "
     "every run of rows native, the probe's mass read in place)",
     f"{_KERNEL} --out benchmarks/results/kernel_dot_runs_mass_musique6_bf16.json"),
    ("kernel_dot_runs_musique6_bf16.json", f"{_KERNEL_HOST}: bfloat16 dot products, every run of rows native (the "
     "probe's mass from gathered K/V)", f"{_KERNEL} --out benchmarks/results/kernel_dot_runs_musique6_bf16.json"),
    ("kernel_dot_musique6_bf16.json", f"{_KERNEL_HOST}: the native kernel with bfloat16 dot products, runs of 16 rows "
     "or more to vLLM's kernel", f"{_KERNEL} --out benchmarks/results/kernel_dot_musique6_bf16.json"),
    ("kernel_widen_musique6_bf16.json", f"{_KERNEL_HOST}: the native kernel before (bfloat16 widened to float32, "
     "code 02e7033), runs of 16 rows or more to vLLM's kernel",
     f"{_KERNEL} --out benchmarks/results/kernel_widen_musique6_bf16.json"),
    ("qwen15_musique36_55.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 36-55 (~6k tokens), the committed "
     "rule at 0.15 and 0.3, eager as the runs before, bfloat16 (other runs and tests shared the cores: TTFTs rough; "
     "2026-11-29, a seventeenth session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 20 --skip-questions 36 --max-tokens 16 "
     "--kl-tokens 1 --sweep --ratios 0.15,0.3 --selections query --no-plot --enforce-eager "
     "--out benchmarks/results/qwen15_musique36_55.json"),
    ("qwen15_musique44_45_oracle.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 44-45 (~7.2k tokens), two "
     "of the three questions where the committed rule lost gold F1 at 0.15 in qwen15_musique36_55.json, beside the "
     "oracle at the same ratio; compiled, bfloat16 (2026-12-06, a twenty-third session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --skip-questions 44 --num-questions 2 --sweep --ratios 0.15 "
     "--selections query,oracle --kl-tokens 1 --no-plot --out benchmarks/results/qwen15_musique44_45_oracle.json"),
    ("qwen15_musique54_oracle.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue question 54 (~7k tokens), the third "
     "such question, beside the oracle; compiled, bfloat16 (its full prefill answered otherwise eager: "
     "qwen15_musique36_55.json; 2026-12-06, a twenty-third session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --skip-questions 54 --num-questions 1 --sweep --ratios 0.15 "
     "--selections query,oracle --kl-tokens 1 --no-plot --out benchmarks/results/qwen15_musique54_oracle.json"),
    ("qwen15_musique16_35.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 16-35 (~6k tokens), the committed "
     "rule and HKVD at 0.15 and 0.3 (questions 0-15: qwen15_musique16_shares.json, qwen15_musique16_ratio03.json), "
     "bfloat16 (unit tests shared the cores for a few minutes: TTFTs rough; 2026-11-29, a sixteenth session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 20 --skip-questions 16 --max-tokens 16 "
     "--kl-tokens 1 --sweep --ratios 0.15,0.3 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen15_musique16_35.json"),
    ("qwen15_musique16_ratio03.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 0-15 at ratio 0.3, the "
     "committed rule (the same questions at 0.15: qwen15_musique16_shares.json), bfloat16 (the test suite shared the "
     "cores for most of the run: TTFTs rough; 2026-11-28, a fourteenth session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 16 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.3 --selections query --no-plot --out benchmarks/results/qwen15_musique16_ratio03.json"),
    ("qwen15_musique16_shares.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 0-15 (~6k tokens) with the "
     "query rule as committed (squared shares), beside the oracle at 0.15 (the same questions with the V-weighted sum "
     "before: qwen15_musique16_vn.json), bfloat16 (store unit tests shared the cores for a few minutes: TTFTs rough; "
     "2026-11-28, a fourteenth session)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 16 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15 --selections query,oracle --no-plot --out benchmarks/results/qwen15_musique16_shares.json"),
    ("qwen05_long_shares_bf16_gen8.json", "Qwen2.5-Coder-0.5B-Instruct on long prompts with the query rule as committed "
     "(squared shares of each deep layer's V-weighted attention): the 8 generated questions of "
     "qwen05_long_vn_bf16_gen8.json (the V-weighted sum), bfloat16, nothing else running",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --num-questions 8 --selections query "
     "--max-tokens 8 --kl-tokens 1 --sweep --ratios 0.15,0.3 --no-plot "
     "--out benchmarks/results/qwen05_long_shares_bf16_gen8.json"),
    ("qwen15_query_shares_gen20_59.json", "Qwen2.5-Coder-1.5B-Instruct on the 40 held-out generated questions (20-59) "
     "with the query rule as committed (squared shares of each deep layer's V-weighted attention), bfloat16, "
     "nothing else running (the V-weighted sum before: qwen15_query_vn_gen20_59.json)",
     f"{_HELD} --skip-questions 20 --num-questions 40 --selections query "
     "--out benchmarks/results/qwen15_query_shares_gen20_59.json"),
    ("qwen15_probe_shares_gen80_119.json", "The layers that retrieve, on fresh questions: Qwen2.5-Coder-1.5B-Instruct "
     f"on generated questions 80-119 (never used before), the rule before against query_sq ({_SHARES})",
     f"{_HELD} --skip-questions 80 --num-questions 40 --selections query,query_sq "
     "--out benchmarks/results/qwen15_probe_shares_gen80_119.json (with the patch)"),
    ("qwen15_probe_shares_gen60_79.json", "The layers that retrieve, a development set: Qwen2.5-Coder-1.5B-Instruct "
     f"on generated questions 60-79 ({_SHARES})",
     f"{_HELD} --skip-questions 60 --num-questions 20 --selections query,query_norm,query_maxl,query_sq "
     "--out benchmarks/results/qwen15_probe_shares_gen60_79.json (with the patch)"),
    ("smollm2_probe_shares_quality16.json", f"The layers that retrieve on SmolLM2's fixed set (make quality's 16 "
     f"questions, float32; {_SHARES})",
     f"{_Q} --generated --num-questions 16 --passages 10 --passage-words 120 --sweep --ratios 0.15 "
     "--selections query,query_norm,query_maxl,query_sq --kl-tokens 1 --no-plot "
     "--out benchmarks/results/smollm2_probe_shares_quality16.json (with the patch)"),
    ("qwen15_probe_shares_q33.json", f"The layers that retrieve, diagnosed on held-out question 33 (the oracle "
     f"answered it, the rule did not; {_SHARES} and query_all)",
     f"{_HELD} --no-warmup --skip-questions 33 --num-questions 1 --selections "
     "query,query_all,query_norm,query_maxl,query_sq --out benchmarks/results/qwen15_probe_shares_q33.json (with the patch)"),
    ("qwen15_probe_shares_q53.json", "The same on held-out question 53", f"{_HELD} --no-warmup --skip-questions 53 "
     "--num-questions 1 --selections query,query_all,query_norm,query_maxl,query_sq "
     "--out benchmarks/results/qwen15_probe_shares_q53.json (with the patch)"),
    ("qwen05_long_vn_bf16_gen8.json", "Qwen2.5-Coder-0.5B-Instruct on long prompts with the query rule as committed "
     "(V norms, the second half of the layers): 8 generated questions of 10 passages x 450 words (~5.4k tokens; the "
     "first 4 are those of qwen05_long_ratios_generated4.json), bfloat16 (the faster dtype on this host), nothing "
     "else running; the offline TTFT speed-up at this length",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --num-questions 8 --selections query "
     "--max-tokens 8 --kl-tokens 1 --sweep --ratios 0.15,0.3 --no-plot "
     "--out benchmarks/results/qwen05_long_vn_bf16_gen8.json"),
    ("qwen15_oracle_gen20_59.json", "The ranking's ceiling at 0.15 on the 1.5B: the oracle (full prefill's attention "
     "times each token's true V error over every layer, a diagnostic that runs full prefill first, so its TTFT "
     "includes it) on the 40 held-out generated questions (20-59) of qwen15_query_vn_gen20_59.json, bfloat16",
     f"{_HELD} --skip-questions 20 --num-questions 40 --selections oracle "
     "--out benchmarks/results/qwen15_oracle_gen20_59.json"),
    ("qwen15_query_vn_gen20_59.json", "Qwen2.5-Coder-1.5B-Instruct on the 40 held-out generated questions (20-59) "
     "with the query rule as committed (V norms, the second half of the layers): the experiment's query_vnl mode "
     "(qwen15_probe_depth_gen20_59.json) from the shipped code, bfloat16, nothing else running",
     f"{_HELD} --skip-questions 20 --num-questions 40 --selections query "
     "--out benchmarks/results/qwen15_query_vn_gen20_59.json"),
    ("qwen05_query_vn_gen8.json", "Qwen2.5-Coder-0.5B-Instruct with the query rule weighted by V norms over the "
     "second half of the layers, the 8 generated questions of qwen05_attention_alone_gen8.json (the rule before), "
     "bfloat16",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --passages 10 --passage-words 120 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 8 --sweep --ratios 0.15,0.3 --selections query --no-plot "
     "--out benchmarks/results/qwen05_query_vn_gen8.json"),
    ("qwen15_musique16_vn.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 0-15 with the query rule "
     "weighted by V norms over the second half of the layers (the rule before on the same questions: "
     "qwen15_musique8_rules.json and qwen15_musique8_15_rules.json), bfloat16 (an e2e test shared the cores: TTFTs "
     "rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 16 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15 --selections query --no-plot --out benchmarks/results/qwen15_musique16_vn.json"),
    ("qwen15_probe_depth_gen20_59.json", "Where the question reads, held out: Qwen2.5-Coder-1.5B-Instruct on the 40 "
     "held-out generated questions (20-59), the query rule before (blend 0.15) against the two variants the "
     f"development set chose ({_VARIANTS}; a quality check shared the cores: TTFTs rough)",
     f"{_HELD} --skip-questions 20 --num-questions 40 --selections query,query_vnl23,query_vnl "
     "--out benchmarks/results/qwen15_probe_depth_gen20_59.json (with the patch)"),
    ("qwen15_probe_variants_gen60_79.json", "Where the question reads, a development set: Qwen2.5-Coder-1.5B-Instruct "
     f"on generated questions 60-79 (never used before), the query rule before (blend 0.15) and {_VARIANTS}",
     f"{_HELD} --skip-questions 60 --num-questions 20 --selections query,query_vn,query_late,query_vnl,query_headmax "
     "--out benchmarks/results/qwen15_probe_variants_gen60_79.json (with the patch)"),
    ("qwen15_probe_variants2_gen60_79.json", "The same development set, more variants and the oracle ranking "
     f"({_VARIANTS}; the oracle's TTFT includes its full prefill)",
     f"{_HELD} --skip-questions 60 --num-questions 20 --selections query_vnhl,query_vnl3,query_vnl23,oracle "
     "--out benchmarks/results/qwen15_probe_variants2_gen60_79.json (with the patch)"),
    ("smollm2_probe_variants_quality16.json", "Where the question reads on SmolLM2: the fixed quality set (make "
     f"quality's 16 questions, float32), the query rule before (blend 0.15) and {_VARIANTS}",
     f"{_Q} --generated --num-questions 16 --passages 10 --passage-words 120 --sweep --ratios 0.15 "
     "--selections query,query_vn,query_vnl3,query_vnl,query_vnl23 --kl-tokens 1 --no-plot "
     "--out benchmarks/results/smollm2_probe_variants_quality16.json (with the patch)"),
    ("qwen15_successors_gen20_59.json", "An experiment not kept: each loaded token's query score raised to half its "
     "predecessor's and a quarter of the one before (max, not mean: the top tokens stay; a patch to "
     "blend_forward._score_loaded_rows, UCM_EXP_SUCC=0.5,2), Qwen2.5-Coder-1.5B-Instruct on the 40 held-out generated "
     "questions of qwen15_query_shares_gen20_59.json, eager, on an AMD EPYC host about twice as slow (TTFTs not "
     "comparable with that run's; 2026-11-29, an eighteenth session)",
     f"UCM_EXP_SUCC=0.5,2 {_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 "
     "--max-tokens 4 --kl-tokens 1 --skip-questions 20 --num-questions 40 --sweep --ratios 0.15 --selections query "
     "--enforce-eager --no-plot --out benchmarks/results/qwen15_successors_gen20_59.json (with the patch described in "
     "research.md)"),
    ("qwen15_span4_gen20_59.json", "An experiment not kept: the query rule's attention mass averaged over a 9-token "
     "window before the top-k (a patch to blend_forward._scores, UCM_EXP_SPAN=4), Qwen2.5-Coder-1.5B-Instruct on the "
     "40 held-out generated questions of qwen15_rules_gen20_59.json",
     f"UCM_EXP_SPAN=4 {_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 "
     "--max-tokens 4 --kl-tokens 1 --skip-questions 20 --num-questions 40 --sweep --ratios 0.15 --selections query "
     "--no-plot --out benchmarks/results/qwen15_span4_gen20_59.json (with the patch described in research.md)"),
    ("qwen15_ratio03_gen20_59.json", "Qwen2.5-Coder-1.5B-Instruct at ratio 0.3 on the 40 held-out generated questions "
     "of qwen15_rules_gen20_59.json (questions 20-59), bfloat16, the query rule (a fault storm shared the cores: "
     "TTFTs rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --skip-questions 20 --num-questions 40 --sweep --ratios 0.3 --selections query --no-plot "
     "--out benchmarks/results/qwen15_ratio03_gen20_59.json"),
    ("qwen15_rules_gen20_59.json", "Qwen2.5-Coder-1.5B-Instruct on 40 held-out generated questions (20-59, never used "
     "to choose a setting), the query rule against HKVD at 0.15, bfloat16 (a fault storm shared the cores for part "
     "of the run: TTFTs rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --skip-questions 20 --num-questions 40 --sweep --ratios 0.15 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen15_rules_gen20_59.json"),
    ("qwen15_gradual_gen20.json", "Gradual filtering on Qwen2.5-Coder-1.5B-Instruct (the 20 generated questions of "
     "qwen15_rules_gen20.json, bfloat16, query rule): 0.3 at check layer 1 narrowed to 0.15 at layer 4 (its "
     "'blend 0.3'); one check layer at 0.15: qwen15_rules_gen20.json",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 20 --sweep --ratios 0.3 --selections query --later-checks 4:0.15 --no-plot "
     "--out benchmarks/results/qwen15_gradual_gen20.json"),
    ("smollm2_musique20_gradual.json", "Gradual filtering on MuSiQue (SmolLM2, the first 20 questions, bfloat16, the "
     "query rule by attention alone): 0.3 selected at check layer 1, narrowed to 0.15 at layer 4 (its 'blend 0.3'); "
     "one check layer on the same questions: smollm2_musique20_one_layer.json, run just before",
     f"{_Q} --dtype bfloat16 --num-questions 20 --kl-tokens 1 --sweep --ratios 0.3 --selections query "
     "--later-checks 4:0.15 --no-plot --out benchmarks/results/smollm2_musique20_gradual.json"),
    ("smollm2_musique20_one_layer.json", "One check layer at 0.15 and 0.3 on MuSiQue (SmolLM2, the first 20 questions, "
     "bfloat16, the query rule by attention alone)",
     f"{_Q} --dtype bfloat16 --num-questions 20 --kl-tokens 1 --sweep --ratios 0.15,0.3 --selections query "
     "--no-plot --out benchmarks/results/smollm2_musique20_one_layer.json"),
    ("qwen15_musique8_15_rules.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue questions 8-15 (~6k tokens), the "
     "query rule by attention alone against HKVD and LMCache's key_l2 at 0.15, bfloat16 (held out from "
     "qwen15_musique8_rules.json, nothing else running)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --skip-questions 8 --num-questions 8 --max-tokens 16 "
     "--kl-tokens 1 --sweep --ratios 0.15 --selections query,hkvd,key_l2 --no-plot "
     "--out benchmarks/results/qwen15_musique8_15_rules.json"),
    ("qwen15_musique8_rules.json", "Qwen2.5-Coder-1.5B-Instruct on the first 8 MuSiQue questions (~6k tokens), the "
     "query rule by attention alone against HKVD and LMCache's key_l2 at 0.15, bfloat16 (a test suite shared the "
     "cores: TTFTs rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 8 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15 --selections query,hkvd,key_l2 --no-plot --out benchmarks/results/qwen15_musique8_rules.json"),
    ("qwen15_rules_gen20.json", "Qwen2.5-Coder-1.5B-Instruct, every rule at 0.15 on the 20 generated questions of "
     "qwen15_layer1_gen20.json, the query rule by attention alone (2026-11-28, a tenth session), bfloat16",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 20 --sweep --ratios 0.15 --selections query,hkvd,key_l2,chunk_start --no-plot "
     "--out benchmarks/results/qwen15_rules_gen20.json"),
    ("qwen15_attention_alone_gen14.json", "Qwen2.5-Coder-1.5B-Instruct, the query rule ranking by the question's "
     "attention alone (no deviation factor), the generated questions 0-13 of qwen15_layer1_gen20.json (the run of 20 "
     "was ended by the kernel's OOM killer after 14), bfloat16",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 20 --sweep --ratios 0.15,0.3 --selections query --no-plot "
     "--out benchmarks/results/qwen15_attention_alone_gen14.json"),
    ("qwen15_attention_alone_q15_18.json", "The same rule on the generated questions 15-18 (those of the oracle run)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --skip-questions 15 --num-questions 4 --sweep --ratios 0.15 --selections query --no-plot "
     "--out benchmarks/results/qwen15_attention_alone_q15_18.json"),
    ("qwen05_attention_alone_gen8.json", "Qwen2.5-Coder-0.5B-Instruct, the query rule by attention alone and HKVD, "
     "the 8 generated questions of qwen05_ratios_generated8.json, bfloat16",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --passages 10 --passage-words 120 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 8 --sweep --ratios 0.15,0.3 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen05_attention_alone_gen8.json"),
    ("qwen05_before_attention_alone_gen8.json", "The same run before the change (attention x the deviation's norm), "
     "back to back on the same host and dtype",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --generated --passages 10 --passage-words 120 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 8 --sweep --ratios 0.15,0.3 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen05_before_attention_alone_gen8.json, at commit 1402235"),
    ("qwen15_kv_shift_gen12.json", "Qwen2.5-Coder-1.5B-Instruct, kv_shift 0 against the default 0.5 (the "
     "'+shift 0.5' modes), the query rule before attention alone, the generated questions 0-11 (the run of 20 was "
     "ended by the kernel's OOM killer after 12), bfloat16",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 20 --sweep --ratios 0.15,0.3 --selections query --kv-shift 0 --plus-kv-shift 0.5 "
     "--no-plot --out benchmarks/results/qwen15_kv_shift_gen12.json"),
    ("qwen15_musique5_attention_alone.json", "Qwen2.5-Coder-1.5B-Instruct on the same 5 MuSiQue questions, the "
     "query rule by attention alone (the default since this run), bfloat16; full prefill's answers are the same as "
     "in qwen15_musique5.json",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 5 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0.15,0.3 --selections query --no-plot --out benchmarks/results/qwen15_musique5_attention_alone.json"),
    ("qwen15_musique5.json", "Qwen2.5-Coder-1.5B-Instruct on MuSiQue (the first 5 questions, ~5.9k tokens), "
     "bfloat16: the query rule (before attention alone) and HKVD at 0.15 and 0.3, full reuse (another run shared "
     "the cores, so TTFTs are rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --num-questions 5 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0,0.15,0.3 --selections query,hkvd --no-plot --out benchmarks/results/qwen15_musique5.json"),
    ("qwen05_musique12.json", "Qwen2.5-Coder-0.5B-Instruct on MuSiQue (the first 12 questions, ~6k tokens), bfloat16 on "
     "an AVX-512-BF16 host: the query rule and HKVD at ratios 0.15 and 0.3 and full reuse, gold F1 and next-token KL "
     "(another 1.5B run and unit tests shared the cores, so TTFTs are rough)",
     f"{_Q} --model qwen2.5-coder-0.5b --dtype bfloat16 --num-questions 12 --max-tokens 16 --kl-tokens 1 --sweep "
     "--ratios 0,0.15,0.3 --selections query,hkvd --no-plot --out benchmarks/results/qwen05_musique12.json"),
    ("qwen15_oracle_q15_18.json", "Qwen2.5-Coder-1.5B-Instruct, the generated questions 15-18 (three of the four the "
     "default misses at 0.15 with check layer 1): the query rule against the oracle ranking (full prefill's attention x "
     "V error over every layer) at 0.15, bfloat16",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --skip-questions 15 --num-questions 4 --sweep --ratios 0.15 --selections query,oracle --no-plot "
     "--out benchmarks/results/qwen15_oracle_q15_18.json"),
    ("qwen05_gradual_generated8.json", "Gradual filtering (CacheBlend's several check layers) on Qwen2.5-Coder-0.5B-"
     "Instruct: check layer 1, a later check layer 4 at ratio 0.15, the same 8 generated questions as "
     "qwen05_ratios_generated8.json. Its 'blend 0.15' selects 0.15 at layer 1 and keeps it all at layer 4 (one check "
     "layer's selection); its 'blend 0.3' selects 0.3 at layer 1 and narrows to 0.15 at layer 4 (gradual). One check "
     "layer at 0.3: qwen05_ratios_generated8.json (a 0.5B run shared the cores with a quality check, so TTFTs are rough)",
     f"{_Q} --model qwen2.5-coder-0.5b --generated --passages 10 --passage-words 120 --max-tokens 4 --kl-tokens 1 "
     "--num-questions 8 --sweep --ratios 0.15,0.3 --selections query --later-checks 4:0.15 --no-plot "
     "--out benchmarks/results/qwen05_gradual_generated8.json"),
    ("qwen05_long_ratios_generated4.json", "Qwen2.5-Coder-0.5B-Instruct on long prompts at the new default ratio 0.3 "
     "and at 0.15: the same 4 generated questions of 10 passages x 450 words (~5.4k tokens) as "
     "qwen05_long_generated4.json, the query rule, next-token KL; the offline TTFT speed-up at this length",
     f"{_Q} --model qwen2.5-coder-0.5b --generated --num-questions 4 --selections query --max-tokens 8 --kl-tokens 1 "
     "--sweep --ratios 0.15,0.3 --no-plot --out benchmarks/results/qwen05_long_ratios_generated4.json"),
    ("qwen05_ratios_generated8.json", "Qwen2.5-Coder-0.5B-Instruct at ratios 0.15 and 0.3, the query rule and HKVD: the "
     "same 8 generated questions as qwen05_generated8.json (2026-11-27; 10 passages x 120 words), next-token KL (the unit "
     "and end-to-end tests shared the cores, so TTFTs are rough)",
     f"{_Q} --model qwen2.5-coder-0.5b --generated --passages 10 --passage-words 120 --max-tokens 4 --kl-tokens 1 "
     "--num-questions 8 --sweep --ratios 0,0.15,0.3 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen05_ratios_generated8.json"),
    ("qwen15_rules_generated8.json", "Qwen2.5-Coder-1.5B-Instruct on 8 more held-out generated questions (13-20, 10 "
     "passages x 80 words): every ranked rule at ratios 0.15 and 0.3 and full reuse (no next-token KL; another run and "
     "tests shared the cores, so TTFTs are rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --generated --passages 10 --passage-words 80 --max-tokens 4 --skip-questions 12 "
     "--num-questions 8 --sweep --ratios 0,0.15,0.3 --selections query,hkvd,key_l1,key_l2 --no-plot "
     "--out benchmarks/results/qwen15_rules_generated8.json"),
    ("qwen05_long_generated4.json", "Qwen2.5-Coder-0.5B-Instruct on long prompts: 4 generated questions of 10 "
     "passages x 450 words (~5.4k tokens; the data set was not found from the run's directory, so generated), "
     "the query rule and HKVD at 0.15 and full reuse, next-token KL; the offline TTFT speed-up at this length",
     f"{_Q} --model qwen2.5-coder-0.5b --generated --num-questions 4 --selections query,hkvd --max-tokens 8 "
     "--kl-tokens 1 --out benchmarks/results/qwen05_long_generated4.json"),
    ("qwen15_query_generated6.json", "Qwen2.5-Coder-1.5B-Instruct, the query rule by the question's attention alone (no "
     "longer per unit of position): the same 6 generated questions as below",
     f"{_Q} --model qwen2.5-coder-1.5b --generated --num-questions 6 --passage-words 80 --max-tokens 4 --kl-tokens 1 "
     "--selections query --sweep --ratios 0.15 --no-plot --out benchmarks/results/qwen15_query_generated6.json"),
    ("qwen15_heldout_generated6.json", "The same on 6 held-out generated questions (7-12), with HKVD and full reuse",
     f"{_Q} --model qwen2.5-coder-1.5b --generated --skip-questions 6 --num-questions 6 --passage-words 80 "
     "--max-tokens 4 --kl-tokens 1 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen15_heldout_generated6.json"),
    ("qwen15_ratios_generated6.json", "Before that change: the query rule (attention per cost) and HKVD at ratios 0.15, "
     "0.3 and 0.5, the first 6 generated questions",
     f"{_Q} --model qwen2.5-coder-1.5b --generated --num-questions 6 --passage-words 80 --max-tokens 4 --kl-tokens 1 "
     "--sweep --ratios 0.15,0.3,0.5 --selections query,hkvd --no-plot "
     "--out benchmarks/results/qwen15_ratios_generated6.json, at commit c31f523"),
    ("qwen15_generated6.json", "Qwen2.5-Coder-1.5B-Instruct, generated set (10 passages x 80 words), every rule with "
     "and without the KV shift, next-token KL",
     f"{_Q} --model qwen2.5-coder-1.5b --generated --num-questions 6 --passage-words 80 --selections query,hkvd "
     "--plus-kv-shift 0 --kl-tokens 1 --no-plot --out benchmarks/results/qwen15_generated6.json"),
    ("qwen05_generated8.json", "Qwen2.5-Coder-0.5B-Instruct, generated set (10 passages x 120 words), the query, HKVD "
     "and LMCache (key_l2) rules with and without the KV shift, next-token KL (TTFT with another run beside it)",
     f"{_Q} --model qwen2.5-coder-0.5b --generated --num-questions 8 --passage-words 120 "
     "--selections query,hkvd,key_l2 --plus-kv-shift 0 --kl-tokens 1 --no-plot --out benchmarks/results/qwen05_generated8.json"),
    ("query_fix_musique_longq4.json", "The query rule's fix on long questions: the first 4 MuSiQue questions whose "
     "question message is over 32 tokens (the probe's queries), the whole question run again",
     f"{_Q} --min-question-tokens 32 --num-questions 4 --selections query --kl-tokens 1 --max-tokens 8 --no-plot "
     "--out benchmarks/results/query_fix_musique_longq4.json"),
    ("quality_check.json", "The fixed quality check's accepted run (make quality): generated set, 16 questions, 10 "
     "passages x 120 words, the query rule scoring each token by its squared share of each deep layer's V-weighted "
     "attention (before: 0.0828 by the V-weighted sum over the second half of the layers, "
     "quality_check_vnorm_half_depth.json; 0.0771 by the attention of every layer after the check layer, "
     "quality_check_attention_every_layer.json; 0.1873 with attention x the deviation's norm; 0.2041 with "
     "attention per cost)",
     "python benchmarks/quality_check.py --accept"),
    ("quality_check_vnorm_half_depth.json", "The fixed quality check's accepted run before the squared shares: the "
     "question's attention weighted by V norms, summed over the second half of the layers",
     "python benchmarks/quality_check.py --accept"),
    ("quality_check_attention_every_layer.json", "The fixed quality check's accepted run before the V norm and the "
     "second half of the layers: the question's attention over every layer after the check layer",
     "python benchmarks/quality_check.py --accept"),
    ("quality_check_before_attention_alone.json", "The fixed quality check's accepted run before the query rule "
     "ranked by attention alone: attention x the check layer's deviation norm",
     "python benchmarks/quality_check.py --accept"),
    ("query_head_generated16.json", "The same before the fix (commit 5f450e4)",
     f"{_Q} --generated --num-questions 16 --passage-words 120 --selections query,hkvd --kl-tokens 1 --no-plot "
     "--out benchmarks/results/query_head_generated16.json, at commit 5f450e4"),
    ("query_pre_f4bca24_generated16.json", "The same at f4bca24^ (before the probe's rows kept their KV)",
     "the same command at commit b76007e (f4bca24^)"),
]

# Runs that add modes to an earlier run's questions (compare them question by question).
EVAL_RUNS += [
    ("blend_kv_shift_generated50.json", "KV shift, generated set, 50 questions (next-token KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 50 --sweep "
     "--ratios 0.15,0.3 --selections query --plus-kv-shift --only-added --kl-tokens 2 --no-plot "
     "--out benchmarks/results/blend_kv_shift_generated50.json"),
    ("blend_kv_shift_generated200.json", "KV shift, generated set, 200 questions",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 200 --sweep "
     "--ratios 0.15,0.3 --selections query --plus-kv-shift --only-added --no-plot "
     "--out benchmarks/results/blend_kv_shift_generated200.json"),
    ("blend_kv_shift_half_generated200.json", "KV shift at half the chunk mean, generated set, 200 questions",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 200 --sweep "
     "--ratios 0.15,0.3 --selections query --plus-kv-shift 0.5 --only-added --no-plot "
     "--out benchmarks/results/blend_kv_shift_half_generated200.json"),
    ("blend_kv_shift_half_generated50.json", "KV shift at half the chunk mean, generated set, 50 questions "
     "(next-token KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 50 --sweep "
     "--ratios 0.15,0.3 --selections query --plus-kv-shift 0.5 --only-added --kl-tokens 2 --no-plot "
     "--out benchmarks/results/blend_kv_shift_half_generated50.json"),
    ("blend_kv_shift_half_musique8.json", "KV shift at half the chunk mean, MuSiQue, 8 questions (next-token KL over "
     "2 answer tokens)",
     "python benchmarks/blend_bench.py --num-questions 8 --sweep --ratios 0.15,0.3 --selections query "
     "--plus-kv-shift 0.5 --only-added --kl-tokens 2 --no-plot --out benchmarks/results/blend_kv_shift_half_musique8.json"),
    ("blend_kv_shift_half_musique20.json", "KV shift at half the chunk mean against the query rule alone, MuSiQue, "
     "20 questions (next-token KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --num-questions 20 --sweep --ratios 0.15 --selections query "
     "--plus-kv-shift 0.5 --kl-tokens 2 --no-plot --out benchmarks/results/blend_kv_shift_half_musique20.json"),
    ("blend_oracle_generated50.json", "The oracle ranking, generated set, 50 questions (next-token KL over 2 answer "
     "tokens)",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 50 --sweep "
     "--ratios 0.15,0.3 --selections oracle --kl-tokens 2 --no-plot --out benchmarks/results/blend_oracle_generated50.json"),
    ("blend_query_norm_generated100.json", "The query rule weighing the deviation's norm (the default since "
     "2026-11-24), generated set, questions 0-99",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 100 --sweep "
     "--ratios 0.15,0.3 --selections query --no-plot --out benchmarks/results/blend_query_norm_generated100.json"),
    ("blend_query_norm_musique8.json", "The query rule weighing the deviation's norm, MuSiQue, 8 questions (next-token "
     "KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --num-questions 8 --sweep --ratios 0.15,0.3 --selections query --kl-tokens 2 "
     "--no-plot --out benchmarks/results/blend_query_norm_musique8.json"),
    ("blend_query_heldout_generated200_299.json", "The shipped query rule on held-out generated questions 200-299 "
     "(never used to choose anything)",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 100 "
     "--skip-questions 200 --sweep --ratios 0.15,0.3 --selections query --no-plot "
     "--out benchmarks/results/blend_query_heldout_generated200_299.json"),
    ("blend_query_norm_musique20.json", "The query rule weighing the deviation's norm, MuSiQue, 20 questions (next-token "
     "KL over 2 answer tokens)",
     "python benchmarks/blend_bench.py --num-questions 20 --sweep --ratios 0.15,0.3 --selections query --kl-tokens 2 "
     "--no-plot --out benchmarks/results/blend_query_norm_musique20.json"),
    ("blend_oracle_shift_generated100.json", "The query rule and the oracle ranking, both with the default kv_shift, "
     "generated set, 100 questions, ratio 0.3",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 100 --sweep "
     "--ratios 0.3 --selections query,oracle --no-plot --out benchmarks/results/blend_oracle_shift_generated100.json"),
    ("blend_epic_query_generated50.json", "EPIC's chunk starts with the query rule, generated set, 50 questions",
     "python benchmarks/blend_bench.py --generated --passages 6 --passage-words 250 --num-questions 50 --sweep "
     "--ratios 0.15,0.3 --selections query --plus-chunk-start 16 --kl-tokens 2 --no-plot "
     "--out benchmarks/results/blend_epic_query_generated50.json"),
]


# Runs of one set that differ only in the check layer: (title, command with {layer}, [result files]).
# A run whose questions are pooled with earlier runs on the same set: (the earlier runs, the modes pooled)
POOL_WITH = {
    "qwen15_musique36_55.json": (["qwen15_musique16_shares.json", "qwen15_musique16_ratio03.json",
                                  "qwen15_musique16_35.json"], ["blend 0.15", "blend 0.3"]),
}
CHECK_LAYER_STUDIES = [
    ("The check layer on Qwen2.5-Coder-1.5B-Instruct: the 20 generated questions of every earlier 1.5B run (10 "
     "passages x 80 words), bfloat16 on an AVX-512-BF16 host, the query rule at ratios 0.15 and 0.3, one run per "
     "check layer (the layers before it are computed for every token; speed-up against the same run's full prefill; "
     "other runs shared the cores, so TTFTs are rough)",
     f"{_Q} --model qwen2.5-coder-1.5b --dtype bfloat16 --generated --passages 10 --passage-words 80 --max-tokens 4 "
     "--kl-tokens 1 --num-questions 20 --sweep --ratios 0.15,0.3 --selections query --check-layer {layer} --no-plot "
     "--out benchmarks/results/qwen15_layer{layer}_gen20.json",
     ["qwen15_layer1_gen20.json", "qwen15_layer3_gen20.json"]),
]


def _at_both_ratios(base: str, new: str) -> list[tuple[str, str]]:
    """("blend 0.15 <base>", "blend 0.15 <new>") and the same at 0.3: the pairs of a run that adds
    a variant of the query rule at both ratios ("" for the plain rule)."""
    return [(f"blend {r} {base}".rstrip(), f"blend {r} {new}") for r in ("0.15", "0.3")]


# (title, file of the base modes, file of the new modes, [(base mode, new mode)]): the same questions,
# compared question by question.
PAIRED = [
    ("The KV shift estimated from an evenly spaced 3% of every chunk (kv_shift_sample 0.03) at the whole mean "
     "against the default (the ranked tokens' mean at 0.5), Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-7, "
     "bfloat16", "qwen15_musique8_shift_sample.json", "qwen15_musique8_shift_sample.json",
     [("blend 0.15", "blend 0.15 +sample 0.03")]),
    ("The same sample at half the mean against the default, Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-7, "
     "bfloat16 (two runs back to back)", "qwen15_musique8_shift_sample.json",
     "qwen15_musique8_shift_sample_half.json", [("blend 0.15", "blend 0.15 +sample 0.03 shift 0.5")]),
    ("kv_shift 1.0 against the default 0.5, Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-7, bfloat16",
     "qwen15_musique8_shift1.json", "qwen15_musique8_shift1.json", [("blend 0.15", "blend 0.15 +shift")]),
    ("The attention kernels of 2026-11-29 (dot products, every run native) against those before, "
     "Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-7, bfloat16 (other hosts and loads: answers and KL only)",
     "qwen15_musique16_shares.json", "qwen15_musique8_shift1.json", [("blend 0.15", "blend 0.15")]),
    ("The native kernel with bfloat16 dot products against widening to float32, SmolLM2, MuSiQue, 6 questions, "
     "bfloat16", "kernel_widen_musique6_bf16.json", "kernel_dot_musique6_bf16.json", [("blend 0.15", "blend 0.15")]),
    ("Every run of rows native (and the probe's mass read in place) against runs of 16 or more to vLLM's kernel, "
     "SmolLM2, MuSiQue, 6 questions, bfloat16", "kernel_dot_musique6_bf16.json",
     "kernel_dot_runs_mass_musique6_bf16.json", [("blend 0.15", "blend 0.15")]),
    ("Every run of rows native (and the probe's mass read in place) against runs of 16 or more to vLLM's kernel, "
     "3 of 10 passages missed, SmolLM2, MuSiQue, 6 questions, bfloat16", "kernel_dot_miss3_musique6_bf16.json",
     "kernel_dot_runs_mass_miss3_musique6_bf16.json", [("blend 0.15", "blend 0.15")]),
    ("Gradual filtering (0.3 at layer 1 narrowed to 0.15 at layer 4) against one check layer at 0.15, generated set, "
     "20 questions, Qwen2.5-Coder-1.5B-Instruct, bfloat16", "qwen15_rules_gen20.json", "qwen15_gradual_gen20.json",
     [("blend 0.15", "blend 0.3")]),
    ("Gradual filtering (0.3 at layer 1 narrowed to 0.15 at layer 4) against one check layer at 0.15 and at 0.3, "
     "MuSiQue, 20 questions, SmolLM2, bfloat16", "smollm2_musique20_one_layer.json", "smollm2_musique20_gradual.json",
     [("blend 0.15", "blend 0.3"), ("blend 0.3", "blend 0.3")]),
    ("KV shift against the query rule alone, generated set, 50 questions", "blend_epic_query_generated50.json",
     "blend_kv_shift_generated50.json", _at_both_ratios("", "+shift")),
    ("KV shift against the query rule alone, generated set, 200 questions", "blend_bench_generated200_ratios.json",
     "blend_kv_shift_generated200.json", _at_both_ratios("", "+shift")),
    ("KV shift at half the chunk mean against the query rule alone, generated set, 200 questions",
     "blend_bench_generated200_ratios.json", "blend_kv_shift_half_generated200.json",
     _at_both_ratios("", "+shift 0.5")),
    ("KV shift at half the chunk mean against the whole mean, generated set, 200 questions",
     "blend_kv_shift_generated200.json", "blend_kv_shift_half_generated200.json",
     _at_both_ratios("+shift", "+shift 0.5")),
    ("KV shift at half the chunk mean against the query rule alone, generated set, 50 questions",
     "blend_epic_query_generated50.json", "blend_kv_shift_half_generated50.json",
     _at_both_ratios("", "+shift 0.5")),
    ("KV shift at half the chunk mean against the whole mean, generated set, 50 questions",
     "blend_kv_shift_generated50.json", "blend_kv_shift_half_generated50.json",
     _at_both_ratios("+shift", "+shift 0.5")),
    ("KV shift at half the chunk mean against the query rule alone, MuSiQue, 8 questions", "blend_pareto_musique.json",
     "blend_kv_shift_half_musique8.json", _at_both_ratios("", "+shift 0.5")),
    ("The query rule alone and with the KV shift at half the chunk mean against the oracle ranking, generated set, "
     "50 questions", "blend_oracle_generated50.json", "blend_kv_shift_half_generated50.json",
     [(f"oracle {r}", f"blend {r} +shift 0.5") for r in ("0.15", "0.3")]),
    ("The query rule alone against the oracle ranking, generated set, 50 questions", "blend_oracle_generated50.json",
     "blend_epic_query_generated50.json", [(f"oracle {r}", f"blend {r}") for r in ("0.15", "0.3")]),
    ("KV shift at half the chunk mean against the query rule alone, MuSiQue, 20 questions",
     "blend_kv_shift_half_musique20.json", "blend_kv_shift_half_musique20.json", [("blend 0.15", "blend 0.15 +shift 0.5")]),
    ("The default kv_shift (0.5) against none, MuSiQue, 100 questions, bfloat16", "blend_bench_musique100_bf16.json",
     "blend_bench_musique100_bf16_shift.json", [("blend 0.15", "blend 0.15"), ("full reuse", "full reuse")]),
    ("The query rule against the oracle ranking, both with the default kv_shift, generated set, 100 questions",
     "blend_oracle_shift_generated100.json", "blend_oracle_shift_generated100.json", [("blend 0.3", "oracle 0.3")]),
    ("The query rule weighing the deviation's norm against its square, both with kv_shift 0.5, generated set, "
     "questions 0-99", "blend_kv_shift_half_generated200.json", "blend_query_norm_generated100.json",
     [(f"blend {r} +shift 0.5", f"blend {r}") for r in ("0.15", "0.3")]),
    ("The query rule weighing the deviation's norm against its square, both with kv_shift 0.5, MuSiQue, 8 questions",
     "blend_kv_shift_half_musique8.json", "blend_query_norm_musique8.json",
     [(f"blend {r} +shift 0.5", f"blend {r}") for r in ("0.15", "0.3")]),
    ("The query rule weighing the deviation's norm against its square, both with kv_shift 0.5, MuSiQue, 20 questions",
     "blend_kv_shift_half_musique20.json", "blend_query_norm_musique20.json", [("blend 0.15 +shift 0.5", "blend 0.15")]),
    ("EPIC's chunk starts with the query rule, generated set, 50 questions", "blend_epic_query_generated50.json",
     "blend_epic_query_generated50.json", _at_both_ratios("", "+start 16")),
]
STUDY_RUNS = [
    ("reuse_study.json", "What is reused (plain-PyTorch study, generated set)",
     "python benchmarks/reuse_study.py --num-questions 20 --bands 24 --out benchmarks/results/reuse_study.json "
     "(stopped after 12 questions)"),
    ("reuse_study_shift.json", "KV shift in the plain-PyTorch study (generated set)",
     "python benchmarks/reuse_study.py --num-questions 10 --start-tokens 0 --bands '' --related 0 --no-chunks --shift "
     "--out benchmarks/results/reuse_study_shift.json (stopped after 7 questions)"),
    ("reuse_study_shift_parts.json", "KV shift of K alone and V alone in the plain-PyTorch study (generated set)",
     "python benchmarks/reuse_study.py --num-questions 8 --ratios 0.15 --start-tokens 0 --bands '' --related 0 "
     "--no-chunks --shift-parts --out benchmarks/results/reuse_study_shift_parts.json (an earlier version of the "
     "script, which also ran '+shift'; stopped after 2 questions)"),
]
# The README's replay rows: the latest replay with plain vLLM on each kind of host (a label for all but the first).
HEADLINE_SERVE = [("serve_bench_c4_native_bf16.json", ""),
                  ("serve_bench_c4_amx_gather_bf16.json", "an AMX host")]
SERVE_RUN = ("serve_bench.json", "python benchmarks/serve_bench.py --out benchmarks/results/serve_bench.json")
# Later replays of some of its loads: (file, title, command); answers compared with SERVE_RUN's.
SERVE_RERUNS = [
    ("serve_bench_c4_amx_gather_bf16.json", "Serving under load in bfloat16 against plain vLLM, every server compiled, "
     "on the Intel Xeon host with AMX of the run below, with a dump's blocks gathered by the native copy "
     "(2026-12-01, a twentieth session), nothing else running",
     "python benchmarks/serve_bench.py --concurrency 1,4 --dtype bfloat16 --no-plot "
     "--out benchmarks/results/serve_bench_c4_amx_gather_bf16.json"),
    ("serve_bench_c4_amx_bf16.json", "Serving under load in bfloat16 against plain vLLM, every server compiled, on an "
     "Intel Xeon host with AMX, with the AMX variant of Blend's attention and the KV shift by whole pages "
     "(2026-12-01, a twentieth session), nothing else running",
     "python benchmarks/serve_bench.py --concurrency 1,4 --dtype bfloat16 --no-plot "
     "--out benchmarks/results/serve_bench_c4_amx_bf16.json"),
    ("serve_bench_c4_native_bf16.json", "Serving under load in bfloat16 against plain vLLM, every server compiled, with "
     "Blend's attention of 2026-11-29 (bfloat16 dot products, every run of rows native), on the AMD EPYC host of the "
     "run below, nothing else running (a nineteenth session)",
     "python benchmarks/serve_bench.py --concurrency 1,4 --dtype bfloat16 --no-plot "
     "--out benchmarks/results/serve_bench_c4_native_bf16.json"),
    ("serve_bench_c4_after_split.json", "Issue 55's check, after the split: the replay at concurrency 4 from the commit "
     "that split the scheduler side (3fccdfb, after the forward's phases 35ea0d3), float32 as that code's "
     "benchmarks ran, right after the run before the split (serve_bench_c4_before_split.json, a11829a); same host, "
     "nothing else running (2026-11-28, a thirteenth session)",
     "python benchmarks/serve_bench.py --concurrency 4 --no-plain --no-plot --out "
     "benchmarks/results/serve_bench_c4_after_split.json (from a worktree at 3fccdfb)"),
    ("serve_bench_c4_before_split.json", "Issue 55's check, before the split: the same replay from a11829a",
     "python benchmarks/serve_bench.py --concurrency 4 --no-plain --no-plot --out "
     "benchmarks/results/serve_bench_c4_before_split.json (from a worktree at a11829a)"),
    ("serve_bench_c4_compiled_bf16.json", "Serving under load in bfloat16 against plain vLLM, every server with vLLM's "
     "compiled forward (its default; the runs below were eager), on an AMD EPYC host with AVX-512-BF16 about twice as "
     "slow as the one of the runs below, nothing else running (2026-11-29, an eighteenth session)",
     "python benchmarks/serve_bench.py --concurrency 1,4 --dtype bfloat16 --no-plot "
     "--out benchmarks/results/serve_bench_c4_compiled_bf16.json"),
    ("serve_bench_c4_bf16_vn.json", "Serving under load in bfloat16 against plain vLLM after the query rule's V norms "
     "over the second half of the layers and async_prefix_loads \"auto\" (2026-11-28, a twelfth session, the same "
     "host, nothing else running)",
     "python benchmarks/serve_bench.py --concurrency 1,4 --dtype bfloat16 --no-plot "
     "--out benchmarks/results/serve_bench_c4_bf16_vn.json"),
    ("serve_bench_c4_bf16.json", "Serving under load in bfloat16 against plain vLLM (2026-11-28, an eleventh session, "
     "AVX-512-BF16 host, nothing else running; plain vLLM's requests share a cache_salt per phase)",
     "python benchmarks/serve_bench.py --concurrency 1,4 --dtype bfloat16 --no-plot "
     "--out benchmarks/results/serve_bench_c4_bf16.json"),
    ("serve_bench_c4_short_regions.json", "Serving under load, concurrency 4, with the load buffers reused and only "
     "short regions first (2026-11-27, a third session on an AVX-512 host, right after the RAG stream runs below)",
     "python benchmarks/serve_bench.py --concurrency 4 --out benchmarks/results/serve_bench_c4_short_regions.json"),
    ("serve_bench_c4_s8.json", "Serving under load, concurrency 4, after dump gathers became page-to-block copies "
     "(2026-11-27, a later session on an AVX-512 host, right after the RAG stream runs below)",
     "python benchmarks/serve_bench.py --concurrency 4 --out benchmarks/results/serve_bench_c4_s8.json"),
    ("serve_bench_c4_signed_rope.json", "Serving under load, concurrency 4, with loaded keys rotated backwards by vLLM's "
     "fused kernel (signed_cos_sin_cache) instead of rotate_keys: right after the next section's run, same host",
     "python benchmarks/serve_bench.py --concurrency 4 --out benchmarks/results/serve_bench_c4_signed_rope.json"),
    ("serve_bench_c4_s7.json", "Serving under load, concurrency 4 again, on a host with AVX-512 (2026-11-27, same "
     "session as the RAG stream runs with --logprobs)",
     "python benchmarks/serve_bench.py --concurrency 4 --out benchmarks/results/serve_bench_c4_s7.json"),
    ("serve_bench_c4_rerun.json", "Serving under load, concurrency 4 again: after the probe's rows kept their KV and "
     "with the AVX2 attention kernel, on a host without AVX-512 (slower than the run above: compare ratios)",
     "python benchmarks/serve_bench.py --concurrency 4 --out benchmarks/results/serve_bench_c4_rerun.json"),
]
# RAG request streams against plain vLLM (benchmarks/rag_traffic.py): (file, title, command, file whose plain
# runs a Blend-only run is compared with: the same stream and plain server)
# (result file, section title, command, file whose plain vLLM rows this one is compared with, or None)
TRAFFIC_RUNS = [
    ('rag_traffic_zipf48_c4_warm2c_s31_bf16.json', "Blend alone with the committed rule again, right after the rule before (the third of three Blend runs against one plain run)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_warm2c_s31_bf16.json", 'rag_traffic_zipf48_c4_warm2_s31_bf16.json'),
    ('rag_traffic_zipf48_c4_ev4any_s31_bf16.json', "Blend alone with the rule before (4 lookups of evidence, every lookup counted; EVIDENCE_REQUESTS 4 and RecentHits.add counting any lookup in the source for this run), right after the committed rule's first run",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_ev4any_s31_bf16.json", 'rag_traffic_zipf48_c4_warm2_s31_bf16.json'),
    ('rag_traffic_zipf48_c4_warm2b_s31_bf16.json', "Blend alone right after, with the committed rule: a cold lookup counts only when it found the threshold's share (2026-12-07, a thirty-first session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_warm2b_s31_bf16.json", 'rag_traffic_zipf48_c4_warm2_s31_bf16.json'),
    ('rag_traffic_zipf48_c4_warm2_s31_bf16.json', "The Zipf stream at concurrency 4 with admission's evidence from 2 lookups, a cold start's lookups counted when they found anything (a first version, not kept: the block every prompt shares made them count), plain vLLM then Blend back to back, right after the no-reuse run (the same host, 2026-12-07, a thirty-first session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_warm2_s31_bf16.json', None),
    ('rag_traffic_fresh36_warm2_s31_bf16.json', "RAG stream with no reuse, 36 requests, one untimed warm-up request per server, with admission's evidence from 2 lookups made after a request finished (run with the first version, where a cold lookup counted when it found anything; the committed rule decides the same here: the warm-up finds nothing, every later lookup is warm), an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, plain vLLM then Blend back to back, nothing else running (2026-12-07, a thirty-first session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --fresh --num-requests 36 --concurrency 2 --warmup 1 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_fresh36_warm2_s31_bf16.json', None),
    ('rag_traffic_zipf48_c4_pass1b_s30_bf16.json', "The Zipf stream at concurrency 4 again with a prefill passed once, plain vLLM then Blend back to back, at the end of the session (the same host, 2026-12-07, a thirtieth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_pass1b_s30_bf16.json', None),
    ('rag_traffic_zipf48_c4_pass0_s30_bf16.json', "Blend alone right after with no pass at all (MAX_PASSES_PER_PREFILL 0 in the source for this run: a blend request waits for every running prefill's prompt), not adopted",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_pass0_s30_bf16.json", 'rag_traffic_zipf48_c4_pass1b_s30_bf16.json'),
    ('rag_traffic_zipf48_c2_pass1_s30_bf16.json', "The Zipf stream at concurrency 2 with a prefill passed by one blend request at most and each stored block read once per step, plain vLLM then Blend back to back, right after the two concurrency-4 runs (the same host, 2026-12-07, a thirtieth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c2_pass1_s30_bf16.json', None),
    ('rag_traffic_zipf48_c4_pass1_s30_bf16.json', "The Zipf stream at concurrency 4 with a prefill passed by one blend request at most (BlendFirstScheduler's MAX_PASSES_PER_PREFILL 1) and each stored block read once per step, an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, plain vLLM then Blend back to back, nothing else running (2026-12-07, a thirtieth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_pass1_s30_bf16.json', None),
    ('rag_traffic_zipf48_c4_passany_s30_bf16.json', "Blend alone right after with the bound lifted (MAX_PASSES_PER_PREFILL 100 in the source for this run: the scheduler before), the same host",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_passany_s30_bf16.json", 'rag_traffic_zipf48_c4_pass1_s30_bf16.json'),
    ('rag_traffic_zipf48_c2_s29_bf16.json', "The Zipf stream at concurrency 2 with use_layerwise on by default, plain vLLM then Blend back to back, right after the four concurrency-4 runs (the same host, 2026-12-07, a twenty-ninth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c2_s29_bf16.json', None),
    ('rag_traffic_zipf48_c4_s29_bf16.json', "The Zipf stream at concurrency 4, whole loads (use_layerwise off, the default then), an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, plain vLLM then Blend back to back, the first of four Blend runs in alternating order, nothing else running (2026-12-07, a twenty-ninth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_s29_bf16.json', None),
    ('rag_traffic_zipf48_c4_layerwise_s29_bf16.json', "Blend alone with use_layerwise true, right after (second of the four)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --connector-config '{\"use_layerwise\": true}' --out benchmarks/results/rag_traffic_zipf48_c4_layerwise_s29_bf16.json", 'rag_traffic_zipf48_c4_s29_bf16.json'),
    ('rag_traffic_zipf48_c4_whole_s29_bf16.json', "Blend alone with whole loads again, right after (third of the four)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_whole_s29_bf16.json", 'rag_traffic_zipf48_c4_s29_bf16.json'),
    ('rag_traffic_zipf48_c4_layerwise2_s29_bf16.json', "Blend alone with use_layerwise true again, right after (fourth of the four)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --connector-config '{\"use_layerwise\": true}' --out benchmarks/results/rag_traffic_zipf48_c4_layerwise2_s29_bf16.json", 'rag_traffic_zipf48_c4_s29_bf16.json'),
    ('rag_traffic_zipf48_c4_s28_bf16.json', "The Zipf stream at concurrency 4 with use_layerwise on (the new default), an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, plain vLLM then Blend back to back, nothing else running (2026-12-07, a twenty-eighth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_s28_bf16.json', None),
    ('rag_traffic_zipf48_c4_layerwise_s28_bf16.json', "Blend alone with use_layerwise true again, right after the whole loads' run (the same host and code)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --connector-config '{\"use_layerwise\": true}' --out benchmarks/results/rag_traffic_zipf48_c4_layerwise_s28_bf16.json", None),
    ('rag_traffic_zipf48_c4_whole_s28_bf16.json', "Blend alone with use_layerwise false (whole loads before the forward), right after (the same host and code)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --connector-config '{\"use_layerwise\": false}' --out benchmarks/results/rag_traffic_zipf48_c4_whole_s28_bf16.json", None),
    ('rag_traffic_zipf48_layerwise_s27_bf16.json', "The same stream with use_layerwise true, right after (the same host and code)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --connector-config '{\"use_layerwise\": true}' --out benchmarks/results/rag_traffic_zipf48_layerwise_s27_bf16.json", None),
    ('rag_traffic_zipf48_blend_s27_bf16.json', "Blend alone on the plain directory with blocks stored layer-major and a step's reads landing layer by layer (28c390b; use_layerwise off, the default), an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, nothing else running (2026-12-07, a twenty-seventh session): the check that the new block form costs the stream nothing (0.119-0.122 req/s in the last session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --out benchmarks/results/rag_traffic_zipf48_blend_s27_bf16.json", None),
    ('rag_traffic_zipf48_c4_s26_bf16.json', "The Zipf stream at concurrency 4 on an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, plain vLLM then Blend back to back, nothing else running, after the +5 ms mount's runs (2026-12-07, a twenty-sixth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_s26_bf16.json', None),
    ('rag_traffic_zipf48_c2_s26_bf16.json', 'The same stream at concurrency 2 on the same host, plain vLLM then Blend back to back, right after',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c2_s26_bf16.json', None),
    ('rag_traffic_zipf48_latency5_rw_s26_bf16.json', 'The +5 ms mount on an AMD EPYC host with AVX-512-BF16 (2 cores), bfloat16, Blend alone, a block read and written in one call per 8 MiB, its header with its payload (72c92d1; the calls were of 256 KiB), nothing else running (2026-12-07, a twenty-sixth session)',
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_rw_s26_bf16.json", None),
    ('rag_traffic_zipf48_dir_s26_bf16.json', 'The plain directory, the same host, with the one-call reads (writes as before), just before',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --out benchmarks/results/rag_traffic_zipf48_dir_s26_bf16.json', None),
    ('rag_traffic_zipf48_latency5_s26_bf16.json', 'The +5 ms mount with the one-call reads (writes as before), first of the session',
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_s26_bf16.json", None),
    ('rag_traffic_zipf48_latency5_old_s26_bf16.json', "The +5 ms mount with the store's native module of 9880b42 (calls of 256 KiB, the header read and written apart), right after the run with both changes",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_old_s26_bf16.json", None),
    ('rag_traffic_zipf48_latency5_direct_s26_bf16.json', 'The +5 ms mount with O_DIRECT (io_direct true) and the one-call reads and writes, right after',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount \'latency_ms=5\' --store-config \'{"io_direct": true}\' --out benchmarks/results/rag_traffic_zipf48_latency5_direct_s26_bf16.json', None),
    ('rag_traffic_zipf48_c4_s25_f32.json', "The Zipf stream at concurrency 4 on an Intel host with AVX-512F but neither AVX512-BF16 nor AMX (2 cores), float32, plain vLLM then Blend back to back, nothing else running (2026-12-07, a twenty-fifth session)",
     'python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_s25_f32.json', None),
    ('rag_traffic_zipf48_latency5_s25_f32.json', "The +5 ms mount on the same host, float32, Blend alone, with a lookup's stat threads sized by what a stat cost in the last lookup (4aa2e2f) and the test mount answering 64 calls at once",
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_s25_f32.json", None),
    ('rag_traffic_zipf48_dir_s25_f32.json', 'The plain directory, the same code and host, right after',
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --out benchmarks/results/rag_traffic_zipf48_dir_s25_f32.json", None),
    ('rag_traffic_zipf48_latency5_oldstat_s25_f32.json', "The +5 ms mount with the lookup threads of 97e2ddc (four paths per thread at least, up to 32; the store's native module of that commit), the test mount as above, right after",
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_oldstat_s25_f32.json", None),
    ('rag_traffic_zipf48_latency5_prefetch_s25_f32.json', "The +5 ms mount with chunk blocks read while their request waits (prefetch_chunks auto), 4aa2e2f, right after",
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount 'latency_ms=5' --connector-config '{\"prefetch_chunks\": \"auto\"}' --out benchmarks/results/rag_traffic_zipf48_latency5_prefetch_s25_f32.json", None),
    ('rag_traffic_zipf48_c4_hit50_s25_f32.json', "The Zipf stream at concurrency 4 on the same host blending only requests with at least half of their chunk tokens found (min_hit_share 0.5), Blend alone, right after, against plain vLLM's run of rag_traffic_zipf48_c4_s25_f32.json",
     'python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --servers blend --no-plot --blend-config \'{"min_hit_share": 0.5}\' --out benchmarks/results/rag_traffic_zipf48_c4_hit50_s25_f32.json', 'rag_traffic_zipf48_c4_s25_f32.json'),
    ('rag_traffic_zipf48_latency5_cpu_s25_f32.json', "The +5 ms mount again with the test mount's server CPU recorded (7b88825), right after: what the Python passthrough itself takes of the 2 cores",
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount latency_ms=5 --out benchmarks/results/rag_traffic_zipf48_latency5_cpu_s25_f32.json", None),
    ('rag_traffic_zipf48_fuse0_s25_f32.json', 'The FUSE mount with nothing added, right after',
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount latency_ms=0 --out benchmarks/results/rag_traffic_zipf48_fuse0_s25_f32.json", None),
    ('rag_traffic_zipf48_latency5_io64_s25_f32.json', "The +5 ms mount with 64 IO threads (io_threads 64; 16 by default), right after",
     "python benchmarks/rag_traffic.py --dtype float32 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --mount latency_ms=5 --store-config '{\"io_threads\": 64}' --out benchmarks/results/rag_traffic_zipf48_latency5_io64_s25_f32.json", None),
    ('rag_traffic_zipf48_c4_s24_bf16.json', "The Zipf stream at concurrency 4 on an Intel host with AMX (2 cores), plain vLLM then Blend back to back, nothing else running: where vLLM's dense prefill runs in AMX, Blend is slower than plain vLLM (2026-12-06, a twenty-fourth session)",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_s24_bf16.json', None),
    ('rag_traffic_zipf48_c2_s24_bf16.json', 'The same at concurrency 2, right after',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c2_s24_bf16.json', None),
    ('rag_traffic_zipf48_c4_noshift_s24_bf16.json', "The Zipf stream at concurrency 4 on the AMX host without the KV shift (kv_shift 0), Blend alone, right after, against plain vLLM's run of rag_traffic_zipf48_c4_s24_bf16.json",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --servers blend --no-plot --blend-config \'{"compute_meta": {"model.layers.1.self_attn.attn": {"ratio": 0.15, "kv_shift": 0}}}\' --out benchmarks/results/rag_traffic_zipf48_c4_noshift_s24_bf16.json', 'rag_traffic_zipf48_c4_s24_bf16.json'),
    ('rag_traffic_zipf48_c4_hkvd_s24_bf16.json', "The same with CacheBlend's HKVD selection (no probe; kv_shift 0.5), Blend alone, right after",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --servers blend --no-plot --blend-config \'{"compute_meta": {"model.layers.1.self_attn.attn": {"ratio": 0.15, "kv_shift": 0.5, "selection": "hkvd"}}}\' --out benchmarks/results/rag_traffic_zipf48_c4_hkvd_s24_bf16.json', 'rag_traffic_zipf48_c4_s24_bf16.json'),
    ('rag_traffic_fresh36_s24_f32.json', "RAG stream with no reuse, 36 requests, one untimed warm-up request per server, float32 (issue 54's setting), on the AMX host, plain vLLM then Blend back to back, nothing else running (2026-12-06, a twenty-fourth session)",
     'python benchmarks/rag_traffic.py --dtype float32 --num-requests 36 --concurrency 2 --warmup 1 --fresh --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_fresh36_s24_f32.json', None),
    ('rag_traffic_fresh36_s24_bf16.json', 'The same no-reuse stream in bfloat16 on the AMX host, right after the runs above',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 36 --concurrency 2 --warmup 1 --fresh --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_fresh36_s24_bf16.json', None),
    ('rag_traffic_zipf48_c4_hit80_s24_bf16.json', "The Zipf stream at concurrency 4 on the AMX host blending only requests with at least 80% of their chunk tokens found (min_hit_share 0.8), Blend alone, against plain vLLM's run of rag_traffic_zipf48_c4_s24_bf16.json",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --servers blend --no-plot --blend-config \'{"min_hit_share": 0.8}\' --out benchmarks/results/rag_traffic_zipf48_c4_hit80_s24_bf16.json', 'rag_traffic_zipf48_c4_s24_bf16.json'),
    ('rag_traffic_zipf48_c4_plain2_s24_bf16.json', "Plain vLLM alone again on the same stream and host, last: how far plain vLLM's rate moves from one run to the next",
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --servers plain --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_plain2_s24_bf16.json', None),
    ('rag_traffic_zipf48_latency5_dram2_s24_bf16.json', 'The +5 ms mount on the AMX host with a 2 GiB DRAM tier (dram_capacity_gb 2), lookups batched, Blend alone, last in the session',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount latency_ms=5 --no-plot --store-config \'{"dram_capacity_gb": 2}\' --out benchmarks/results/rag_traffic_zipf48_latency5_dram2_s24_bf16.json', None),
    ('rag_traffic_zipf48_latency5_prefetch_s24_bf16.json', 'The +5 ms mount on the AMX host with chunk blocks read while their request waits (prefetch_chunks auto), no DRAM tier, right after',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount latency_ms=5 --no-plot --connector-config \'{"prefetch_chunks": "auto"}\' --out benchmarks/results/rag_traffic_zipf48_latency5_prefetch_s24_bf16.json', None),
    ('rag_traffic_zipf48_latency5_batched_s24_bf16.json', "The +5 ms mount with a plan's lookups batched (be47f14: each chunk's first block in every kind in one call, the found chunks' other blocks in a second), Blend alone, nothing else running, on an Intel host with AMX (2 cores; 2026-12-06, a twenty-fourth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount 'latency_ms=5' --no-plot --out benchmarks/results/rag_traffic_zipf48_latency5_batched_s24_bf16.json", None),
    ('rag_traffic_zipf48_latency5_s24_bf16.json', 'The +5 ms mount before batching (587ce09), the same host, just before',
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount 'latency_ms=5' --no-plot --out benchmarks/results/rag_traffic_zipf48_latency5_s24_bf16.json", None),
    ('rag_traffic_zipf48_dir_batched_s24_bf16.json', 'The plain directory with the lookups batched, the same host',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --out benchmarks/results/rag_traffic_zipf48_dir_batched_s24_bf16.json', None),
    ('rag_traffic_zipf48_dir_s24_bf16.json', 'The plain directory before batching (587ce09), the same host',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --no-plot --out benchmarks/results/rag_traffic_zipf48_dir_s24_bf16.json', None),
    ('rag_traffic_zipf48_fuse0_s24_bf16.json', "The FUSE mount with nothing added (what the test mount's own Python passthrough costs), lookups batched, the same host",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount 'latency_ms=0' --no-plot --out benchmarks/results/rag_traffic_zipf48_fuse0_s24_bf16.json", None),
    ("rag_traffic_zipf48_c4_s23_bf16.json", "The Zipf stream at concurrency 4 with the committed code (admission's "
     "evidence after 4 requests, sighted blocks counted), plain vLLM then Blend back to back, nothing else running, "
     "on a new machine of the 22nd session's kind (AMD EPYC, AVX-512-BF16, 2 cores), where Blend's store IO took "
     "about twice as long (2026-12-06, a twenty-third session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 "
     "--no-plot --out benchmarks/results/rag_traffic_zipf48_c4_s23_bf16.json", None),
    ("rag_traffic_zipf48_c2_s23_bf16.json", "The same at concurrency 2, right after: Blend makes the decisions of "
     "the 22nd session's run (the same hits, blends and bytes written), plain vLLM runs as fast, Blend slower",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 "
     "--no-plot --out benchmarks/results/rag_traffic_zipf48_c2_s23_bf16.json", None),
    ("rag_traffic_zipf48_latency5_s23_bf16.json", "The +5 ms mount on the same machine, Blend alone, the committed "
     "code, right after the plain directory's run below (2026-12-06, a twenty-third session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --no-plot --out benchmarks/results/rag_traffic_zipf48_latency5_s23_bf16.json",
     None),
    ("rag_traffic_zipf48_dir_s23_bf16.json", "The same stream on the plain directory, Blend alone, just before",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --no-plot --out benchmarks/results/rag_traffic_zipf48_dir_s23_bf16.json", None),
    ("rag_traffic_zipf48_fuse0_s23_bf16.json", "The same stream through the FUSE mount with nothing added (what the "
     "test mount's own Python passthrough costs), after the Zipf pairs above",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=0' --no-plot --out benchmarks/results/rag_traffic_zipf48_fuse0_s23_bf16.json",
     None),
    ("rag_traffic_fresh48_s23_bf16.json", "RAG stream with no reuse, 48 requests, one untimed warm-up request per "
     "server, the committed code, plain vLLM then Blend back to back, nothing else running, on the machine of the "
     "runs above, right after them (2026-12-06, a twenty-third session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --fresh "
     "--logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_fresh48_s23_bf16.json", None),
    ("rag_traffic_fresh48_blend2_s23_bf16.json", "The same no-reuse stream, Blend alone again right after, against "
     "plain vLLM's run of rag_traffic_fresh48_s23_bf16.json: how far one Blend run of this stream moves from the next",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --fresh "
     "--logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_fresh48_blend2_s23_bf16.json",
     "rag_traffic_fresh48_s23_bf16.json"),
    ("rag_traffic_zipf48_c4_ev4seen_bf16.json", "Admission as committed: evidence after 4 requests, chunk blocks found sighted counted as reuse; the Zipf stream at concurrency 4, Blend alone, right after plain vLLM's run of rag_traffic_zipf48_c4_ev3seen_bf16.json, nothing else running (2026-12-06, a twenty-second session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c4_ev4seen_bf16.json", "rag_traffic_zipf48_c4_ev3seen_bf16.json"),
    ("rag_traffic_zipf48_c4_ev3seen_bf16.json", "The Zipf stream at concurrency 4 with admission's evidence after 3 requests, sighted blocks counted (a variant measured, not kept: fewer hits, the tail above plain vLLM's), plain vLLM then Blend back to back, nothing else running (2026-12-06, a twenty-second session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_zipf48_c4_ev3seen_bf16.json", None),
    ("rag_traffic_zipf48_c2_ev3seen_bf16.json", "Admission's evidence after 3 requests (a variant measured, not kept: fewer hits on the Zipf streams), chunk blocks found sighted counted as well as stored; the Zipf stream at concurrency 2, Blend alone, against plain vLLM's run of rag_traffic_zipf48_c2_s22_bf16.json on the same host an hour before, nothing else running (2026-12-06, a twenty-second session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c2_ev3seen_bf16.json", "rag_traffic_zipf48_c2_s22_bf16.json"),
    ("rag_traffic_fresh36_ev3seen_bf16.json", "The same variant on the no-reuse stream, Blend alone, right after, against plain vLLM's run of rag_traffic_fresh36_s22_bf16.json",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --fresh --num-requests 36 --warmup 1 --concurrency 2 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_fresh36_ev3seen_bf16.json", "rag_traffic_fresh36_s22_bf16.json"),
    ("rag_traffic_zipf48_c2_ev2seen_bf16.json", "Admission's evidence after 2 requests, sighted blocks counted as reuse: the Zipf stream, Blend alone (a variant measured, not kept)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c2_ev2seen_bf16.json", "rag_traffic_zipf48_c2_s22_bf16.json"),
    ("rag_traffic_zipf48_c2_ev2_bf16.json", "Admission's evidence after 2 requests, only stored blocks counted (a variant measured, not kept): the Zipf stream, Blend alone",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_zipf48_c2_ev2_bf16.json", "rag_traffic_zipf48_c2_s22_bf16.json"),
    ("rag_traffic_fresh36_ev2_bf16.json", "Admission's evidence after 2 requests (a variant measured, not kept): the no-reuse stream, Blend alone",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --fresh --num-requests 36 --warmup 1 --concurrency 2 --logprobs 20 --alone 0 --no-plot --servers blend --out benchmarks/results/rag_traffic_fresh36_ev2_bf16.json", "rag_traffic_fresh36_s22_bf16.json"),
    ("rag_traffic_zipf48_c2_s22_bf16.json", "RAG stream with reuse (Zipf), 48 requests at concurrency 2, bfloat16, "
     "both servers compiled, the README's config at ratio 0.15, the code of f1e17e3 (the attention of 2026-11-29, "
     "the native dump gather), plain vLLM then Blend back to back, nothing else running, on an AMD EPYC host with "
     "AVX-512-BF16 about twice as slow as the one of the compiled run of 2026-11-29 (2026-12-06, a twenty-second "
     "session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 --alone 0 "
     "--no-plot --out benchmarks/results/rag_traffic_zipf48_c2_s22_bf16.json", None),
    ("rag_traffic_fresh36_s22_bf16.json", "RAG stream with no reuse, 36 requests, one untimed warm-up request per "
     "server, bfloat16, both servers compiled, the code of f1e17e3, plain vLLM then Blend back to back, nothing else "
     "running, on the host of the run above, right after it (2026-12-06, a twenty-second session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --fresh --num-requests 36 --warmup 1 --concurrency 2 "
     "--logprobs 20 --alone 0 --no-plot --out benchmarks/results/rag_traffic_fresh36_s22_bf16.json", None),
    ("rag_traffic_zipf48_c4_native_bf16.json", "RAG stream with reuse (Zipf), 48 requests at concurrency 4, bfloat16, "
     "both servers compiled, the README's config at ratio 0.15, with Blend's attention of 2026-11-29 (bfloat16 dot "
     "products, every run of rows native); Blend, then plain vLLM right after (rag_traffic_zipf48_c4_plain_bf16.json), "
     "nothing else running, on the AMD EPYC host of the run below (a nineteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --servers blend "
     "--no-plot --out benchmarks/results/rag_traffic_zipf48_c4_native_bf16.json", "rag_traffic_zipf48_c4_plain_bf16.json"),
    ("rag_traffic_zipf48_c4_plain_bf16.json", "Plain vLLM alone on the Zipf stream at concurrency 4, compiled, right after "
     "the Blend run above (a nineteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --servers plain "
     "--no-plot --out benchmarks/results/rag_traffic_zipf48_c4_plain_bf16.json", None),
    ("rag_traffic_24_after_split.json", "Issue 55's check, after the split: the Zipf stream, 24 requests at concurrency "
     "2, Blend alone, from the commit that split the scheduler side (3fccdfb), float32 as that code's benchmarks ran, "
     "right after the run before the split (rag_traffic_24_before_split.json, a11829a); same host, nothing else running",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --servers blend --warmup 1 --alone 0 "
     "--out benchmarks/results/rag_traffic_24_after_split.json (from a worktree at 3fccdfb)", None),
    ("rag_traffic_24_before_split.json", "Issue 55's check, before the split: the same stream from a11829a",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --servers blend --warmup 1 --alone 0 "
     "--out benchmarks/results/rag_traffic_24_before_split.json (from a worktree at a11829a)", None),
    ("rag_traffic_zipf110_hang300_s16_bf16.json", "The mount that hangs for 5 minutes under the stream with the "
     "current code: lookups that ask a chunk's first block first, blocks known stored answered from memory (forgotten "
     "when the store counts as down), a found chunk's blocks asked in one kind (code 32eb03a; Blend alone, nothing else "
     "running; plain vLLM's rows from its run in rag_traffic_zipf110_hang300_bf16.json, same stream; 2026-11-29, a "
     "sixteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 110 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'hang=open+read+write@60/300' "
     "--out benchmarks/results/rag_traffic_zipf110_hang300_s16_bf16.json", None),
    ("rag_traffic_zipf110_hang300_deadline2_bf16.json", "The mount that hangs for 5 minutes under the stream again, "
     "after a load's deadline became its bytes at load_min_mb_s plus 2 s and the store probes the mount as soon as the "
     "IO that held it returns (code 76bab67; Blend alone, nothing else running; plain vLLM's rows from its run in "
     "rag_traffic_zipf110_hang300_bf16.json, the last session, same stream; 2026-11-28, a fourteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 110 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'hang=open+read+write@60/300' "
     "--out benchmarks/results/rag_traffic_zipf110_hang300_deadline2_bf16.json", None),
    ("rag_traffic_zipf48_latency5_kindfirst_bf16.json", "The +5 ms stream with a found chunk's other blocks looked up "
     "in the kind its first block was found in, the rest in the other kinds (code 32eb03a, Blend alone, nothing else "
     "running; 2026-11-29, a sixteenth session; the plain directory: rag_traffic_zipf48_dir_kinds_bf16.json)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_kindfirst_bf16.json",
     None),
    ('rag_traffic_zipf48_latency5_kinds_bf16.json', "The +5 ms stream with the committed lookups: a chunk's first block first, its other blocks only in the kind it was found in, 8 exact prompt blocks before the rest, blocks known stored answered from memory for 30 s, the root checked once a second (code 85a4044, prefetch_chunks off; 2026-11-29, a fifteenth session). The plain directory right after: rag_traffic_zipf48_dir_kinds_bf16.json",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_kinds_bf16.json", None),
    ('rag_traffic_zipf48_dir_kinds_bf16.json', 'The same stream on the plain directory, the same code (the run right after the +5 ms one shared the cores with unit tests and was not kept: this one followed the DRAM-tier run)',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --out benchmarks/results/rag_traffic_zipf48_dir_kinds_bf16.json', None),
    ('rag_traffic_zipf48_latency5_dram2_kinds_bf16.json', 'The +5 ms stream with a 2 GiB DRAM tier and the committed defaults (code 85a4044, prefetch_chunks off), between the two plain-directory runs',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount \'latency_ms=5\' --store-config \'{"dram_capacity_gb": 2}\' --out benchmarks/results/rag_traffic_zipf48_latency5_dram2_kinds_bf16.json', None),
    ('rag_traffic_zipf48_latency5_prefetch_bf16.json', "The +5 ms stream with chunk blocks read while their request waits in the queue (prefetch_chunks auto, then the default; a chunk's first block looked up first in every kind; code bf2e237, 2026-11-29, a fifteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_prefetch_bf16.json", None),
    ('rag_traffic_zipf48_latency5_noprefetch_bf16.json', 'The same code without prefetching (a UCM_CONFIG_FILE saying prefetch_chunks: false), right after',
     "UCM_CONFIG_FILE=noprefetch.yaml python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_noprefetch_bf16.json", None),
    ('rag_traffic_zipf48_latency5_dram2_bf16.json', 'The +5 ms stream with a 2 GiB DRAM tier in front of the mount (code bf2e237, prefetch_chunks auto)',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --mount \'latency_ms=5\' --store-config \'{"dram_capacity_gb": 2}\' --out benchmarks/results/rag_traffic_zipf48_latency5_dram2_bf16.json', None),
    ('rag_traffic_zipf48_dir_dram2_bf16.json', 'The plain directory with the same 2 GiB DRAM tier, right after',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --store-config \'{"dram_capacity_gb": 2}\' --out benchmarks/results/rag_traffic_zipf48_dir_dram2_bf16.json', None),
    ('rag_traffic_zipf48_dir_prefetch_auto_bf16.json', 'The plain directory with the code of the prefetch run (code bf2e237: reads never slow there, nothing prefetched)',
     'python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 --servers blend --out benchmarks/results/rag_traffic_zipf48_dir_prefetch_auto_bf16.json', None),
    ("rag_traffic_zipf48_latency5_io16_final_bf16.json", "The +5 ms stream with the committed store: lookups up to 32 "
     "stats at once, 16 IO threads by default (code 76bab67, nothing else running; 2026-11-28, a fourteenth session). "
     "The plain directory right after: rag_traffic_zipf48_dir_final_bf16.json",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_io16_final_bf16.json",
     None),
    ("rag_traffic_zipf48_dir_final_bf16.json", "The same stream, Blend's store on the plain directory, with the "
     "committed store (code 76bab67), right after the +5 ms run and the hang",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --out benchmarks/results/rag_traffic_zipf48_dir_final_bf16.json", None),
    ("rag_traffic_zipf48_latency5_stats16_bf16.json", "The +5 ms stream with the store's lookups statting 16 paths "
     "at once, 8 or more per thread (code 4788d8b; 4 IO threads as then; 2026-11-28, a fourteenth session; the run "
     "before the change: rag_traffic_zipf48_latency5_bf16.json)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_stats16_bf16.json",
     None),
    ("rag_traffic_zipf48_latency5_io16_bf16.json", "The same with 16 IO threads (code aeac151, `--store-config "
     "'{\"io_threads\": 16}'`), right after",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --store-config '{\"io_threads\": 16}' "
     "--out benchmarks/results/rag_traffic_zipf48_latency5_io16_bf16.json", None),
    ("rag_traffic_zipf48_fuse0_bf16.json", "The same stream through the FUSE mount with nothing added (what the test "
     "mount's own Python passthrough costs; code aeac151, 4 IO threads), between the two",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=0' --out benchmarks/results/rag_traffic_zipf48_fuse0_bf16.json", None),
    ("rag_traffic_zipf48_latency5_bf16.json", "A slow mount under the stream: the Zipf stream, 48 requests at concurrency "
     "2, SmolLM2 in bfloat16, Blend alone, its store behind a FUSE mount that adds 5 ms to every file operation (a "
     "loaded NFS server); a test suite shared the cores for about a minute (2026-11-28, a thirteenth session). The "
     "same stream on the plain directory: rag_traffic_zipf48_dir_bf16.json; with the store's stats in parallel from "
     "32 paths (a change reverted): rag_traffic_zipf48_latency5_parallel_bf16.json",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_bf16.json", None),
    ("rag_traffic_zipf48_dir_bf16.json", "The same stream, Blend's store on the plain directory, right after",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --out benchmarks/results/rag_traffic_zipf48_dir_bf16.json", None),
    ("rag_traffic_zipf48_latency5_parallel_bf16.json", "The +5 ms stream again with the store's stats in parallel from "
     "32 paths on (a change measured and reverted)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --warmup 1 --alone 0 "
     "--servers blend --mount 'latency_ms=5' --out benchmarks/results/rag_traffic_zipf48_latency5_parallel_bf16.json "
     "(code ba167a8)", None),
    ("rag_traffic_zipf110_hang300_bf16.json", "A mount that hangs under the stream: the Zipf stream, 110 requests at "
     "concurrency 2, SmolLM2 in bfloat16, one untimed warm-up request per server, Blend's store behind a FUSE mount "
     "whose opens, reads and writes hang from 60 s into the run for 300 s (stats and listings answer, as an NFS "
     "client with cached attributes), plain vLLM then Blend back to back, nothing else running (2026-11-28, a "
     "thirteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 110 --concurrency 2 --warmup 1 --alone 0 "
     "--mount 'hang=open+read+write@60/300' --out benchmarks/results/rag_traffic_zipf110_hang300_bf16.json", None),
    ("rag_traffic_zipf48_c4_compiled_bf16.json", "RAG stream with reuse (Zipf), 48 requests at concurrency 4, "
     "bfloat16, both servers compiled, the README's config at ratio 0.15, plain vLLM then Blend back to back, nothing "
     "else running, on an AMD EPYC host with AVX-512-BF16 about twice as slow as the one of the run below "
     "(2026-11-29, an eighteenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --no-plot "
     "--out benchmarks/results/rag_traffic_zipf48_c4_compiled_bf16.json", None),
    ("rag_traffic_zipf48_c2_compiled_bf16.json", "RAG stream with reuse (Zipf), 48 requests at concurrency 2, "
     "bfloat16, both servers with vLLM's compiled forward (its default; the run below was eager), the README's config "
     "at ratio 0.15, plain vLLM then Blend back to back, nothing else running (2026-11-29, a seventeenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_compiled_bf16.json", None),
    ("rag_traffic_zipf48_c2_bf16.json", "RAG stream with reuse (Zipf), 48 requests at concurrency 2, bfloat16 on an "
     "AVX-512-BF16 host, the README's config at ratio 0.15, plain vLLM then Blend back to back, nothing else running "
     "(2026-11-28, a tenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 48 --concurrency 2 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_bf16.json", None),
    ("rag_traffic_fresh36_compiled_seed1_bf16.json", "RAG stream with no reuse, another stream (seed 1), both servers "
     "compiled, 36 requests, one untimed warm-up request per server, bfloat16, plain vLLM then Blend back to back, "
     "nothing else running (2026-11-29, a seventeenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 36 --concurrency 2 --fresh --logprobs 20 "
     "--warmup 1 --seed 1 --out benchmarks/results/rag_traffic_fresh36_compiled_seed1_bf16.json", None),
    ("rag_traffic_fresh36_compiled_bf16.json", "RAG stream with no reuse, both servers with vLLM's compiled forward "
     "(its default; the runs before were eager), 36 requests, admission \"adaptive\", one untimed warm-up request per "
     "server, bfloat16, plain vLLM then Blend back to back, nothing else running (2026-11-29, a seventeenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 36 --concurrency 2 --fresh --logprobs 20 "
     "--warmup 1 --out benchmarks/results/rag_traffic_fresh36_compiled_bf16.json", None),
    ("rag_traffic_fresh36_bf16_s16.json", "RAG stream with no reuse again with the current code (plans asking a found "
     "chunk's blocks in one kind, dumps handed over by the dump queue), 36 requests, admission \"adaptive\", one "
     "untimed warm-up request per server, bfloat16, plain vLLM then Blend back to back, nothing else running "
     "(2026-11-29, a sixteenth session; the run before: rag_traffic_fresh36_bf16.json)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 36 --concurrency 2 --fresh --logprobs 20 "
     "--warmup 1 --out benchmarks/results/rag_traffic_fresh36_bf16_s16.json", None),
    ("rag_traffic_fresh36_bf16.json", "RAG stream with no reuse, 36 requests, admission \"adaptive\", each server "
     "warmed up with one untimed request, bfloat16 on an AVX-512-BF16 host, plain vLLM then Blend back to back, "
     "nothing else running (2026-11-28, a tenth session)",
     "python benchmarks/rag_traffic.py --dtype bfloat16 --num-requests 36 --concurrency 2 --fresh --logprobs 20 "
     "--warmup 1 --out benchmarks/results/rag_traffic_fresh36_bf16.json", None),
    ("qwen05_zipf48_c2_held.json", "Qwen2.5-Coder-0.5B-Instruct on the Zipf stream, 48 requests at concurrency 2, "
     "bfloat16, ratio 0.15, after BlendFirstScheduler holds a long Blend region behind a prefill that ends sooner "
     "(blend_holds), plain vLLM then Blend back to back, nothing else running (2026-11-28, an eleventh session; "
     "the same stream before the change: qwen05_zipf48_c2.json)",
     "python benchmarks/rag_traffic.py --model qwen2.5-coder-0.5b --dtype bfloat16 --ratio 0.15 "
     "--num-requests 48 --concurrency 2 --logprobs 20 --out benchmarks/results/qwen05_zipf48_c2_held.json", None),
    ("qwen05_zipf48_c2.json", "Qwen2.5-Coder-0.5B-Instruct on the Zipf stream, 48 requests at concurrency 2, "
     "bfloat16 on an AVX-512-BF16 host, Blend at ratio 0.15 (admission \"adaptive\"), the query rule by attention "
     "alone, plain vLLM then Blend back to back, nothing else running (2026-11-28, a tenth session)",
     "python benchmarks/rag_traffic.py --model qwen2.5-coder-0.5b --dtype bfloat16 --ratio 0.15 "
     "--num-requests 48 --concurrency 2 --logprobs 20 --out benchmarks/results/qwen05_zipf48_c2.json", None),
    ("qwen05_zipf24_c2.json", "Qwen2.5-Coder-0.5B-Instruct on the Zipf stream, 24 requests at concurrency 2, "
     "bfloat16 on an AVX-512-BF16 host, Blend at the README's ratio 0.3 (admission \"adaptive\"), plain vLLM then "
     "Blend back to back, nothing else running",
     "python benchmarks/rag_traffic.py --model qwen2.5-coder-0.5b --dtype bfloat16 --ratio 0.3 "
     "--num-requests 24 --concurrency 2 --logprobs 20 --out benchmarks/results/qwen05_zipf24_c2.json", None),
    ("rag_traffic_fresh36_admission.json", "RAG stream with no reuse, 36 requests, with admission (the default "
     "\"adaptive\": a segment's KV stored on its second sighting once the engine's requests stop finding their "
     "chunks; its first 4 requests store everything), each server warmed up with one untimed request, on an AVX2 "
     "host (2026-11-27, a sixth session)",
     "python benchmarks/rag_traffic.py --num-requests 36 --concurrency 2 --fresh --logprobs 20 --warmup 1 "
     "--out benchmarks/results/rag_traffic_fresh36_admission.json", None),
    ("rag_traffic_fresh_warmup.json", "RAG stream with no reuse, the same session as the short-region runs below, "
     "each server warmed up with one untimed request first (--warmup 1)",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --fresh --logprobs 20 --warmup 1 "
     "--out benchmarks/results/rag_traffic_fresh_warmup.json", None),
    ("rag_traffic_zipf48_c2_short_regions.json", "The Zipf stream, 48 requests at concurrency 2, with only short "
     "regions first, the same session as the runs below; plain vLLM's rows from its run at concurrency 2 there",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_short_regions.json", "rag_traffic_zipf48_c2_plain_s9.json"),
    ("rag_traffic_zipf48_c4_short_regions.json", "The Zipf stream, 48 requests at concurrency 4, with only short "
     "regions first (BlendFirstScheduler moves a blend request ahead only when its Blend work is at most one step "
     "budget of rows, and its short step admits other blend requests only within that), the same session as the "
     "next section; plain vLLM's rows from its run there",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_short_regions.json", "rag_traffic_zipf48_c4_plain_s9.json"),
    ("rag_traffic_zipf48_c4_s9.json", "The Zipf stream, 48 requests at concurrency 4, a later session (2026-11-27, "
     "the same kind of AVX-512 host) with the load buffers reused, high-hit requests sent again alone; plain vLLM's "
     "run at concurrency 4 right after it",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_s9.json; then --servers plain --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_plain_s9.json", "rag_traffic_zipf48_c4_plain_s9.json"),
    ("rag_traffic_zipf48_c2_plain_s9.json", "Plain vLLM alone on the Zipf stream at concurrency 2, right after the "
     "runs above (how much plain vLLM moves between runs of one session: compare with its run at 4)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --servers plain --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_plain_s9.json", None),
    ("rag_traffic_zipf48_c2_reused_buffers.json", "The Zipf stream, 48 requests at concurrency 2, Blend with its load "
     "buffers reused (blocks read through a chunk reference or as exact prefix no longer go into fresh memory), "
     "the same session; plain vLLM's rows from its run of the same stream",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --servers blend --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_reused_buffers.json", "rag_traffic_zipf48_c2_plain_s8.json"),
    ("rag_traffic_zipf48_c4_s8.json", "The Zipf stream, 48 requests at concurrency 4, with this session's defaults "
     "(no prefill threshold under BlendFirstScheduler), high-hit requests sent again alone (--alone 8); plain vLLM's "
     "run of the same stream at concurrency 4 right after it",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_s8.json; then --servers plain --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_plain_s8.json", "rag_traffic_zipf48_c4_plain_s8.json"),
    ("rag_traffic_zipf48_c2_no_threshold.json", "The Zipf stream, 48 requests at concurrency 2, Blend without the "
     "connector's long_prefill_token_threshold (BlendFirstScheduler admits blend requests itself; the default since "
     "this run), the same session as the next section's runs; plain vLLM's rows from there",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --servers blend --alone 0 --logprobs 20 "
     "--serve-args '--long-prefill-token-threshold 2048' "
     "--out benchmarks/results/rag_traffic_zipf48_c2_no_threshold.json", "rag_traffic_zipf48_c2_plain_s8.json"),
    ("rag_traffic_zipf48_c2_s8.json", "The Zipf stream, 48 requests at concurrency 2, a later session (2026-11-27, "
     "AVX-512 host): loaded keys rotated backwards by vLLM's fused kernel, dump gathers as page-to-block copies; "
     "plain vLLM's run of the same stream right after it",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_s8.json; then --servers plain --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_plain_s8.json", "rag_traffic_zipf48_c2_plain_s8.json"),
    ("rag_traffic_fresh_s8.json", "RAG stream with no reuse, the same session: no passage sent twice",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --fresh --logprobs 20 "
     "--out benchmarks/results/rag_traffic_fresh_s8.json", None),
    ("rag_traffic_zipf20_c2_signed_rope.json", "The 20-request stream's Blend run again with loaded keys rotated "
     "backwards by vLLM's fused kernel (signed_cos_sin_cache), right after the replay below; plain vLLM's rows from "
     "the same session's run",
     "python benchmarks/rag_traffic.py --num-requests 20 --concurrency 2 --servers blend --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf20_c2_signed_rope.json", "rag_traffic_zipf20_c2_kl.json"),
    ("rag_traffic_zipf20_c2_kl.json", "A 20-request Zipf stream (the same questions as the first 20 of the 48-request "
     "stream, other noise passages and order), plain vLLM and Blend (chunk_store \"any\") at concurrency 2, first "
     "answer tokens' top-20 log-probabilities recorded; the worker counts load_wait_seconds",
     "python benchmarks/rag_traffic.py --num-requests 20 --concurrency 2 --servers plain,blend --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf20_c2_kl.json", None),
    ("rag_traffic_zipf20_alone_background_kl.json", "The same 20 requests under chunk_store \"alone\" with missed "
     "chunks computed alone while the server is idle, Poisson arrivals at 0.015 requests/s, Blend only (plain "
     "vLLM's rows: the section above's, for the next-token KL; throughput not comparable)",
     "python benchmarks/rag_traffic.py --num-requests 20 --rates 0.015 --servers blend --alone 0 --logprobs 20 "
     "--blend-config '{\"chunk_store\": \"alone\"}' --out benchmarks/results/rag_traffic_zipf20_alone_background_kl.json",
     "rag_traffic_zipf20_c2_kl.json"),
    ("rag_traffic_zipf20_any_c2_kl.json", "The same 20 requests under \"any\" once more, Blend only, while py-spy "
     "sampled the server (docs/research.md)",
     "python benchmarks/rag_traffic.py --num-requests 20 --concurrency 2 --servers blend --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf20_any_c2_kl.json", "rag_traffic_zipf20_c2_kl.json"),
    ("rag_traffic_zipf48_c2_fair_alone.json", "The Zipf stream, 48 requests at concurrency 2, Blend with its high-hit "
     "requests sent again alone after the run, as they were and with the chunks they missed in the stream kept "
     "missing (--alone 8), first answer tokens' top-20 log-probabilities recorded (--logprobs 20); a host with "
     "AVX-512; plain vLLM's run of the same stream right after it",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_fair_alone.json; then --servers plain --alone 0 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c2_plain_s7.json", "rag_traffic_zipf48_c2_plain_s7.json"),
    ("rag_traffic_zipf48_c4_fair_alone.json", "The same at concurrency 4, right after (plain vLLM's rows: its run at "
     "concurrency 2, for the next-token KL; plain vLLM was not run at 4 in this session)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --logprobs 20 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_fair_alone.json", "rag_traffic_zipf48_c2_plain_s7.json"),
    ("rag_traffic_fresh_s7.json", "RAG stream with no reuse, same session: no passage sent twice",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --fresh --logprobs 20 "
     "--out benchmarks/results/rag_traffic_fresh_s7.json", None),
    ("rag_traffic_zipf20_alone_background.json", "chunk_store \"alone\" with missed chunks computed alone while the "
     "server is idle (background_chunks): the first 20 requests of the Zipf stream at Poisson arrivals, 0.015 "
     "requests/s, Blend only (answers scored afterwards: token F1 in the records)",
     "python benchmarks/rag_traffic.py --num-requests 20 --rates 0.015 --servers blend --alone 0 --blend-config "
     "'{\"chunk_store\": \"alone\"}' --out benchmarks/results/rag_traffic_zipf20_alone_background.json", None),
    ("rag_traffic_zipf20_any_c2.json", "The same 20 requests under chunk_store \"any\" (the default) at concurrency "
     "2, same session: its hit rate and answers to set the section above against",
     "python benchmarks/rag_traffic.py --num-requests 20 --concurrency 2 --servers blend --alone 0 "
     "--out benchmarks/results/rag_traffic_zipf20_any_c2.json", None),
    ("rag_traffic_zipf48_c4_step1024.json", "BlendFirstScheduler with half vLLM's step budget "
     "(--max-num-batched-tokens 1024, Blend's cap kept at 8192 rows); the session after the next section's: "
     "compare with care",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --serve-args "
     "'--max-num-batched-tokens 1024' --blend-config '{\"max_step_tokens\": 8192}' "
     "--out benchmarks/results/rag_traffic_zipf48_c4_step1024.json", "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_blend_first_default.json", "BlendFirstScheduler as the default (the first waiting "
     "request that would blend goes to the head of the queue; other prefills keep one token in its step); same "
     "session as the next section; plain vLLM's rows from an earlier session on the same kind of host: compare "
     "the ratios with care",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_blend_first_default.json", "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_blend_first_v1.json", "The first BlendFirstScheduler (opt-in, commit a24163d: only the "
     "head of the queue, running prefills keep one block), rerun in the session of the section above",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --serve-args "
     "'--scheduler-cls ucm.integration.vllm.connector.blend_first_scheduler.BlendFirstScheduler' "
     "--out benchmarks/results/rag_traffic_zipf48_c4_blend_first_v1.json (at commit a24163d)",
     "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_blend_first.json", "The same with BlendFirstScheduler (--scheduler-cls: a step that admits "
     "a blend request holds running prefills to one block; same session as the next two sections)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 --serve-args "
     "'--scheduler-cls ucm.integration.vllm.connector.blend_first_scheduler.BlendFirstScheduler' "
     "--out benchmarks/results/rag_traffic_zipf48_c4_blend_first.json", "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_threshold512.json", "The same, with long prefills held to 512 tokens a step "
     "(--long-prefill-token-threshold 512 instead of the connector's 1792; same session as the next section)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 "
     "--serve-args '--long-prefill-token-threshold 512' --out benchmarks/results/rag_traffic_zipf48_c4_threshold512.json",
     "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_alone.json", "The same stream, Blend rerun a session later with high-hit requests sent "
     "again alone after it (--alone 8; plain vLLM's rows from the previous session's run on the same kind of host: "
     "compare with care)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend --alone 8 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_alone.json", "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_avx2.json", "RAG stream: Zipf(1.1) over 50 MuSiQue questions, 2 noise passages, no "
     "indexing, 48 requests at concurrency 4, with the native attention kernel's AVX2 variant (Blend only; plain "
     "vLLM's rows from the next section's run, same host and session)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --servers blend "
     "--out benchmarks/results/rag_traffic_zipf48_c4_avx2.json", "rag_traffic_zipf48_c4_probe_kv.json"),
    ("rag_traffic_zipf48_c4_probe_kv.json", "The same stream after the probe's rows kept their KV, before the AVX2 "
     "kernel (Blend's scattered rows on the torch path; a CPU without AVX-512, about 2.7x slower than the one of the "
     "next sections: compare ratios, not seconds)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 "
     "--out benchmarks/results/rag_traffic_zipf48_c4_probe_kv.json", None),
    ("rag_traffic_zipf48_c2.json", "Before the probe's rows kept their KV: the same stream, "
     "48 requests at concurrency 2 (default settings: chunk references, step cap 4 x the budget, long prefills leave "
     "an eighth of each step; plain vLLM's rows from a second run of the same stream, since the machine also ran "
     "unit tests during this file's own plain run)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 2 --out benchmarks/results/rag_traffic_zipf48_c2.json",
     "rag_traffic_zipf48_c2_plain_rerun.json"),
    ("rag_traffic_zipf48_c4.json", "Before the probe's rows kept their KV: the same stream at concurrency 4 (default "
     "settings)",
     "python benchmarks/rag_traffic.py --num-requests 48 --concurrency 4 --out benchmarks/results/rag_traffic_zipf48_c4.json",
     None),
    ("rag_traffic_fresh.json", "RAG stream with no reuse: no passage sent twice (default settings)",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --fresh "
     "--out benchmarks/results/rag_traffic_fresh.json", None),
    ("rag_traffic_zipf24_two_instances.json", "Two instances, one store: the Zipf stream, 24 requests, round robin "
     "over two `ucm-vllm serve` instances per server, each on one core (Blend's on one store directory, plain vLLM's "
     "each with its own prefix cache); one instance on both cores ran the same stream in the next section",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --instances 2 "
     "--out benchmarks/results/rag_traffic_zipf24_two_instances.json", None),
    ("rag_traffic_zipf24_threshold.json", "Long prefills leave an eighth of each step (long_prefill_token_threshold "
     "1792 of 2048): the Zipf stream, 24 requests, Blend only; plain vLLM's rows and the run without the threshold "
     "in the next section (same session)",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --servers blend "
     "--out benchmarks/results/rag_traffic_zipf24_threshold.json (run with --serve-args "
     "'--long-prefill-token-threshold 1792', which the connector now sets itself)",
     "rag_traffic_zipf24_no_threshold.json"),
    ("rag_traffic_zipf24_no_threshold.json", "The same stream without the threshold (a long prefill takes the whole "
     "step budget)",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --serve-args "
     "'--long-prefill-token-threshold 2048' --out benchmarks/results/rag_traffic_zipf24_no_threshold.json (run "
     "before the connector set the threshold; 2048, the budget, turns it off)", None),
    ("rag_traffic_zipf.json", "Earlier session, before long prefills left room in each step: the Zipf stream, "
     "24 requests",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --out benchmarks/results/rag_traffic_zipf.json",
     None),
    ("rag_traffic_fresh_before_threshold.json", "Earlier session, before long prefills left room in each step: "
     "no reuse",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --fresh "
     "--out benchmarks/results/rag_traffic_fresh_before_threshold.json", None),
    ("rag_traffic_fresh_copies.json", "Earlier session: the same stream with chunk KV stored as copies (chunk_refs "
     "false: every computed block written twice), same host and session as the row above",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --fresh --servers blend --blend-config "
     "'{\"chunk_refs\": false}' --out benchmarks/results/rag_traffic_fresh_copies.json",
     "rag_traffic_fresh_before_threshold.json"),
    ("rag_traffic_zipf_cap4x.json", "Earlier session, before chunk references: the Zipf stream, step cap 4 x the budget",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --servers blend --blend-config "
     "'{\"max_step_tokens\": 8192}' --out benchmarks/results/rag_traffic_zipf_cap4x.json", "rag_traffic_zipf_cap1x.json"),
    ("rag_traffic_zipf_cap1x.json", "Earlier session, before chunk references: the same stream, step cap 1 x the "
     "budget (regions cut to 2048 rows)",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --blend-config '{\"max_step_tokens\": 2048}' "
     "--out benchmarks/results/rag_traffic_zipf_cap1x.json", None),
    ("rag_traffic_zipf_unequal_cores.json", "Earlier session: the Zipf stream with vLLM's own core reservation (plain "
     "vLLM computes on 1 core, the connector's server on 2: not a fair comparison)",
     "python benchmarks/rag_traffic.py --num-requests 24 --concurrency 2 --blend-config "
     "'{\"max_step_tokens\": 2048}' --out benchmarks/results/rag_traffic_zipf_unequal_cores.json, before the "
     "benchmark set VLLM_CPU_NUM_OF_RESERVED_CPU=0", None),
]
# The README's stream rows: (result file, what it measured)
HEADLINE_TRAFFIC = [("rag_traffic_zipf48_c4_warm2c_s31_bf16.json", "a RAG stream of new and repeated passages (Zipf, no indexing"),
                    ("rag_traffic_fresh36_warm2_s31_bf16.json", "a RAG stream of new passages only (no reuse, KV stored "
                     "on second sighting")]
# The README's rows for the larger models (offline, Blend 0.15 with the defaults against full prefill)
HEADLINE_LARGER = ["qwen15_query_shares_gen20_59.json", "qwen05_long_shares_bf16_gen8.json"]
# The latest page: (the benchmark, its latest run); every other run goes to the history page.
LATEST = [
    ("RAG stream with reuse (Zipf), concurrency 4, bfloat16, on an AMD host with AVX-512-BF16",
     "rag_traffic_zipf48_c4_warm2c_s31_bf16.json"),
    ("Admission rules replayed over many streams", "admission_sim.json"),
    ("RAG stream with reuse (Zipf), concurrency 4, float32, on an AVX-512 host without bfloat16",
     "rag_traffic_zipf48_c4_s25_f32.json"),
    ("RAG stream with 5 ms added to every file operation of the store's mount, on an AMD host with AVX-512-BF16",
     "rag_traffic_zipf48_latency5_rw_s26_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 4, bfloat16, on an AMX host", "rag_traffic_zipf48_c4_s24_bf16.json"),
    ("RAG stream without reuse, float32, on an AMX host", "rag_traffic_fresh36_s24_f32.json"),
    ("RAG stream with 5 ms added to every file operation of the store's mount, lookups batched, on an AMX host",
     "rag_traffic_zipf48_latency5_batched_s24_bf16.json"),
    ("Where a Blend server's time goes on the Zipf stream on an AMX host (profile)", "profile_zipf48_c4_amx_bf16.json"),
    ("Quality guard: SmolLM2, the fixed set (make quality)", "quality_check.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, every rule", "qwen15_rules_gen20.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, held-out questions", "qwen15_query_shares_gen20_59.json"),
    ("The ranking's ceiling on the held-out questions: the oracle at 0.15 (1.5B)", "qwen15_oracle_gen20_59.json"),
    ("The layers that retrieve: the rule before and squared shares on fresh questions (1.5B)",
     "qwen15_probe_shares_gen80_119.json"),
    ("The layers that retrieve: variants on a development set (1.5B)", "qwen15_probe_shares_gen60_79.json"),
    ("The layers that retrieve: variants on SmolLM2's fixed set", "smollm2_probe_shares_quality16.json"),
    ("Where the question reads: the rule before and two variants on the held-out questions (1.5B)",
     "qwen15_probe_depth_gen20_59.json"),
    ("Quality on Qwen2.5-Coder-0.5B-Instruct, generated questions", "qwen05_query_vn_gen8.json"),
    ("Where the question reads: the query rule's variants on a development set (1.5B)",
     "qwen15_probe_variants_gen60_79.json"),
    ("Where the question reads: more variants and the oracle on the development set (1.5B)",
     "qwen15_probe_variants2_gen60_79.json"),
    ("Where the question reads: the variants on SmolLM2's fixed set", "smollm2_probe_variants_quality16.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, held-out questions, every rule before", "qwen15_rules_gen20_59.json"),
    ("The check layer on Qwen2.5-Coder-1.5B-Instruct", "qwen15_layer1_gen20.json"),
    ("What a ranking could reach at 0.15 on Qwen2.5-Coder-1.5B-Instruct (oracle)", "qwen15_oracle_q15_18.json"),
    ("Quality on Qwen2.5-Coder-0.5B-Instruct, MuSiQue", "qwen05_musique12.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 36-55, and every question so far pooled",
     "qwen15_musique36_55.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 16-35, the committed rule and HKVD",
     "qwen15_musique16_35.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-15 at ratio 0.3", "qwen15_musique16_ratio03.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-15, the committed rule and the oracle",
     "qwen15_musique16_shares.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-15, the rule before", "qwen15_musique16_vn.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 0-7, every rule", "qwen15_musique8_rules.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue questions 8-15, every rule", "qwen15_musique8_15_rules.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue", "qwen15_musique5_attention_alone.json"),
    ("Quality on Qwen2.5-Coder-1.5B-Instruct, MuSiQue, before attention alone", "qwen15_musique5.json"),
    ("The query rule by attention alone on Qwen2.5-Coder-1.5B-Instruct", "qwen15_attention_alone_gen14.json"),
    ("The query rule by attention alone on Qwen2.5-Coder-0.5B-Instruct", "qwen05_attention_alone_gen8.json"),
    ("kv_shift on Qwen2.5-Coder-1.5B-Instruct", "qwen15_kv_shift_gen12.json"),
    ("Quality on Qwen2.5-Coder-0.5B-Instruct at two ratios", "qwen05_ratios_generated8.json"),
    ("Gradual filtering (several check layers) on Qwen2.5-Coder-1.5B-Instruct", "qwen15_gradual_gen20.json"),
    ("Gradual filtering (several check layers) on MuSiQue, SmolLM2", "smollm2_musique20_gradual.json"),
    ("One check layer on MuSiQue, SmolLM2 (gradual filtering's reference)", "smollm2_musique20_one_layer.json"),
    ("Gradual filtering (several check layers) on Qwen2.5-Coder-0.5B-Instruct", "qwen05_gradual_generated8.json"),
    ("Quality and speed on Qwen2.5-Coder-0.5B-Instruct, long prompts, on an AMX host with the AMX attention",
     "qwen05_long_amx_bf16_gen8.json"),
    ("The same on the AMX host with the code before (bfloat16 dot products on AMX pages)",
     "qwen05_long_dot_amxhost_bf16_gen8.json"),
    ("Blend on an AMX host: SmolLM2, 6 MuSiQue questions, as committed", "kernel_amx_addpages_musique6_bf16.json"),
    ("Blend on an AMX host: SmolLM2, 6 MuSiQue questions, the code before", "kernel_dot_amxhost_musique6_bf16.json"),
    ("Quality and speed on Qwen2.5-Coder-0.5B-Instruct, long prompts", "qwen05_long_shares_bf16_gen8.json"),
    ("Offline on all of MuSiQue (SmolLM2)", HEADLINE_RUN),
    ("Serving replay on an AMX host: passages indexed, then asked in another order, compiled, the AMX attention "
     "and the native dump gather", "serve_bench_c4_amx_gather_bf16.json"),
    ("Serving replay on an AMX host: the AMX attention, dumps gathered by torch", "serve_bench_c4_amx_bf16.json"),
    ("Serving replay: passages indexed, then asked in another order, compiled, the attention of 2026-11-29",
     "serve_bench_c4_native_bf16.json"),
    ("Serving replay: passages indexed, then asked in another order, compiled", "serve_bench_c4_compiled_bf16.json"),
    ("Serving replay: passages indexed, then asked in another order, eager", "serve_bench_c4_bf16_vn.json"),
    ("RAG stream with reuse (Zipf), concurrency 4, admission as committed", "rag_traffic_zipf48_c4_ev4seen_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 4, admission's evidence after 3 requests", "rag_traffic_zipf48_c4_ev3seen_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2, admission's evidence after 3 requests", "rag_traffic_zipf48_c2_ev3seen_bf16.json"),
    ("RAG stream without reuse, admission's evidence after 3 requests", "rag_traffic_fresh36_ev3seen_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2, admission's evidence after 2 requests, sighted blocks counted",
     "rag_traffic_zipf48_c2_ev2seen_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2, admission's evidence after 2 requests", "rag_traffic_zipf48_c2_ev2_bf16.json"),
    ("RAG stream without reuse, admission's evidence after 2 requests", "rag_traffic_fresh36_ev2_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2, bfloat16, compiled, on a host twice as slow",
     "rag_traffic_zipf48_c2_s22_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2, bfloat16, compiled", "rag_traffic_zipf48_c2_compiled_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 4, bfloat16, compiled, the attention of 2026-11-29",
     "rag_traffic_zipf48_c4_native_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 4, bfloat16, compiled", "rag_traffic_zipf48_c4_compiled_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2, bfloat16, eager", "rag_traffic_zipf48_c2_bf16.json"),
    ("RAG stream with reuse (Zipf), concurrency 2", "rag_traffic_zipf48_c2_short_regions.json"),
    ("RAG stream with reuse (Zipf), concurrency 4", "rag_traffic_zipf48_c4_short_regions.json"),
    ("RAG stream with reuse (Zipf) on Qwen2.5-Coder-0.5B-Instruct", "qwen05_zipf48_c2_held.json"),
    ("RAG stream without reuse, bfloat16, on an AMD host with AVX-512-BF16", "rag_traffic_fresh36_warm2_s31_bf16.json"),
    ("RAG stream without reuse", "rag_traffic_fresh36_compiled_bf16.json"),
    ("RAG stream with the store's mount hung for 5 minutes", "rag_traffic_zipf110_hang300_s16_bf16.json"),
    ("RAG stream with the store's mount hung for 5 minutes, plain vLLM and the store before",
     "rag_traffic_zipf110_hang300_bf16.json"),
    ("RAG stream with 5 ms added to every file operation of the store's mount",
     "rag_traffic_zipf48_latency5_kindfirst_bf16.json"),
    ("The same stream on the plain directory", "rag_traffic_zipf48_dir_kinds_bf16.json"),
    ("The +5 ms stream with a 2 GiB DRAM tier", "rag_traffic_zipf48_latency5_dram2_kinds_bf16.json"),
    ("The same stream on the plain directory, the store before", "rag_traffic_zipf48_dir_bf16.json"),
    ("RAG stream without reuse, float32 on an AVX2 host", "rag_traffic_fresh36_admission.json"),
    ("Where the engine's time goes without reuse (profile)", "profile_fresh_blend.json"),
    ("Where a Blend step's time goes on an AMX host (profile)", "profile_blend_step_amx_bf16.json"),
    ("Where a Blend step's time goes with the attention of 2026-11-29 (profile)", "profile_blend_step_native_bf16.json"),
    ("Where a Blend step's time goes (profile)", "profile_blend_step_bf16.json"),
    ("Where Blend pays: one request, k of 10 passages cached", "hit_threshold.json"),
    ("Where Blend pays: one request, k of 10 passages cached (Qwen2.5-Coder-0.5B-Instruct)", "qwen05_hit_threshold.json"),
    ("A storm of faults through ucm-vllm serve", "fault_storm.json"),
    ("Store under faults", "store_faults.json"),
]
PROFILE_RUNS = [
    ("profile_zipf48_c4_amx_bf16.json", "Where a Blend server's engine core and worker spend their time on the Zipf "
     "stream at concurrency 4 on the Intel host with AMX where Blend ran at 0.88x plain vLLM (2026-12-06, a "
     "twenty-fourth session; py-spy at 25 Hz)",
     "python benchmarks/profile_stream.py --out benchmarks/results/profile_zipf48_c4_amx_bf16.json -- --dtype "
     "bfloat16 --num-requests 48 --concurrency 4 --logprobs 20 --alone 0 --servers blend --no-plot"),
    ("profile_blend_step_amx_bf16.json", "Where a Blend step's time goes on an Intel Xeon host with AMX, with the AMX "
     "variant of Blend's attention (vLLM's bfloat16 pages in AMX tiles) and the KV shift slot by slot, before its "
     "whole-page add (2026-12-01, a twentieth session; py-spy at 50 Hz)",
     "python benchmarks/profile_stream.py --rate 50 --script blend_bench.py --out "
     "benchmarks/results/profile_blend_step_amx_bf16.json -- --dtype bfloat16 --num-questions 4 --sweep --ratios "
     "0.15 --selections query --max-tokens 1 --enforce-eager"),
    ("profile_blend_step_native_bf16.json", "Where a Blend step's time goes with Blend's attention of 2026-11-29 (bfloat16 "
     "dot products; every run of rows native, so \"native kernel (scattered rows)\" holds the runs too): the same "
     "command and host as the profile below (a nineteenth session; py-spy at 50 Hz)",
     "python benchmarks/profile_stream.py --rate 50 --script blend_bench.py --out "
     "benchmarks/results/profile_blend_step_native_bf16.json -- --dtype bfloat16 --num-questions 4 --sweep --ratios "
     "0.15 --selections query --max-tokens 1 --enforce-eager"),
    ("profile_fresh_blend.json", "Where a Blend server's engine core and worker spend their time on a stream without reuse",
     "python benchmarks/profile_stream.py --out benchmarks/results/profile_fresh_blend.json -- --fresh --servers blend "
     "--num-requests 10 --warmup 1 --concurrency 2"),
    ("profile_blend_step_bf16.json", "Where a Blend step's time goes: SmolLM2, 4 fully cached MuSiQue questions "
     "(~6.1k tokens), ratio 0.15, bfloat16, eager, on an AMD EPYC host with AVX-512-BF16 (2026-11-29, an eighteenth "
     "session; py-spy at 50 Hz made the run about 1.5x slower)",
     "python benchmarks/profile_stream.py --rate 50 --script blend_bench.py --out "
     "benchmarks/results/profile_blend_step_bf16.json -- --dtype bfloat16 --num-questions 4 --sweep --ratios 0.15 "
     "--selections query --max-tokens 1 --enforce-eager"),
]
ATTENTION_RUNS = [
    ("Blend's attention of scattered rows on AMX pages: each variant of the native kernel (an Intel Xeon host with "
     "AMX, 2026-12-01, a twentieth session)",
     "python benchmarks/attention_bench.py --dtype bfloat16 --layout amx --repeat 7 --kv-heads {kv} --group {g} "
     "--head-size {d} --out benchmarks/results/attention_bench_{model}_amx.json",
     [("SmolLM2-135M", "attention_bench_smollm2_amx.json"),
      ("Qwen2.5-Coder-0.5B", "attention_bench_qwen05_amx.json"),
      ("Qwen2.5-Coder-1.5B", "attention_bench_qwen15_amx.json")]),
    ("Blend's attention of scattered rows: each variant of the native kernel, bfloat16 pages (an AMD EPYC "
     "host with AVX-512-BF16, 2026-11-29, a nineteenth session)",
     "python benchmarks/attention_bench.py --dtype bfloat16 --repeat 7 --kv-heads {kv} --group {g} "
     "--head-size {d} --out benchmarks/results/attention_bench_{model}_bf16.json",
     [("SmolLM2-135M", "attention_bench_smollm2_bf16.json"),
      ("Qwen2.5-Coder-0.5B", "attention_bench_qwen05_bf16.json"),
      ("Qwen2.5-Coder-1.5B", "attention_bench_qwen15_bf16.json")]),
]
STORM_RUN = ("fault_storm.json", "python benchmarks/fault_storm.py --generated --num-questions 16 --faults 100 "
             "--max-rounds 8 --shares lookup~0.1,load~0.2,rotate~0.2,select~0.2,forward~0.2,attention~0.006,dump~0.1 "
             "--out benchmarks/results/fault_storm.json")
FAULTS_RUN = ("store_faults.json", "python benchmarks/store_faults.py --out benchmarks/results/store_faults.json")
HIT_THRESHOLD_RUNS = [
    ("hit_threshold.json", "python benchmarks/hit_threshold.py --num-questions 2 --hits 0,1,2,3,5,7,10 "
     "--out benchmarks/results/hit_threshold.json" " (run with VLLM_CPU_NUM_OF_RESERVED_CPU=0 and before the script "
     "paused 2 s after indexing: its Blend times include waiting for the indexing dumps, most at k = 7)"),
    ("qwen05_hit_threshold.json", "python benchmarks/hit_threshold.py --model qwen2.5-coder-0.5b --dtype bfloat16 "
     "--num-questions 2 --hits 0,2,3,5,7,10 --ratio 0.15 --out benchmarks/results/qwen05_hit_threshold.json "
     "(Qwen2.5-Coder-0.5B-Instruct; the Blend times at k = 7 include waiting for the indexing dumps)"),
]

ADMISSION_SIM_RUN = ("admission_sim.json", "python benchmarks/admission_sim.py --seeds 100 "
                     "--out benchmarks/results/admission_sim.json")


def admission_sim_table(data: dict) -> list[str]:
    """The adaptive admission rule's variants replayed over many Zipf streams and the fresh one."""
    lines = ["| evidence lookups | which count | hit-share threshold | concurrency | KV found after | Zipf: chunk blocks "
             "hit, mean (min..max) | Zipf seed 0 | Zipf: blocks written (mean) | fresh: KV written / computed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rules"]:
        lines.append(f"| {r['evidence']} | {r['lookups']} | {r['threshold']} | {r['concurrency']} | {r['lag']} requests "
                     f"| {r['zipf_hit_mean']:.1%} ({r['zipf_hit_min']:.1%}..{r['zipf_hit_max']:.1%}) "
                     f"| {r['zipf_hit_seed0']:.1%} | {r['zipf_written_mean']:.0f} | {r['fresh_written_share']:.1%} |")
    return [f"{data['seeds']} Zipf streams of {data['num_requests']} requests (rag_traffic.py's, seeds 0..{data['seeds'] - 1}) "
            "and the fresh stream of 36 requests after one warm-up, replayed through the connector's rule without a "
            "server. \"which count\": any lookup (the rule before), or warm ones (made after a request of the engine "
            "finished) and cold ones that found at least the threshold's share. \"KV found after\": request j finds request i's KV when "
            "i <= j - that (a served run lies between c and c - 1).", "", *lines]


def _ci(row: dict, key: str, fmt: str) -> str:
    ci = row.get(f"{key}_ci")
    return f" ({fmt.format(ci[0])} .. {fmt.format(ci[1])})" if ci else ""


def eval_table(data: dict) -> str:
    """One row per mode of a ucm.eval run (main job or blend_bench); the next-token KL column
    when the run measured it."""
    with_kl = any(row.get("kl_vs_full") is not None for row in data["summary"])
    lines = ["| mode | median TTFT | speed-up | F1 vs full-prefill answer | same answer | F1 vs gold minus full's |"
             + (" next-token KL |" if with_kl else ""), "|---|---|---|---|---|---|" + ("---|" if with_kl else "")]
    for row in data["summary"]:
        f1 = row.get("f1_vs_full")
        agree = row.get("agree_pct")
        delta = row.get("f1_gold_delta")
        kl = row.get("kl_vs_full")
        lines.append(
            f"| {row['mode']} | {row['median_ttft_s']:.2f} s | {row.get('speedup') or 1.0:.2f}x | "
            + (f"{f1:.3f}{_ci(row, 'f1_vs_full', '{:.3f}')}" if f1 is not None else "-") + " | "
            + (f"{agree:.0f}%{_ci(row, 'agree_pct', '{:.0f}')}" if agree is not None else "-") + " | "
            + (f"{delta:+.3f}{_ci(row, 'f1_gold_delta', '{:+.3f}')}" if delta is not None else "-") + " |"
            + ((f" {kl:.4f}{_ci(row, 'kl_vs_full', '{:.4f}')} |" if kl is not None else " - |") if with_kl else ""))
    return "\n".join(lines)


def eval_context(data: dict) -> str:
    c, t = data["config"], data.get("prompt_tokens", {})
    dataset = Path(str(c.get("dataset"))).name if c.get("dataset") not in (None, "generated") else "generated"
    skip = c.get("skip_questions") or 0
    if skip:
        dataset += f", questions {skip}-{skip + c.get('num_questions', 0) - 1}"
    model = Path(str(c.get("model"))).name if c.get("model") else "SmolLM2-135M-Instruct"
    code = f", code {c['commit']}" if c.get("commit") else ""
    extra = "".join(f", {label} {c[key]}" for key, label in (("miss_passages", "passages left unindexed"),
                                                              ("min_question_tokens", "questions over tokens"))
                    if c.get(key))
    if c.get("later_checks"):
        extra += ", later check layers " + ", ".join(f"{layer} (ratio {ratio:g})" for layer, ratio in c["later_checks"])
        extra += ": a Blend mode's ratio selects at the check layer and narrows to min(its ratio, the layer's) there"
    return (f"{model}, {c.get('num_questions')} questions ({dataset}{extra}), prompts of {t.get('min')}-{t.get('max')} tokens, "
            f"dtype {c.get('dtype') if c.get('dtype') not in (None, 'default') else 'float32'}, {c.get('cpu_count')} CPUs, started {c.get('started')}, "
            f"{c.get('duration_s', 0) / 60:.0f} min{code}, Blend modes {_kv_shift(c)} unless named")


def _kv_shift(config: dict) -> str:
    """The engine's kv_shift of a run: runs from before the option (no key) had none."""
    share = config.get("kv_shift", 0)
    return f"with kv_shift {share:g}" if share else "without kv_shift"


def serve_table(data: dict) -> str:
    by = {(r["mode"], r["concurrency"]): r for r in data["phases"]}
    lines = ["| concurrency | blended | TTFT p50 Blend / off | speed-up | requests/s Blend / off | throughput gain | "
             "same answers as concurrency 1 |", "|---|---|---|---|---|---|---|"]
    with_plain = any(r["mode"] == "plain" for r in data["phases"])
    if with_plain:
        lines[0] += " TTFT p50 / requests/s plain vLLM | gain over plain |"
        lines[1] += "---|---|"
    for c in sorted({r["concurrency"] for r in data["phases"]}):
        on, off, plain = by.get(("blend", c)), by.get(("full", c)), by.get(("plain", c))
        if on is None or off is None:
            continue
        line = (f"| {c} | {on['blended']}/{on['requests']} | {on['ttft_p50_s']:.2f} s / {off['ttft_p50_s']:.2f} s "
                f"| {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x | {on['requests_per_s']:.3f} / "
                f"{off['requests_per_s']:.3f} | {on['requests_per_s'] / off['requests_per_s']:.2f}x | "
                f"{on.get('same_answers_as_concurrency_1', '-')}/{on['requests']} |")
        if with_plain:
            line += (f" {plain['ttft_p50_s']:.2f} s / {plain['requests_per_s']:.3f} | "
                     f"{on['requests_per_s'] / plain['requests_per_s']:.2f}x |" if plain else " - | - |")
        lines.append(line)
    return "\n".join(lines)


def rerun_answers(data: dict, first: dict | None) -> str:
    """How many answers of a serve_bench rerun equal the first run's (per mode, at concurrency 1 there)."""
    if first is None:
        return ""
    ref = {r["mode"]: r["answers"] for r in first["phases"] if r["concurrency"] == 1}
    parts = [f"{r['mode']} at concurrency {r['concurrency']}: {sum(a == b for a, b in zip(r['answers'], ref[r['mode']]))}"
             f" of {len(r['answers'])} answers equal `{SERVE_RUN[0]}`'s at concurrency 1"
             for r in data["phases"] if r["mode"] in ref]
    full = ref.get("full")
    blend = [r for r in data["phases"] if r["mode"] == "blend"]
    if full and blend:
        parts.append(f"Blend's equal full prefill's there: {sum(a == b for a, b in zip(blend[0]['answers'], full))} of "
                     f"{len(full)} (the same-answers column above compares with this run's own lowest concurrency)")
    return "; ".join(parts) + "."


def hit_threshold_table(data: dict) -> list[str]:
    """Blend against full prefill, one request alone, per number of passages cached (medians over questions)."""
    import statistics

    lines = ["| passages cached | hit share | Blend TTFT | full prefill TTFT | speed-up |", "|---|---|---|---|---|"]
    for k in sorted({r["passages_cached"] for r in data["rows"]}):
        rows = [r for r in data["rows"] if r["passages_cached"] == k]
        b, f = statistics.median(r["blend_s"] for r in rows), statistics.median(r["full_s"] for r in rows)
        lines.append(f"| {k} | {statistics.median(r['hit_share'] for r in rows):.2f} | {b:.2f} s | {f:.2f} s | {f / b:.2f}x |")
    n = len({r["question"] for r in data["rows"]})
    return [f"{n} questions, ratio {data['config']['ratio']}, {data['config']['dtype']}, `min_hit_share` 0 (blended "
            "whatever the hits), one request at a time, wall time of a 1-token generate.", "", *lines]


def traffic_table(data: dict, baseline: dict | None = None) -> list[str]:
    """One row per server and load of a rag_traffic.py run, then Blend's speed-up per load; with
    `baseline` (the same stream), plain vLLM's rows are the baseline's."""
    data = with_baseline(data, baseline)
    lines = ["| server | load | requests/s | TTFT p50 / p90 | TTFT p50 of high-hit requests (n) | chunk blocks hit | "
             "blended | fallbacks |", "|---|---|---|---|---|---|---|---|"]
    for run in data["runs"]:
        s = run["summary"]
        high = s.get("high_hit_ttft_p50_s")
        hits = "-" if s.get("chunk_hit_rate") is None else f"{s['chunk_hit_rate']:.0%}"
        fallbacks = ", ".join(f"{k.removeprefix('blend_fallbacks_')} {v}" for k, v in s.get("fallbacks", {}).items())
        lines.append(f"| {run['server']} | {run['load']} | {s['requests_per_s']:.3f} | {s['ttft_p50_s']:.2f} / "
                     f"{s['ttft_p90_s']:.2f} s | {'-' if high is None else f'{high:.2f} s'} ({s['high_hit_requests']}) "
                     f"| {hits} | {s['blended_share']:.0%} | {fallbacks or '-'} |")
    c = data["config"]
    head = (f"{c['num_requests']} requests, {data['dataset']}, ~{data['mean_prompt_tokens']:.0f}-token prompts, "
            f"ratio {data['ratio']}, {data['dtype']}; high-hit: >= 80% of a request's chunk blocks hit on the Blend "
            "run (the same requests on plain).")
    gains = [f"Blend over plain vLLM at {load}: {x['requests_per_s']:.2f}x requests/s, {x['ttft_p50']:.2f}x TTFT p50"
             f"{paired_ttft(data, load)}{same_answers(data, load)}." for load, x in data.get("speedup", {}).items()]
    alone = [line for run in data["runs"] for line in alone_lines(run)]
    return [head, "", *lines, "", *gains, *alone, *kl_lines(data), *store_lines(data), *instances_table(data),
            *mount_lines(data)]


def paired_ttft(data: dict, load: str) -> str:
    """", {x}x TTFT request by request (CI)": plain vLLM's TTFT over Blend's per request, geometric mean."""
    runs = {r["server"]: r for r in data["runs"] if r["load"] == load}
    if "plain" not in runs or "blend" not in runs:
        return ""
    ttft = [{rec["i"]: rec["ttft_s"] for rec in runs[s]["records"]} for s in ("plain", "blend")]
    paired = paired_speedup(*ttft)
    if paired is None:
        return ""
    mean, ci = paired
    return f", {mean:.2f}x TTFT request by request" + (f" ({ci[0]:.2f}..{ci[1]:.2f})" if ci else "")


def mount_lines(data: dict) -> list[str]:
    """Per run of a stream whose Blend store sat behind a misbehaving mount (--mount): the fault's
    window, requests/s in it and the minute after, when blending resumed, resident memory."""
    spec = data["config"].get("mount")
    if not spec:
        return []
    out = ["", f"Blend's store behind a FUSE mount: `{spec}`.", ""]
    for run in data["runs"]:
        s, rss = run["summary"], [mb for _, mb in run.get("rss_mb", [])]
        line = f"- {run['server']} {run['load']}:"
        if "window_requests_per_s" in s:
            after = s.get("first_blend_after_release_s")
            line += (f" {s['window_requests_per_s']:.3f} requests/s in the fault's window, "
                     f"{s['after_window_requests_per_s']:.3f} in the minute after"
                     + ("" if after is None else f", first blend {after:.0f} s after the release") + ";")
        if rss:
            line += f" engine resident memory {min(rss)}-{max(rss)} MB."
        if run["server"] == "blend" and "lookup_s" in s:  # the scheduler's lookups, loads and dumps in steps
            line += (f" Store time: lookups {s['lookup_s']:.1f} s, loads waited {s['load_wait_s']:.1f} s, dumps "
                     f"{s['dump_s']:.1f} s in steps, of a {s['wall_s']:.0f} s run.")
        if "mount_server_cpu_s" in s:  # the test mount's own server, on the same cores
            line += f" The mount's server used {s['mount_server_cpu_s']:.0f} s of CPU."
        out.append(line)
    return out


def store_lines(data: dict) -> list[str]:
    """Per Blend run recorded with admission counters: what it wrote to the store."""
    lines = []
    for run in data["runs"]:
        s = run["summary"]
        if run["server"] != "blend" or "sightings_stored" not in s:
            continue
        lines.append(f"Store, Blend at {run['load']}: {s['dump_bytes'] / 1e9:.2f} GB of KV written "
                     f"({s['dump_bytes'] / 1e6 / s['requests']:.0f} MB per request), {s['store_bytes'] / 1e9:.2f} GB in "
                     f"{s['store_blocks']} files at the end; {s['sightings_stored']} sightings written, "
                     f"{s['blocks_not_admitted']} computed blocks not stored (first sightings).")
    return lines


def _rag_traffic():
    """rag_traffic.py, the one source of its summaries' rules (KL, which requests are high-hit)."""
    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    import rag_traffic

    return rag_traffic


def kl_lines(data: dict) -> list[str]:
    """Per Blend run, its first answer tokens' KL to plain vLLM's on the same stream (runs with
    --logprobs; the plain run of any load: the prompts do not depend on it)."""
    kl_summary = _rag_traffic().kl_summary
    plain = next((r for r in data["runs"] if r["server"] == "plain"
                  and any(x.get("first_logprobs") for x in r["records"])), None)
    lines = []
    for run in data["runs"]:
        if run["server"] != "blend" or plain is None or not (k := kl_summary(run["records"], plain["records"])):
            continue
        blended = k["first_token_kl_blended_mean"]
        lines.append(f"Next-token KL to plain vLLM (the first answer token, from both servers' top-20 lists: a lower "
                     f"bound), Blend at {run['load']} against plain at {plain['load']}: mean {k['first_token_kl_mean']:.4f}"
                     f" over {k['kl_requests']} requests, p90 {k['first_token_kl_p90']:.4f}; blended requests' mean "
                     f"{'-' if blended is None else f'{blended:.4f}'} ({k['kl_blended_requests']}).")
    return lines


def alone_lines(run: dict) -> list[str]:
    """A Blend run's high-hit requests sent again alone (rag_traffic --alone): as they were, then
    with their stream misses kept missing (runs since 2026-11-26 evening)."""
    s = run["summary"]
    if not s.get("alone_requests"):
        return []
    lines = [f"High-hit requests sent again alone after the {run['server']} run at {run['load']}: "
             f"{s['alone_requests']}, TTFT p50 {s['alone_ttft_p50_s']:.2f} s alone and {s['alone_stream_ttft_p50_s']:.2f} s "
             f"in the stream; stream / alone, median over them: {s['high_hit_vs_alone']:.2f}x (chunk blocks hit: "
             f"{s['alone_chunk_hit_rate']:.0%} alone, {s['alone_stream_chunk_hit_rate']:.0%} in the stream: alone they also "
             "find what they stored themselves)."]
    if s.get("alone_same_misses_requests"):
        lines.append(f"The same requests alone with the chunks they missed in the stream made new (the same work): "
                     f"TTFT p50 {s['alone_same_misses_ttft_p50_s']:.2f} s alone; stream / alone, median over them: "
                     f"**{s['high_hit_vs_alone_same_misses']:.2f}x** (chunk blocks hit: "
                     f"{s['alone_same_misses_chunk_hit_rate']:.0%} alone, "
                     f"{s['alone_same_misses_stream_chunk_hit_rate']:.0%} in the stream).")
    return lines


def same_answers(data: dict, load: str) -> str:
    """', same answer as plain vLLM: a of n requests (b of m blended)' for one load ('' without texts)."""
    runs = {r["server"]: {x["i"]: x for x in r["records"]} for r in data["runs"] if r["load"] == load}
    plain, blend = runs.get("plain", {}), runs.get("blend", {})
    both = [i for i in blend if i in plain and "text" in blend[i] and "text" in plain[i]]
    if not both:
        return ""
    same = [i for i in both if blend[i]["text"] == plain[i]["text"]]
    blended = [i for i in both if blend[i]["blended"]]
    return (f"; same answer as plain vLLM: {len(same)} of {len(both)} requests "
            f"({sum(i in same for i in blended)} of {len(blended)} blended)")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def instances_table(data: dict) -> list[str]:
    """With --instances N > 1: per server, chunk hits and vLLM's cached share per instance, and the
    requests with passages first seen on another instance (their hits come from its dumps)."""
    runs = [r for r in data["runs"] if r["summary"].get("instances", 1) > 1]
    if not runs:
        return []
    lines = ["", f"{runs[0]['summary']['instances']} instances, requests round robin; a passage is first seen "
             "elsewhere when every earlier request that sent it went to another instance.", "",
             "| server | load | chunk blocks hit per instance | vLLM cached share per instance | passages first seen "
             "elsewhere (requests) | chunk hits of those requests / of the rest |", "|---|---|---|---|---|---|"]
    for run in runs:
        s = run["summary"]
        lines.append(f"| {run['server']} | {run['load']} | {' / '.join(map(_share, s['chunk_hit_rate_per_instance']))} "
                     f"| {' / '.join(map(_share, s['vllm_cached_share_per_instance']))} | "
                     f"{s['passages_first_seen_elsewhere']} ({s['requests_first_seen_elsewhere']}) | "
                     f"{_share(s['first_seen_elsewhere_chunk_hit_rate'])} / {_share(s['other_requests_chunk_hit_rate'])} |")
    return lines


def _high_hit_from(plain: dict, blend: dict | None) -> dict:
    """A plain run of another invocation: its high-hit requests are those the Blend run hit
    (rag_traffic.py marks them only within one invocation); only their TTFT p50 is shown."""
    if blend is None or plain["summary"]["high_hit_requests"]:
        return plain
    high = _rag_traffic().high_hit_requests(blend["records"])
    ttft = [r["ttft_s"] for r in plain["records"] if r["i"] in high]
    summary = {**plain["summary"], "high_hit_requests": len(ttft),
               "high_hit_ttft_p50_s": statistics.median(ttft) if ttft else None}
    return {**plain, "summary": summary}


def with_baseline(data: dict, baseline: dict | None) -> dict:
    """The run with plain vLLM's rows taken from `baseline` (a run of the same stream) and Blend's
    speed-up per load recomputed against them."""
    if baseline is None:
        return data
    blend = {r["load"]: r for r in data["runs"] if r["server"] == "blend"}
    runs = [_high_hit_from(r, blend.get(r["load"])) for r in baseline["runs"] if r["server"] == "plain"]
    runs += [r for r in data["runs"] if r["server"] != "plain"]
    plain = {r["load"]: r["summary"] for r in runs if r["server"] == "plain"}
    speedup = {r["load"]: {"requests_per_s": r["summary"]["requests_per_s"] / plain[r["load"]]["requests_per_s"],
                           "ttft_p50": plain[r["load"]]["ttft_p50_s"] / r["summary"]["ttft_p50_s"]}
               for r in runs if r["server"] == "blend" and r["load"] in plain}
    return {**data, "runs": runs, "speedup": speedup}


def _headline_serve(data: dict, host: str) -> list[str]:
    """The replay's headline rows: TTFT one at a time, requests/s at concurrency 4 against Blend off
    and against plain vLLM; `host` names the host where it is not the first table's."""
    rows, by = [], {(r["mode"], r["concurrency"]): r for r in data["phases"]}
    where = f", {host}" if host else ""
    for c, what in ((1, "TTFT p50"), (4, "requests/s")):
        on, off = by.get(("blend", c)), by.get(("full", c))
        if not (on and off):
            continue
        if what == "TTFT p50":
            rows.append(f"| `vllm serve`, ~{data['mean_prompt_tokens']:.0f}-token MuSiQue prompts, passages indexed first "
                        f"({data.get('dtype', 'float32')}, {_kv_shift(data)}{where}), {what}, 1 at a time | "
                        f"{on['ttft_p50_s']:.2f} s | {off['ttft_p50_s']:.2f} s | {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x |")
        else:
            rows.append(f"| the same, {what} at concurrency {c} ({on['blended']}/{on['requests']} blended) | "
                        f"{on['requests_per_s']:.3f} | {off['requests_per_s']:.3f} | "
                        f"{on['requests_per_s'] / off['requests_per_s']:.2f}x |")
            plain = by.get(("plain", c))
            if plain:
                rows.append(f"| the same, against plain vLLM (no connector, prefix caching on) | "
                            f"{on['requests_per_s']:.3f} | {plain['requests_per_s']:.3f} | "
                            f"{on['requests_per_s'] / plain['requests_per_s']:.2f}x |")
    return rows


def headline() -> str:
    """The README's small table: serving under load and the 100-question quality run."""
    rows = ["| measured on | Blend 0.15 | Blend off | gain |", "|---|---|---|---|"]
    for name, host in HEADLINE_SERVE:
        serve = RESULTS / name
        if serve.is_file():
            rows += _headline_serve(json.loads(serve.read_text()), host)
    for name, what in HEADLINE_TRAFFIC:
        path = RESULTS / name
        entry = next((t for t in TRAFFIC_RUNS if t[0] == name), None)
        if path.is_file() and entry is not None:
            base = RESULTS / entry[3] if entry[3] else None
            data = with_baseline(json.loads(path.read_text()),
                                 json.loads(base.read_text()) if base and base.is_file() else None)
            on = next((r for r in data["runs"] if r["server"] == "blend"), None)
            off = next((r for r in data["runs"] if r["server"] == "plain" and on and r["load"] == on["load"]), None)
            if on and off:
                a, b = on["summary"], off["summary"]
                rows.append(f"| `vllm serve`, {what}, {a['chunk_hit_rate']:.0%} of chunk blocks hit, "
                            f"{data.get('dtype', 'float32')}), requests/s at "
                            f"{on['load'].replace('c=', 'concurrency ')}, against plain vLLM | {a['requests_per_s']:.3f} | "
                            f"{b['requests_per_s']:.3f} | {a['requests_per_s'] / b['requests_per_s']:.2f}x |")
    for name in HEADLINE_LARGER:
        path = RESULTS / name
        if path.is_file():
            data = json.loads(path.read_text())
            modes = {r["mode"]: r for r in data["summary"]}
            full, blend, c = modes.get("full prefill"), modes.get("blend 0.15"), data["config"]
            if full and blend:
                model = Path(str(c["model"])).name
                dataset = "MuSiQue" if c["dataset"] != "generated" else "generated"
                skip = c.get("skip_questions") or 0
                which = f" ({skip + 1}-{skip + c['num_questions']}, held out)" if skip else ""
                rows.append(f"| offline, {model}, {c['num_questions']} {dataset} questions{which} "
                            f"(~{data['prompt_tokens']['mean']:.0f} tokens, {c['dtype'] if c['dtype'] != 'default' else 'float32'}), "
                            f"median TTFT | {blend['median_ttft_s']:.2f} s | {full['median_ttft_s']:.2f} s | "
                            f"{blend['speedup']:.2f}x |")
                rows.append(f"| the same, F1 of the answer against the gold answers | {blend['f1_gold']:.3f} | "
                            f"{full['f1_gold']:.3f} | - |")
    quality = RESULTS / HEADLINE_RUN
    if quality.is_file():
        data = json.loads(quality.read_text())
        modes = {r["mode"]: r for r in data["summary"]}
        full, blend = modes.get("full prefill"), modes.get("blend 0.15")
        c = data["config"]
        if full and blend:
            rows.append(f"| offline, {c['num_questions']} MuSiQue questions ({c['dtype']}, {_kv_shift(c)}), median TTFT | "
                        f"{blend['median_ttft_s']:.2f} s | {full['median_ttft_s']:.2f} s | {blend['speedup']:.2f}x |")
            rows.append(f"| the same, F1 of the answer against full prefill's | {blend['f1_vs_full']:.3f} | 1 | - |")
            if blend.get("kl_vs_full") is not None:
                rows.append(f"| the same, next-token KL to full prefill's | {blend['kl_vs_full']:.4f} | 0 | - |")
    return "\n".join(rows)


def faults_table(data: dict) -> str:
    """One row per scenario of benchmarks/store_faults.py: what was done, what happened."""
    c, k, x = data["concurrency"], data["sigkill"], data["corruption"]
    cap, hot, root, f = data["capacity"], data["hot_blocks"], data["lost_root"], data["fifo_timeout"]
    kinds = ", ".join(f"{n} {v}" for n, v in x["detected_by_kind"].items())
    rows = [
        ("concurrency", f"{c['processes']} processes x {c['seconds']} s on {c['keys']} shared keys",
         f"{c['verified_loads']} verified loads, **{c['wrong_reads']} wrong**"),
        ("SIGKILL mid-dump", f"{k['kills']} writers killed",
         f"{k['visible_blocks']} visible blocks, **{k['torn_blocks']} torn**, "
         f"{k['abandoned_temp_files']} temp files left"),
        ("corruption", f"{x['corrupted']} blocks damaged ({kinds})",
         f"**{x['detected']} detected, {x['served_wrong']} served**"),
        ("capacity", f"{cap['writers']} processes write {cap['blocks_written']} blocks into {cap['capacity_blocks']}",
         f"peak **{cap['peak_over_blocks']:.0f}** blocks over, **{cap['final_over_blocks']:.0f}** after"),
        ("hot blocks", "read by one process while another evicts", f"**{hot['survived']} of {hot['hot']}** survive"),
        ("lost root", "store directory deleted under an open store",
         f"dump refused: {root['dump_refused']}, tree recreated: {root['tree_recreated']}"),
        ("FIFO", "a FIFO at a block name", f"loads returned in {f['fifo_loads_returned_s']} s: {f['fifo_results']}"),
        ("timeout", "a load that cannot finish in load_timeout_s",
         f"returned in {f['timeout_load_returned_s']} s, {f['timed_out_blocks']} blocks missed, "
         f"{f['timed_out_served']} served"),
    ]
    if "ledger_lock" in data:  # runs before 2026-11-25 did not have it
        g = data["ledger_lock"]
        rows.append(("ledger lock", f"another process holds the capacity ledger's lock "
                     f"(lookup_timeout_s {g['lookup_timeout_s']})",
                     f"dumps returned in {', '.join(map(str, g['dump_returned_s']))} s, "
                     f"**{g['written_while_held']} written**, {g['refused_blocks']} refused; "
                     f"after: {g['stored_after']} stored, **{g['reservations_left']} bytes reserved**"))
    lines = ["| scenario | injected | outcome |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {o} |" for a, b, o in rows]
    return "\n".join(lines)


def _by_question(data: dict, mode: str) -> dict:
    return {q["question"]: m for q in data["questions"] for m in q["measurements"] if m["mode"] == mode}


def paired_table(base: dict, new: dict, pairs) -> str:
    """Per pair of modes: mean next-token KL of each, the mean difference with a 95% bootstrap
    interval (questions resampled), and the answers that became / stopped being full prefill's."""
    lines = ["| base mode | new mode | questions | same answer base / new | answers won / lost | KL base | KL new "
             "| KL difference (95% CI) |", "|---|---|---|---|---|---|---|---|"]
    for a, b in pairs:
        ma, mb = _by_question(base, a), _by_question(new, b)
        qs = sorted(set(ma) & set(mb))
        if not qs:
            continue
        won = sum(mb[q]["agrees_with_full"] and not ma[q]["agrees_with_full"] for q in qs)
        lost = sum(ma[q]["agrees_with_full"] and not mb[q]["agrees_with_full"] for q in qs)
        agree = (f"{100 * sum(ma[q]['agrees_with_full'] for q in qs) / len(qs):.1f}% / "
                 f"{100 * sum(mb[q]['agrees_with_full'] for q in qs) / len(qs):.1f}%")
        kl = " - | - | - |"
        if all(ma[q].get("kl_vs_full") is not None and mb[q].get("kl_vs_full") is not None for q in qs):
            diff = [mb[q]["kl_vs_full"] - ma[q]["kl_vs_full"] for q in qs]
            lo, hi = bootstrap_ci(diff) or (float("nan"), float("nan"))
            kla = sum(ma[q]["kl_vs_full"] for q in qs) / len(qs)
            klb = sum(mb[q]["kl_vs_full"] for q in qs) / len(qs)
            kl = f" {kla:.4f} | {klb:.4f} | {sum(diff) / len(qs):+.4f} ({lo:+.4f} .. {hi:+.4f}) |"
        lines.append(f"| {a} | {b} | {len(qs)} | {agree} | {won} / {lost} |{kl}")
    return "\n".join(lines)


def pooled_table(runs: list[dict], modes: list[str]) -> str:
    """Every question of several runs on one set, pooled (a question in two runs counts once, as its
    first run measured it): per mode, gold F1 against full prefill's with the 95% bootstrap interval of
    the per-question difference, the answers that are full prefill's, the next-token KL."""
    full: dict = {}
    by_mode: dict = {mode: {} for mode in modes}
    for data in runs:
        skip = data["config"].get("skip_questions") or 0  # "question" counts from the run's first
        for q, m in _by_question(data, "full prefill").items():
            full.setdefault(skip + q, m)
        for mode in modes:
            for q, m in _by_question(data, mode).items():
                by_mode[mode].setdefault(skip + q, m)
    lines = ["| mode | questions | gold F1: full prefill | gold F1 | share of full prefill's | difference (95% CI) "
             "| same answer as full prefill | next-token KL (95% CI) |", "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        qs = [q for q in by_mode[mode] if q in full]
        if not qs:
            continue
        f = [full[q]["f1_gold"] or 0.0 for q in qs]
        b = [by_mode[mode][q]["f1_gold"] or 0.0 for q in qs]
        lo, hi = bootstrap_ci([y - x for x, y in zip(f, b)]) or (float("nan"), float("nan"))
        kl = [by_mode[mode][q]["kl_vs_full"] for q in qs if by_mode[mode][q].get("kl_vs_full") is not None]
        kl_ci = bootstrap_ci(kl)
        kl_text = (f"{statistics.mean(kl):.3f}" + (f" ({kl_ci[0]:.3f} .. {kl_ci[1]:.3f})" if kl_ci else "")) if kl else "-"
        share = f"{sum(b) / sum(f):.0%}" if sum(f) else "-"
        same = sum(bool(by_mode[mode][q].get("agrees_with_full")) for q in qs)
        lines.append(f"| {mode} | {len(qs)} | {statistics.mean(f):.3f} | {statistics.mean(b):.3f} | {share} | "
                     f"{statistics.mean(b) - statistics.mean(f):+.3f} ({lo:+.3f} .. {hi:+.3f}) | {same} / {len(qs)} | {kl_text} |")
    return "\n".join(lines)


def storm_table(data: dict) -> list[str]:
    """A fault_storm.py run: per round, the faults injected and whether every answer was plain vLLM's."""
    audit = data.get("audit", {})
    lines = [f"{data['model']}, {data['dtype']}, {data['questions']} questions (~{data['mean_prompt_tokens']:.0f} "
             f"tokens), concurrency {data['concurrency']}, Blend at ratio 1.0; faults `{data['shares']}`. "
             f"**{data.get('faults', '-')} faults injected, {data.get('answered', '-')} of {data.get('requests', '-')} "
             f"requests answered, {data.get('same_as_plain', '-')} as plain vLLM; audit: {audit.get('compared', '-')} "
             f"exact blocks compared, {len(audit.get('bad', []))} bad.**", "",
             "| round | faults | injected by stage | answered | as plain vLLM | blended | fallbacks |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rounds"]:
        stages = ", ".join(f"{k} {v}" for k, v in sorted(r["injected"].items())) or "-"
        falls = ", ".join(f"{k.removeprefix('blend_fallbacks_')} {v}" for k, v in r["counters"].items()
                          if k.startswith("blend_fallbacks_")) or "-"
        lines.append(f"| {r['round']} | {'on' if r['faults_on'] else 'off'} | {stages} | {r['answered']}/{r['requests']} "
                     f"| {r['same_as_plain']} | {r['counters'].get('blended_requests', 0)} | {falls} |")
    return lines


def profile_table(data: dict) -> list[str]:
    """A profile_stream.py run: each vLLM process's samples by part, and the connector's heaviest entry points."""
    over = f" over {data['duration_s']:.0f} s" if data.get("duration_s") else ""
    rate = f" at {data['rate_hz']} Hz" if data.get("rate_hz") else ""
    lines = [f"py-spy{rate}{over}.", ""]
    for label, proc in data["processes"].items():
        total, busy = proc["samples"], max(proc["busy_samples"], 1)
        lines += [f"**{label}**: {total} samples, {proc['busy_samples']} busy.", "",
                  "| part | share of samples | share of busy samples |", "|---|---|---|"]
        for part, n in proc["parts"].items():
            busy_share = "" if part.startswith("idle") else f"{100 * n / busy:.1f}%"
            lines.append(f"| {part} | {100 * n / max(total, 1):.1f}% | {busy_share} |")
        phases = proc.get("blend_step_phases") or {}
        steps = sum(phases.values())
        if steps:
            lines += ["", f"Inside Blend steps ({steps} samples, {100 * steps / busy:.1f}% of busy):", "",
                      "| phase of a Blend step | share of its samples |", "|---|---|"]
            lines += [f"| {phase} | {100 * n / steps:.1f}% |" for phase, n in phases.items()]
        entries = list(proc["connector_entry_points"].items())[:8]
        if entries:
            lines += ["", "| connector entry point | share of busy samples |", "|---|---|"]
            lines += [f"| `{fn}` | {100 * n / busy:.1f}% |" for fn, n in entries]
        lines.append("")
    return lines


def attention_table(runs: list[tuple[str, dict]]) -> str:
    """attention_bench.py runs: per model geometry, each path's best time per layer."""
    paths = list(dict.fromkeys(p for _, data in runs for p in data["seconds"]))
    lines = ["| geometry | rows over keys | " + " | ".join(paths) + " |", "|---|---|" + "---|" * len(paths)]
    for model, data in runs:
        g = data["geometry"]
        cells = [f"{1e3 * data['seconds'][p]:.1f} ms" if p in data["seconds"] else "-" for p in paths]
        lines.append(f"| {model} ({g['kv_heads']} KV heads x {g['group']}, head size {g['head_size']}) | "
                     f"{data['rows']} over {data['keys']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_layer_table(runs: list[dict]) -> str:
    """One row per Blend mode of runs that differ only in the check layer."""
    lines = ["| check layer | mode | median TTFT | speed-up | same answer | F1 vs gold minus full's | next-token KL |",
             "|---|---|---|---|---|---|---|"]
    for data in runs:
        layer = data["config"].get("check_layer")
        for row in data["summary"]:
            if row["mode"] == "full prefill":
                continue
            kl = row.get("kl_vs_full")
            lines.append(f"| {layer} | {row['mode']} | {row['median_ttft_s']:.2f} s | {row.get('speedup') or 1.0:.2f}x | "
                         f"{row['agree_pct']:.0f}%{_ci(row, 'agree_pct', '{:.0f}')} | "
                         f"{row['f1_gold_delta']:+.3f}{_ci(row, 'f1_gold_delta', '{:+.3f}')} | "
                         + (f"{kl:.4f}{_ci(row, 'kl_vs_full', '{:.4f}')} |" if kl is not None else "- |"))
    return "\n".join(lines)


def study_table(data: dict) -> str:
    """One row per variant of a reuse_study.py run."""
    lines = ["| variant | next-token KL | same answer | recomputed share |", "|---|---|---|---|"]
    for name, row in data["summary"].items():
        lines.append(f"| {name} | {row['kl']:.4f} | {row['agree_pct']:.0f}% | {row['cost']:.2f} |")
    return "\n".join(lines)


def _section(title: str, header: str, name: str, render) -> tuple[str, list[str]]:
    """A results section: (its file, [title, how it was made, `render(data)` of the file, or "(not run)"])."""
    path = RESULTS / name
    body = render(json.loads(path.read_text())) if path.is_file() else ["(not run)"]
    return name, [f"## {title}", "", header, "", *body, ""]


def pooled_lines(name: str) -> list[str]:
    """A run's questions pooled with the earlier runs on the same set (POOL_WITH), if any."""
    if name not in POOL_WITH:
        return []
    earlier, modes = POOL_WITH[name]
    present = [n for n in earlier if (RESULTS / n).is_file()]
    runs = [json.loads((RESULTS / n).read_text()) for n in [name, *present]]
    return ["", f"Pooled with {', '.join(f'`{n}`' for n in present)} (the same set, other questions):", "",
            pooled_table(runs, modes)]


def sections() -> list[tuple[str, list[str]]]:
    """Every run's section, in the history's order (each kind newest first)."""
    out = []
    for name, title, command in QUALITY_RUNS:
        out.append(_section(title, f"`{command}`", name, lambda data: [eval_context(data) + ".", "", eval_table(data),
                                                                         *pooled_lines(name)]))
    name, command = SERVE_RUN
    out.append(_section("Serving under load", f"`{command}` -> `benchmarks/results/{name}`", name, lambda data: [
        f"{data['questions']} {data['dataset']} questions, ~{data['mean_prompt_tokens']:.0f}-token prompts, "
        f"ratio {data['ratio']}, vLLM's default scheduler settings.", "", serve_table(data)]))
    first_path = RESULTS / SERVE_RUN[0]
    first = json.loads(first_path.read_text()) if first_path.is_file() else None
    for name, title, command in SERVE_RERUNS:
        out.append(_section(title, f"`{command}`", name, lambda data: [serve_table(data), "", rerun_answers(data, first)]))
    for name, title, command, base in TRAFFIC_RUNS:
        baseline = json.loads((RESULTS / base).read_text()) if base and (RESULTS / base).is_file() else None
        note = f" Plain vLLM's rows: `{base}` (the same stream)." if base else ""
        out.append(_section(title, f"`{command}`{note}", name, lambda data: traffic_table(data, baseline)))
    for name, command in HIT_THRESHOLD_RUNS:
        model = " (Qwen2.5-Coder-0.5B-Instruct)" if name.startswith("qwen05") else ""
        out.append(_section(f"Where Blend pays: one request, k of 10 passages cached{model}", f"`{command}`", name,
                            hit_threshold_table))
    name, command = ADMISSION_SIM_RUN
    out.append(_section("Admission rules replayed over many streams", f"`{command}`", name, admission_sim_table))
    for name, title, command in PROFILE_RUNS:
        out.append(_section(title, f"`{command}`", name, profile_table))
    name, command = STORM_RUN
    out.append(_section("A storm of faults through ucm-vllm serve", f"`{command}` -> `benchmarks/results/{name}`",
                        name, storm_table))
    name, command = FAULTS_RUN
    out.append(_section("Store under faults", f"`{command}` -> `benchmarks/results/{name}`", name,
                        lambda data: [faults_table(data)]))
    for name, title, command in EVAL_RUNS:
        out.append(_section(title, f"`{command}`", name, lambda data: [eval_context(data) + ".", "", eval_table(data)]))
    for title, base_name, new_name, pairs in PAIRED:
        base = RESULTS / base_name
        section = _section(title, f"Question by question: `{base_name}` against `{new_name}`.", new_name,
                           lambda data: [paired_table(json.loads(base.read_text()), data, pairs)]
                           if base.is_file() else ["(not run)"])
        out.append((f"{base_name} vs {new_name}", section[1]))
    for title, command, runs in ATTENTION_RUNS:
        present = [(model, json.loads((RESULTS / n).read_text())) for model, n in runs if (RESULTS / n).is_file()]
        out.append((runs[0][1], [f"## {title}", "", f"`{command}`, for each geometry", "",
                                 attention_table(present) if present else "(not run)", ""]))
    for title, command, names in CHECK_LAYER_STUDIES:
        present = [json.loads((RESULTS / n).read_text()) for n in names if (RESULTS / n).is_file()]
        body = [eval_context(present[0]).split(", started")[0] + ".", "", check_layer_table(present)] if present else ["(not run)"]
        out.append((names[0], [f"## {title}", "", f"`{command}`, for each check layer", "", *body, ""]))
    for name, title, command in STUDY_RUNS:
        out.append(_section(title, f"`{command}`", name, lambda data: [
            f"{data['n']} generated questions, KL to full prefill teacher-forced over 2 answer tokens, 16-token "
            "greedy answers, float32 (see the script's docstring for each variant).", "", study_table(data)]))
    return out


def _host_line(name: str) -> str:
    """Where a run ran, from what its JSON recorded (older runs recorded less)."""
    data = json.loads((RESULTS / name).read_text())
    host = data.get("host") or data.get("config") or {}
    parts = [f"`{name}`"]
    if host.get("started"):
        parts.append(f"started {host['started']}")
    if host.get("commit"):
        parts.append(f"code {host['commit']}")
    if host.get("cpu_isa"):
        parts.append(f"CPU {host['cpu_isa']}")
    if host.get("cpu_count"):
        parts.append(f"{host['cpu_count']} cores")
    return "Run: " + ", ".join(parts) + "."


_PREAMBLE = ("Printed by `python benchmarks/make_results.py` from the JSON files in `benchmarks/results/`; "
             "do not edit by hand. Each section names the command that wrote its file. Reference machine: "
             "2 CPU cores, no GPU, vllm-cpu 0.32.0, SmolLM2-135M-Instruct unless a section names another model, "
             "check layer 1. Interpretation and the variants tried: [research.md](research.md). The default "
             "`kv_shift` is 0.5 since 2026-11-24; runs made without it reproduce with `--kv-shift 0` added to "
             "their command. Hosts differ in speed (AVX2, AVX-512, AMX): compare seconds only within a run.")


def results_page() -> str:
    """Today's result of each benchmark: the latest run of each kind (LATEST)."""
    by_name = dict(sections())
    out = ["# Results", "", _PREAMBLE, "",
           "The latest run of each benchmark; every earlier run, superseded or kept for its comparison: "
           "[results-history.md](results-history.md).", ""]
    for kind, name in LATEST:
        title, *rest = by_name[name]
        out += [f"## {kind}", "", title.replace("## ", "**", 1) + "**", "", _host_line(name), *rest[1:]]
    return "\n".join(out)


def history_page() -> str:
    """Every run not on the latest page, each kind newest first."""
    latest = {name for _, name in LATEST}
    out = ["# Results: history", "", _PREAMBLE, "", "Today's numbers: [results.md](results.md).", ""]
    for name, lines in sections():
        if name not in latest:
            out += lines
    return "\n".join(out)


def main() -> int:
    DOCS.write_text(results_page())
    HISTORY.write_text(history_page())
    text = README.read_text()
    if HEADLINE_BEGIN in text and HEADLINE_END in text:
        head, rest = text.split(HEADLINE_BEGIN, 1)
        _, tail = rest.split(HEADLINE_END, 1)
        README.write_text(f"{head}{HEADLINE_BEGIN}\n{headline()}\n{HEADLINE_END}{tail}")
    print(f"wrote {DOCS.relative_to(REPO)}, {HISTORY.relative_to(REPO)} and the headline of README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
