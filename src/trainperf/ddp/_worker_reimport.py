"""A spawned worker that imports a script whose ``launch()`` call no ``__main__`` guard
protects: how the worker knows, and the exit status that tells the launcher. Also a worker
that imports main's module to load main, where that module calls ``launch()`` itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

__all__ = [
    "REIMPORT_EXIT_CODE",
    "WORKER_NAME_PREFIX",
    "loading_main",
    "refuse_launch_while_loading",
    "relaunched",
    "reimporting_main",
]

# Each worker process is named f"{WORKER_NAME_PREFIX}{rank}".
WORKER_NAME_PREFIX = "trainperf-rank"
# The exit status of a spawned worker whose import of the script called launch() again (no
# __main__ guard); the launcher turns it into the advice to add one.
REIMPORT_EXIT_CODE = 117


def reimporting_main() -> bool:
    """Whether this is a worker that ``launch`` spawned, still importing the main script.

    Under spawn each worker first imports the script again (as ``__mp_main__``); a
    ``launch()`` call that no ``if __name__ == "__main__":`` guard protects then runs in the
    worker too, where Python refuses it with a long "bootstrapping phase" traceback. Until
    that import is over, multiprocessing has not set the worker's parent process yet, while
    the process already bears the name the launcher gave it.

    Example:
        >>> reimporting_main()  # the launching process itself
        False
    """
    me = multiprocessing.current_process()
    return me.name.startswith(WORKER_NAME_PREFIX) and multiprocessing.parent_process() is None


# Set while this worker unpickles main and its arguments (importing their modules), and
# once launch() was called meanwhile.
_loading: list[bool] = []
_relaunched: list[bool] = []


@contextlib.contextmanager
def loading_main() -> Iterator[None]:
    """The span in which a spawned worker imports main's module to load main."""
    _loading.append(True)
    try:
        yield
    finally:
        _loading.pop()


def relaunched() -> bool:
    """Whether launch() was called (and refused) while this worker loaded main."""
    return bool(_relaunched)


def refuse_launch_while_loading() -> None:
    """Refuse a launch() that main's module makes when a spawned worker imports it: each
    worker would start workers of its own, and those theirs, without end (the script's own
    re-import is :func:`reimporting_main`'s case).

    Raises:
        RuntimeError: this worker is loading main.

    Example:
        >>> refuse_launch_while_loading()  # the launching process itself: nothing
    """
    if not _loading:
        return
    _relaunched.append(True)
    raise RuntimeError(
        "launch() called while this spawned worker imported a module to load main (or its "
        "arguments): that module calls launch() when it is imported, so each worker would "
        "start workers of its own, without end"
    )
