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


def run_script(script: str) -> str:
    """Its output, run in a fresh process with VLLM_LOGGING_LEVEL=WARNING."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    return out


def test_ucm_logs_like_vllm():
    out = run_script(SCRIPT)
    (line,) = [x for x in out.splitlines() if "a ucm warning" in x]
    assert re.match(r"(\(\w+ pid=\d+\) )?WARNING \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] a ucm warning$", line), line
    assert "a ucm info line" not in out  # below VLLM_LOGGING_LEVEL
    assert "before vLLM's logging" in out  # not lost while vLLM's logging is not configured yet


LEVEL_SCRIPT = """
import logging

from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

from ucm.integration.vllm.plugin import share_vllm_logging

log = logging.getLogger("ucm.integration.vllm.connector.worker_side")
share_vllm_logging()  # the plugin loads: VLLM_LOGGING_LEVEL (WARNING here)
configure_logging(LoggingConfig(log_level="DEBUG"))  # the engine starts: --log-level DEBUG
share_vllm_logging()  # the connector is built
log.debug("a ucm debug line")
"""


def test_ucm_follows_vllms_log_level_option():
    out = run_script(LEVEL_SCRIPT)
    assert re.search(r"DEBUG \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] a ucm debug line", out), out[-2000:]


def test_a_level_the_application_set_is_kept():
    script = ("import logging\nlogging.getLogger('ucm').setLevel(logging.ERROR)\n"
              "from ucm.integration.vllm.plugin import share_vllm_logging\nshare_vllm_logging()\n"
              "assert logging.getLogger('ucm').level == logging.ERROR\n")
    run_script(script)
