"""The `ucm` loggers print in vLLM's format at vLLM's level (VLLM_LOGGING_LEVEL), in a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

SCRIPT = """
import logging

from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

from ucm.integration.vllm.plugin import share_vllm_logging

log = logging.getLogger("ucm.integration.vllm.connector.scheduler_side")
share_vllm_logging()  # vLLM loads the plugin first, then configures its logging when an engine starts
log.warning("before vLLM's logging")
configure_logging(LoggingConfig())
log.warning("a ucm warning")
log.info("a ucm info line")
"""


def test_ucm_logs_like_vllm():
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    (line,) = [x for x in out.splitlines() if "a ucm warning" in x]
    assert re.match(r"(\(\w+ pid=\d+\) )?WARNING \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] a ucm warning$", line), line
    assert "a ucm info line" not in out  # below VLLM_LOGGING_LEVEL
    assert "before vLLM's logging" in out  # not lost while vLLM's logging is not configured yet
