"""The store audit's pure parts: prompts file, sampling, the comparison rule, usage errors."""

from __future__ import annotations

import math

import pytest
import torch

from ucm.integration.vllm import audit
from ucm.integration.vllm.audit import (AuditError, block_error, is_bad, main, parse_prompts, read_prompts, sample,
                                        shard_errors, tolerances)


def test_prompts_file_gives_vllm_prompts():
    lines = ['{"prompt_token_ids": [1, 2, 3]}', "", "  ", '{"prompt": "hello", "cache_salt": "tenant-a"}',
             '{"prompt": "x", "cache_salt": ""}']
    assert parse_prompts(lines) == [{"prompt_token_ids": [1, 2, 3]}, {"prompt": "hello", "cache_salt": "tenant-a"},
                                    {"prompt": "x"}]


@pytest.mark.parametrize("line, message", [
    ("{not json", "f.jsonl:2: not JSON"),
    ("[1, 2]", "f.jsonl:2: expected an object, got list"),
    ('{"prompt": "a", "salt": "s"}', "unknown keys ['salt']"),
    ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one of"),
    ("{}", "exactly one of"),
    ('{"prompt_token_ids": []}', "non-empty list of token ids"),
    ('{"prompt_token_ids": [1, -2]}', "non-empty list of token ids"),
    ('{"prompt_token_ids": [1, true]}', "non-empty list of token ids"),
    ('{"prompt_token_ids": "1 2"}', "non-empty list of token ids"),
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"prompt": "a", "cache_salt": 3}', "'cache_salt' must be a string"),
])
def test_malformed_prompt_lines_are_refused_with_their_line_number(line, message):
    with pytest.raises(AuditError, match="f.jsonl:2") as err:
        parse_prompts(['{"prompt": "ok"}', line], "f.jsonl")
    assert message in str(err.value)


def test_empty_or_missing_prompts_files_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(AuditError, match="no prompts"):
        read_prompts(empty)
    with pytest.raises(AuditError, match="cannot read .*missing.jsonl"):
        read_prompts(tmp_path / "missing.jsonl")


def test_sampling_is_a_reproducible_ordered_subset():
    assert sample(5, None, 0) == [0, 1, 2, 3, 4]
    assert sample(5, 9, 0) == [0, 1, 2, 3, 4]
    picked = sample(100, 10, seed=7)
    assert picked == sample(100, 10, seed=7) and picked == sorted(picked)
    assert len(set(picked)) == 10 and all(0 <= i < 100 for i in picked)
    assert any(sample(100, 10, seed=s) != picked for s in range(1, 4))
    with pytest.raises(AuditError, match="--sample must be >= 1"):
        sample(5, 0, 0)


def test_tolerances_per_dtype_and_overrides():
    assert tolerances("float32") == tolerances("torch.float32") == audit.TOLERANCES["float32"]
    assert tolerances("bfloat16") == audit.TOLERANCES["bfloat16"]
    assert tolerances("float32", atol=0.5) == (0.5, audit.TOLERANCES["float32"][1])
    assert tolerances("float32", rtol=0.0) == (audit.TOLERANCES["float32"][0], 0.0)
    # bfloat16 is at least as loose as float32: its rounding noise is larger
    assert all(b >= f for b, f in zip(tolerances("bfloat16"), tolerances("float32")))


def test_comparison_rule_scales_with_the_reference_and_flags_nan():
    ref = torch.linspace(-20, 30, 600).reshape(2, 3, 100)
    atol, rtol = tolerances("float32")
    assert block_error(ref.clone(), ref) == (0.0, 30.0)
    noise = ref + 5.76e-5 * torch.sign(torch.randn_like(ref))  # the largest float32 noise measured
    err, ref_max = block_error(noise, ref)
    assert err == pytest.approx(5.76e-5, rel=1e-2) and not is_bad(err, ref_max, atol, rtol)
    other = ref.flip(0)  # another block's well-formed KV
    assert is_bad(*block_error(other, ref), atol, rtol)
    assert not is_bad(0.02, 30.0, 0.0, 1e-3) and is_bad(0.04, 30.0, 0.0, 1e-3)  # atol + rtol * max|reference|
    assert is_bad(0.02, 0.0, 0.01, 1.0) and not is_bad(0.005, 0.0, 0.01, 1.0)
    nan = ref.clone()
    nan[0, 0, 0] = float("nan")
    err, _ = block_error(nan, ref)
    assert math.isinf(err) and is_bad(err, 30.0, atol, rtol)


def test_tensor_parallel_shards_are_compared_with_their_heads():
    ref = torch.randn(4, 2, 2, 6, 8)  # [tokens, layers, 2, heads, head_size]
    shards = [ref[:, :, :, 2 * r:2 * r + 2].contiguous().reshape(-1) for r in range(3)]
    assert [e for e, _ in shard_errors(ref, shards)] == [0.0, 0.0, 0.0]
    swapped = [shards[1], shards[0], shards[2]]
    errors = [e for e, _ in shard_errors(ref, swapped)]
    assert errors[0] > 0 and errors[1] > 0 and errors[2] == 0.0
    assert math.isinf(shard_errors(ref, [shards[0], None, shards[2]])[1][0])  # unreadable
    assert math.isinf(shard_errors(ref, [shards[0][:-1], shards[1], shards[2]])[0][0])  # wrong size
    # more ranks than heads: each rank holds one head, replicated
    two = torch.randn(4, 2, 2, 2, 8)
    replicas = [two[:, :, :, r * 2 // 4:r * 2 // 4 + 1].contiguous().reshape(-1) for r in range(4)]
    assert [e for e, _ in shard_errors(two, replicas)] == [0.0] * 4


def test_removal_deletes_a_block_and_tolerates_absent_ones(tmp_path):
    from ucm.store.nfs_store import UcmNfsStore

    keys = [bytes([i]) * 32 for i in (1, 2)]
    with UcmNfsStore({"storage_backends": str(tmp_path)}) as store:
        payload = torch.arange(64, dtype=torch.float32)
        assert store.wait(store.dump(keys[:1], [payload.numpy()], [4])) == [True]
        assert audit._remove(store, keys) is True
        assert store.lookup(keys) == [False, False]


def _usage(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().err


def test_usage_errors_exit_2_with_the_problem_named(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setattr(audit, "_run", lambda *a: pytest.fail("no engine may start on a usage error"))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cases = [
        (["--store", str(store), "--prompts", str(tmp_path / "nope.jsonl")], "--prompts: cannot read"),
        (["--store", str(tmp_path / "absent"), "--prompts", str(prompts)], "directory " + str(tmp_path / "absent")),
        (["--store", str(store), "--prompts", str(prompts), "--sample", "0"], "--sample must be >= 1"),
        (["--store", str(store), "--prompts", str(prompts), "--shards", "0"], "--shards must be >= 1"),
        (["--store", str(store), "--prompts", str(prompts), "--hash-algo", "xxhash"], "PYTHONHASHSEED"),
        (["--store", str(store), "--prompts", str(prompts), "--json", str(tmp_path / "no" / "r.json")], "--json"),
    ]
    for argv, message in cases:
        code, err = _usage(capsys, argv)
        assert code == 2 and message in err, (argv, err)
    with pytest.raises(SystemExit) as exit_:
        main(["--prompts", str(prompts)])
    assert exit_.value.code == 2 and "--store" in capsys.readouterr().err


def test_a_report_with_bad_blocks_exits_1_and_writes_json(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    report = audit.AuditReport(2, 5, 1, 1e-4, 1e-4, 0.5, [audit.BadBlock("ab" * 32, 1, 3, 0.5, True)])
    monkeypatch.setattr(audit, "_run", lambda *a: report)
    out = tmp_path / "r.json"
    assert main(["--store", str(tmp_path), "--prompts", str(prompts), "--json", str(out), "--remove"]) == 1
    printed = capsys.readouterr().out
    assert "5 blocks compared, 1 not in the store, 1 bad" in printed and "ab" * 32 in printed and "removed" in printed
    import json

    assert json.loads(out.read_text())["bad"][0] == {"key": "ab" * 32, "prompt": 1, "block": 3, "max_error": 0.5,
                                                     "removed": True, "chunk": None}
    report.bad.clear()
    assert main(["--store", str(tmp_path), "--prompts", str(prompts)]) == 0
    report.compared, report.missing = 0, 8
    assert main(["--store", str(tmp_path), "--prompts", str(prompts)]) == 0
    assert "none of the prompts' blocks is in the store" in capsys.readouterr().err
