"""The launcher's rendezvous store: one ``TCPStore`` on a port the OS picks.

The socket is bound first (port 0: no probe-then-bind race; ``MASTER_PORT`` if set) and the
store that serves it starts only after the first worker is forked.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import Any

from trainperf._utils import launch_env
from trainperf.errors import LaunchError

__all__ = ["LOCALHOST", "StoreHost", "listen"]

LOCALHOST = "127.0.0.1"


def listen() -> socket.socket:
    """Bind the rendezvous port now (port 0 lets the OS pick a free one: no probe-then-bind
    race); the store that serves it starts only after the workers are forked."""
    explicit = launch_env.read_port()
    port = 0 if explicit is None else explicit
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As TCPStore does: a port left in TIME_WAIT by the previous run is reusable, while one
    # with a live listener still fails to bind (Linux), which is the error users must see.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOCALHOST, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        if explicit is not None:
            raise LaunchError(
                f"cannot listen on {LOCALHOST}:{port} (MASTER_PORT={explicit}): the port is "
                f"taken or not allowed ({e}); choose another MASTER_PORT, or unset it and "
                "launch() picks a free port"
            ) from e
        raise LaunchError(f"cannot start the rendezvous store on {LOCALHOST}: {e}") from e
    return sock


class StoreHost:
    """The launcher's ``TCPStore``, started on the listening socket after the first fork.

    The store serves clients from a background thread; forking while that thread holds a
    lock can leave a child deadlocked before it ever reaches the rendezvous (seen with four
    forked ranks). Workers that connect earlier wait in the socket's backlog.
    """

    def __init__(self, sock: socket.socket, timeout: timedelta) -> None:
        self.sock = sock
        self.timeout = timeout
        self.store: Any = None

    def start(self) -> None:
        if self.store is not None:
            return
        import torch.distributed as dist

        fd = os.dup(self.sock.fileno())  # the store owns (and closes) its own copy
        try:
            self.store = dist.TCPStore(  # type: ignore[attr-defined]
                LOCALHOST,
                self.sock.getsockname()[1],
                None,
                True,
                self.timeout,
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        except RuntimeError as e:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise LaunchError(f"cannot start the rendezvous store on {LOCALHOST}: {e}") from e
        finally:
            self.sock.close()

    def close(self) -> None:
        self.sock.close()
        self.store = None

    def __enter__(self) -> StoreHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
