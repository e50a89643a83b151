"""One --help convention for every script of the package (the main job, the benchmarks, the audit)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of every script: the description as written, each option's default shown (where it
    has one that says something) from the parser itself, never hand-typed."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, "", argparse.SUPPRESS) or not action.option_strings:
            return text
        default = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {default})" if text else f"(default: {default})"
