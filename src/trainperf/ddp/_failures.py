"""What the launcher says about a rank that failed: its summary, and the advice for the
failures whose cause is known without a traceback (a spawned worker that could not import
the script or main's module, or unpickle one of main's arguments). Used by
:mod:`~trainperf.ddp._group`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainperf.ddp._stderr import last_traceback
from trainperf.ddp._worker import Failure
from trainperf.ddp._worker_pickle import called_function

__all__ = [
    "DEATH_SLACK_S",
    "RELAUNCH_ADVICE",
    "Problem",
    "arguments_advice",
    "load_advice",
    "main_script",
    "startup_problem",
    "summarize",
    "unguarded_main",
]

# A death without a report is only seen when the parent wakes up, about when the peers'
# "connection closed" errors are stamped; dating it this much earlier blames the dead rank,
# not the ranks that failed because it was gone.
DEATH_SLACK_S = 1.0


@dataclass(frozen=True)
class Problem:
    rank: int
    time: float
    summary: str
    detail: str = ""  # the rank's traceback
    advice: str = ""  # what to do, when the cause is known without a traceback
    # How much earlier than ``time`` it may have happened: a death the launcher saw (at
    # ``time``) without a report carries DEATH_SLACK_S; a report, stamped when raised, 0.
    slack: float = 0.0
    # Whether a signal ended it (a negative exit code: the OOM killer's SIGKILL, a crash),
    # not its own exit path (``os._exit(n)``, ``sys.exit``): such a rank did not catch
    # another rank's error and exit, so no error within its slack is blamed over it.
    by_signal: bool = False
    # Whether SIGABRT ended it: a crash of its own, or NCCL's watchdog
    # (TORCH_NCCL_ASYNC_ERROR_HANDLING) ending a rank whose peer had gone, so a death or an
    # error of a rank's own dated before it is blamed over it.
    aborted: bool = False


# torch's error for a second init_process_group (ValueError in recent torch, RuntimeError
# before): under launch, main's own call is the second.
_INIT_TWICE = "trying to initialize the default process group twice"
_INIT_TWICE_FIX = (
    " (launch() already set up the process group for main: remove main's "
    "dist.init_process_group call, or guard it with 'if not dist.is_initialized():')"
)


def summarize(failure: Failure) -> str:
    """One line for a rank's failure report: what it raised (or the ``sys.exit`` it called),
    with the fix where the error alone hides the cause.

    Example:
        >>> twice = "trying to initialize the default process group twice!"
        >>> said = summarize(Failure(0, 1, "ValueError", twice, "tb", time=1.0))
        >>> said.startswith("raised ValueError: trying"), "launch() already set up" in said
        (True, True)
    """
    if failure.type_name == "SystemExit":
        return f"called {failure.message}"  # the call itself: ``_worker.exit_call``
    first_line = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
    if len(first_line) > 300:
        first_line = first_line[:300] + "..."
    text = f"raised {failure.type_name}" + (f": {first_line}" if first_line else "")
    if failure.stage == "main" and _INIT_TWICE in first_line:
        text += _INIT_TWICE_FIX
    if failure.stage == "args":
        return f"could not unpickle main's {failure.argument}: {text}"
    return f"could not load main: {text}" if failure.stage in ("load", "relaunch") else text


def main_script() -> str:
    return getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"


def load_advice(main: Callable[..., Any] | None) -> str:
    """What to do when a spawned worker could not load ``main``.

    Example:
        >>> def train(): ...
        >>> train.__module__ = "__main__"
        >>> "outside the" in load_advice(train)
        True
    """
    target = None if main is None else called_function(main)  # a partial: what it wraps
    module = getattr(target, "__module__", None) or "its module"
    if module == "__main__":
        # The worker imports the script without running its main-guarded block: a function
        # defined there (or assigned at run time) is missing from that import.
        name = getattr(target, "__qualname__", "main")
        return (
            f"Fix: a spawned worker imports {main_script()} again, without running its "
            'if __name__ == "__main__": block, and looks main up there by name: define '
            f"{name} at the script's top level, outside the "
            'if __name__ == "__main__": block (not inside it, nor assigned at run time); or '
            "use start_method='fork' (Linux), which needs no import."
        )
    return (
        f"Fix: a spawned worker is a new interpreter that imports main's module ({module}) by "
        "name, so it must be importable there: installed, or in a directory on sys.path (a "
        "module loaded from a file path with importlib is not); or use start_method='fork' "
        "(Linux), which needs no import."
    )


# For a worker whose import of main's module called launch() (``_worker_reimport``).
RELAUNCH_ADVICE = (
    "Fix: call launch() only when the script is run: under its "
    'if __name__ == "__main__": guard (or in a function the script calls there), not at the '
    "top level of a module that defines main, which each spawned worker imports; or use "
    'start_method="fork" (Linux), which imports nothing again.'
)


def arguments_advice(argument: str) -> str:
    return (
        f"Fix: each spawned worker unpickles main's arguments, and {argument} could not be "
        "rebuilt there: pickle.loads(pickle.dumps(value)) must work in a new interpreter (its "
        "class importable by name, at module top level; an exception class must pass its "
        "__init__ arguments on to super().__init__). Or build the object inside main, or use "
        "start_method='fork' (Linux), which pickles nothing."
    )


def startup_problem(rank: int, seen_at: float, text: str, code: int) -> Problem | None:
    """The failure Python printed while a spawned worker imported the script, if any; the
    worker ended with exit code ``code``."""
    found = last_traceback(text)
    if found is None:
        return None
    exception, tb = found
    script = main_script()
    summary = (
        f"could not start: {exception} (Python raised it while the new process imported "
        f"{script}, before trainperf's code ran there)"
    )
    if "bootstrapping phase" in text:
        advice = (
            f"Fix: code at the top level of {script} starts a process (a multiprocessing "
            "Process or Pool, a DataLoader with workers), and each spawned worker runs it again "
            "while it imports the script. Move it under the "
            'if __name__ == "__main__": guard (or into main), or use start_method="fork" '
            "(Linux)."
        )
    else:
        advice = (
            f"Fix: each spawned worker imports {script} again before it runs main, so its top "
            "level runs in every worker: move that code under the "
            'if __name__ == "__main__": guard (or into main), or use start_method="fork" '
            "(Linux), which imports nothing again."
        )
    return Problem(rank, seen_at, summary, tb, advice, DEATH_SLACK_S, by_signal=code < 0)


def unguarded_main() -> tuple[str, str]:
    """Summary and advice for workers that exited because the script has no main guard."""
    script = main_script()
    summary = (
        f"could not start: each spawned worker imports {script} again, and that import "
        "called launch() once more, because the call is not under an "
        'if __name__ == "__main__": guard'
    )
    advice = (
        "Fix: start the workers only when the script is run, not when it is imported:\n\n"
        '    if __name__ == "__main__":\n'
        "        trainperf.ddp.launch(main)\n\n"
        'In a notebook or REPL there is no script to import: use start_method="fork" (Linux).'
    )
    return summary, advice
