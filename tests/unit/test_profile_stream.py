"""benchmarks/profile_stream.py: a sample's place in vLLM's processes and in a Blend step's phases,
from py-spy's raw stacks (frames as py-spy writes them, with site-packages paths)."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = "/work/repo"
SITE = "/venv/lib/python3.11/site-packages"


@pytest.fixture(scope="module")
def ps():
    spec = importlib.util.spec_from_file_location("profile_stream", BENCHMARKS / "profile_stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(*inner: str) -> list[str]:
    """A worker sample inside a Blend step, `inner` the frames below blend_forward."""
    return [f"execute_model ({SITE}/vllm/v1/worker/gpu_model_runner.py:10)",
            f"BlendMixin.forward ({REPO}/ucm/integration/vllm/blend/models.py:41)",
            f"blend_forward ({REPO}/ucm/integration/vllm/blend/blend_forward.py:80)", *inner]


def test_a_blend_steps_phases_follow_its_innermost_known_frames(ps):
    layers = f"_run_from_check_layer ({REPO}/ucm/integration/vllm/blend/blend_forward.py:230)"
    subset = f"run_subset ({REPO}/ucm/integration/vllm/blend/passes.py:90)"
    attn = f"SubsetAttentionImpl.forward ({REPO}/ucm/integration/vllm/blend/sparse_attention.py:164)"
    native = f"paged_causal_attention ({REPO}/ucm/sparse/blend/tiled_attention.py:173)"
    shift = f"KVShiftPlan.apply ({REPO}/ucm/integration/vllm/blend/sparse_attention.py:125)"
    assert ps.blend_step_phase(step(layers, subset, attn, native)) == "attention: native kernel (scattered rows)"
    assert ps.blend_step_phase(step(layers, subset, attn, "cpu_attention (vllm/_custom_ops.py:5)")) == \
        "attention: vLLM's kernel (runs of rows)"
    assert ps.blend_step_phase(step(layers, subset, attn, shift)) == "KV shift"
    assert ps.blend_step_phase(step(layers, subset, f"forward ({SITE}/vllm/model_executor/layers/linear.py:5)")) == \
        "layers: projections, norms, MLP"
    probe = f"_score_loaded_rows ({REPO}/ucm/integration/vllm/blend/blend_forward.py:150)"
    assert ps.blend_step_phase(step(probe, subset, attn, native)) == "probe and ranking"
    assert ps.blend_step_phase(step(f"_select ({REPO}/ucm/integration/vllm/blend/blend_forward.py:180)")) == \
        "other (batch, selection, metadata)"


def test_samples_outside_a_blend_step_have_no_phase(ps):
    assert ps.blend_step_phase([f"execute_model ({SITE}/vllm/v1/worker/gpu_model_runner.py:10)",
                                f"forward ({SITE}/vllm/model_executor/models/llama.py:5)"]) is None
    assert ps.blend_step_phase([]) is None
    assert ps.blend_step_phase([f"check_blend_forward ({REPO}/ucm/integration/vllm/connector/worker_side.py:96)",
                                f"run_layers ({REPO}/ucm/integration/vllm/blend/passes.py:63)"]) is None


def test_summarize_counts_the_workers_blend_phases(ps, tmp_path):
    spawn = "process 2:\"python -c from multiprocessing.spawn import spawn_main\""
    worker = ["process 1:\"python benchmarks/blend_bench.py\"", spawn, spawn.replace("2:", "3:")]
    native = f"paged_causal_attention ({REPO}/ucm/sparse/blend/tiled_attention.py:173)"
    plain = f"forward ({SITE}/vllm/model_executor/models/llama.py:5)"
    raw = tmp_path / "samples.txt"
    raw.write_text(f"{';'.join(worker + step(native))} 7\n{';'.join(worker + [plain])} 3\n"
                   f"{';'.join(worker[:2] + [plain])} 5\n")
    out = ps.summarize(raw)["worker (model, connector's worker side)"]
    assert out["samples"] == 10
    assert out["blend_step_phases"] == {"attention: native kernel (scattered rows)": 7}
