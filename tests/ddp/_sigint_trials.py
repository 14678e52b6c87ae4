"""SIGINT at random moments of ``launch``'s start-up, many times in one process (#20.6).

python _sigint_trials.py SEED START_METHOD:TRIALS:MAX_DELAY_S [...]

Each trial sends SIGINT to this process after a random delay while ``launch`` starts two
ranks whose ``main`` sleeps; ``launch`` must raise KeyboardInterrupt, and afterwards this
process must have no child left, running or zombie (multiprocessing's resource tracker
aside). Prints one JSON line: ``{"trials": N, "bad": [...]}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker
from typing import Any

import psutil

import trainperf.ddp as ddp

SLEEP_S = 5.0  # longer than any delay: a trial that returns normally lost its SIGINT


def sleeper() -> None:
    time.sleep(SLEEP_S)


def leftovers() -> list[dict[str, Any]]:
    tracker = resource_tracker._resource_tracker._pid
    found = []
    for child in psutil.Process().children():
        if child.pid == tracker:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append({"pid": child.pid, "status": child.status()})
    return found


def trial(how: str, delay: float) -> dict[str, Any] | None:
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    outcome = "returned without raising KeyboardInterrupt"
    try:
        timer.start()
        ddp.launch(sleeper, nprocs=2, backend="gloo", start_method=how)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        outcome = ""
    timer.join()
    left = leftovers()
    for child in left:  # clean up, so one bad trial does not spoil the next
        try:
            os.kill(child["pid"], signal.SIGKILL)
            os.waitpid(child["pid"], 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    if left or outcome:
        return {"delay": round(delay, 4), "left": left, "outcome": outcome}
    return None


def main() -> None:
    rng = random.Random(sys.argv[1])
    bad = []
    total = 0
    for spec in sys.argv[2:]:
        how, trials, max_delay = spec.split(":")
        for _ in range(int(trials)):
            result = trial(how, rng.uniform(0, float(max_delay)))
            if result is not None:
                bad.append({"trial": total, "start_method": how, **result})
            total += 1
    print(json.dumps({"trials": total, "bad": bad}), flush=True)


if __name__ == "__main__":
    main()
