"""--help shows each option's default from the parser, and none where the default says nothing."""

import argparse

from ucm.argparse_help import HelpFormatter
from ucm.integration.vllm.audit import build_parser


def help_of(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())  # argparse wraps lines at the terminal's width


def test_defaults_come_from_the_parser():
    p = argparse.ArgumentParser(description="line one\n  kept as written", formatter_class=HelpFormatter)
    p.add_argument("--ratio", type=float, default=0.15, help="recompute share")
    p.add_argument("--ratios", default=[0.15, 0.3], help="several")
    p.add_argument("--own", default=3, help="stated (default: %(default)s)")
    p.add_argument("--out", help="a path")
    p.add_argument("--flag", action="store_true", help="on or off")
    text = help_of(p)
    assert "recompute share (default: 0.15)" in text and "several (default: 0.15,0.3)" in text
    assert "stated (default: 3)" in text and text.count("(default: 3)") == 1
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "line one\n  kept as written" in p.format_help()


def test_the_audit_uses_it():
    text = help_of(build_parser())
    assert "the writers' tensor_parallel_size (default: 1)" in text and "(default: None)" not in text
