"""Test resources a host may have the parts for and still refuse (a container without the right to
mount, a loop device or a cgroup it may not use): entered, or the test skipped with the reason."""

import contextlib


@contextlib.contextmanager
def entered_or_skip(resource):
    """`resource` entered for the test; a RuntimeError on entry (the host refused it) skips the test."""
    import pytest

    try:
        entered = resource.__enter__()
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        yield entered
    finally:
        resource.__exit__(None, None, None)
