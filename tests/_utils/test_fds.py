"""trainperf._utils.fds: waiting for descriptors of any number."""

from __future__ import annotations

import os
import resource

import pytest

from trainperf._utils.fds import readable


def test_a_descriptor_numbered_past_1024_is_waited_for() -> None:
    # select() raises ValueError for it: the writer's reaper died of that.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    r, w = os.pipe()
    high = os.dup2(r, 1050)
    try:
        assert readable([high], 0.0) == []
        os.write(w, b"x")
        assert readable([high], 1.0) == [high]
        os.close(w)
        w = -1
        os.read(high, 1)
        assert readable([high], 1.0) == [high]  # end of file counts as readable
    finally:
        for fd in (r, high, w):
            if fd >= 0:
                os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
