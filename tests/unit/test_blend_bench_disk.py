"""benchmarks/blend_bench.py --disk: its arguments, and each timed request reading from the disk."""

import pytest

from benchmark_scripts import load_script
from throttled_disk import ThrottledDisk, throttled_or_skip


@pytest.fixture(scope="module")
def bb():
    return load_script("blend_bench")


@pytest.mark.parametrize("argv, problem", [(["--disk", "0"], "positive read bandwidth"),
                                           (["--disk", "200", "--store-dir", "/tmp/x"], "drop --store-dir"),
                                           (["--disk", "200", "--mount", "latency_ms=5"], "drop --store-dir and --mount")])
def test_disk_arguments_that_cannot_run_name_the_problem(bb, argv, problem, capsys):
    with pytest.raises(SystemExit):
        bb.parse_args(argv)
    assert problem in capsys.readouterr().err
    assert bb.parse_args(["--disk", "200"]).disk == 200.0


@pytest.mark.skipif(ThrottledDisk.available() is not None, reason=f"throttled disk: {ThrottledDisk.available()}")
def test_each_timed_request_reads_from_the_disk_and_is_counted_alone(bb):
    with throttled_or_skip(size_gb=1, read_mb_s=1000) as disk:
        data = disk.path / "block"
        data.write_bytes(b"x" * (4 << 20))
        cold = bb.ColdReads(disk)
        for _ in range(2):  # two requests, each reading the file twice (the second from the page cache)
            cold()
            data.read_bytes()
            data.read_bytes()
        got = cold.finish()
        cgroup = disk._cgroup
    assert not cgroup.exists()
    assert [n >= 4 << 20 for n in got["read_bytes_per_request"]] == [True, True]
    assert all(n < 5 << 20 for n in got["read_bytes_per_request"])
    assert got["read_bytes"] >= sum(got["read_bytes_per_request"])
