"""A spawned worker that imports a script whose ``launch()`` call no ``__main__`` guard
protects: how the worker knows, and the exit status that tells the launcher.
"""

from __future__ import annotations

import multiprocessing

__all__ = ["REIMPORT_EXIT_CODE", "WORKER_NAME_PREFIX", "reimporting_main"]

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
