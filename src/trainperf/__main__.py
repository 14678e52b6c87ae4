"""``python -m trainperf``: the same as the ``trainperf`` command."""

from __future__ import annotations

from trainperf.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
