"""trainperf.checkpoint._damaged: the steps restore found damaged, while their file is
unchanged."""

from __future__ import annotations

import os
from pathlib import Path

from trainperf.checkpoint._damaged import DamagedSteps
from trainperf.checkpoint._held import version


def test_a_step_is_damaged_only_while_its_file_is_the_version_found_so(tmp_path: Path) -> None:
    path = tmp_path / "step-000000002.pt"
    path.write_bytes(b"bad bytes")
    damaged = DamagedSteps()
    damaged.add(2, path, version(path))
    assert 2 in damaged and list(damaged) == [2] and 3 not in damaged
    path.write_bytes(b"bad bytes")  # same size, same inode: the mtime says it changed
    os.utime(path, ns=(10**18, 10**18))
    assert 2 not in damaged and list(damaged) == []


def test_a_missing_file_stays_damaged_until_it_is_back_or_discarded(tmp_path: Path) -> None:
    link = tmp_path / "step-000000009.pt"
    link.symlink_to(tmp_path / "gone.pt")
    damaged = DamagedSteps()
    damaged.add(9, link, version(link))  # None: nothing to stat
    assert 9 in damaged
    (tmp_path / "gone.pt").write_bytes(b"back")
    assert 9 not in damaged
    damaged.add(9, link, version(link))
    damaged.discard(9)
    damaged.discard(9)  # twice: nothing to forget
    assert 9 not in damaged and "9" not in damaged
