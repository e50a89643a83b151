"""The embedded model runs on the real vLLM engine and knows the capital of France."""

from vllm import SamplingParams


def test_greedy_capital_of_france(plain_llm):
    out = plain_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0),
                             use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
