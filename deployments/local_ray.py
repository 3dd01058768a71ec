"""A Ray this process starts for itself (no cluster address given): loopback only, with token
authentication, and enough CPUs for a local run's ranks."""

import logging
import os
import sys


def local_cpus(tp: int) -> int:
    # a local CPU run may place more ranks than cores: ranks take one logical CPU each
    return max(os.cpu_count() or 1, tp + 1)


def local_ray_env() -> None:
    """A Ray started here listens on loopback only (Ray binds every interface unless told that
    this host runs no cluster), with Ray's token authentication. Call before importing ray."""
    if "ray" in sys.modules:  # too late: Ray read these at import, and half a change breaks auth
        logging.getLogger(__name__).warning("ray was imported first: local Ray keeps its defaults")
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
