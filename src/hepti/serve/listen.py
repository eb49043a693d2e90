"""The service's listening socket, opened in the host's network namespace under `hepti emulate`.

`hepti emulate` runs its COMMAND in the emulation's head namespace (its 10.213.0.1 reaches the
devices), where 127.0.0.1 is not the host's. A socket belongs to the namespace it was made in,
whichever the process moves to after, so a thread enters the host's namespace (the launcher's,
which it names in HEPTI_EMULATE_HOST_NETNS), makes and binds the socket there, and ends; the
rest of the front end stays in the head namespace, next to the devices. Outside the emulator
this is a plain bind.
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading

from hepti.emulate.state import HOST_NETNS_ENV
from hepti.errors import InputError

CLONE_NEWNET = 0x40000000


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (in the host's namespace if emulated)."""
    netns = os.environ.get(HOST_NETNS_ENV)
    if not netns:
        return _bind(host, port)
    made: dict = {}

    def in_host_namespace():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(netns, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns})")
            finally:
                os.close(fd)
            made["sock"] = _bind(host, port)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            made["error"] = e

    t = threading.Thread(target=in_host_namespace, name="hepti-listen")
    t.start()
    t.join()
    if "error" in made:
        raise made["error"]
    return made["sock"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, "
                         "or stop what holds it") from None
    s.listen(128)
    return s
