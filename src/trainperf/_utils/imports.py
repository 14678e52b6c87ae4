"""Availability checks for optional packages, in one place.

A package counts as available only when its import spec is found *and* its distribution
is installed: a stray folder of the same name on ``sys.path`` is not enough (the check
Accelerate's ``_is_package_available`` makes). Nothing here imports the package itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import cache

__all__ = ["EXTRAS", "is_available", "require"]

# import name -> (distribution names that provide it, trainperf extra that installs it)
EXTRAS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "pynvml": (("nvidia-ml-py",), None),
    "torchvision": (("torchvision",), "vision"),
    "nvidia.dali": (("nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali-cuda130"), "dali"),
    "safetensors": (("safetensors",), "safetensors"),
    "matplotlib": (("matplotlib",), "plot"),
    "threadpoolctl": (("threadpoolctl",), None),
}


@cache
def is_available(import_name: str) -> bool:
    """Return True if ``import_name`` can be imported and its distribution is installed.

    Example:
        >>> is_available("torch")
        True
        >>> is_available("surely_not_a_real_package")
        False
    """
    try:
        if importlib.util.find_spec(import_name) is None:
            return False
    except (ImportError, ValueError):
        # find_spec on "a.b" imports "a"; a missing parent raises instead of returning None.
        return False
    dists, _ = EXTRAS.get(import_name, ((import_name.split(".")[0],), None))
    for dist in dists:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def require(import_name: str, feature: str) -> None:
    """Raise ``ModuleNotFoundError`` naming ``feature`` and the install command if missing.

    Example:
        >>> require("torch", "anything")
        >>> try:
        ...     require("no_such_pkg", "my_function()")
        ... except ModuleNotFoundError as e:
        ...     print(e)
        my_function() needs no_such_pkg: pip install no_such_pkg
    """
    if is_available(import_name):
        return
    dists, extra = EXTRAS.get(import_name, ((import_name.split(".")[0],), None))
    fix = f"pip install 'trainperf[{extra}]'" if extra else f"pip install {dists[0]}"
    raise ModuleNotFoundError(f"{feature} needs {import_name}: {fix}", name=import_name)
