"""The channel between `hepti serve`'s front end and the workers' rank 0: framed messages on TCP.

A frame is a 4-byte big-endian length, a JSON header of that length, then `header["nbytes"]`
bytes of raw array data (token ids int64 one way, embeddings float32 the other), so arrays
cross without base64 or pickling: nothing read from the socket is ever unpickled. The front end
listens; rank 0 connects, and its first frame (`hello`) carries the shared secret the front end
gave it in its environment (HEPTI_SERVE_TOKEN), so no other process on the network can attach
itself as the workers.

The figures both sides use live here too (the link probes' sizes, the beat's period), so the
front end never imports the workers' module, which loads the kernels and the job.
"""
from __future__ import annotations

import json
import socket
import struct

import numpy as np

# (bytes, round trips). The bandwidth comes from the two largest: a shaped link (a switch port)
# passes a burst at line rate, so small messages alone read a 940 Mbit/s link as 1.3-2.4 Gbit/s.
# About 0.25 s per link at 100 Mbit/s.
PROBE_SIZES = ((1024, 5), (262144, 2), (1048576, 2))
# A check that a slow link came back (hepti.serve.replan): ~50 ms at 100 Mbit/s. Its
# bandwidth reads high on a shaped link (a burst passes at line rate), so a link that looks
# restored is probed again with PROBE_SIZES before the plan uses the figure.
CHECK_SIZES = ((1024, 3), (262144, 1))
# How often each rank beats on its watch line (`_Heartbeat`); the front end calls a rank late
# after hepti.serve.supervisor.LATE_AFTER_S without one. A beat is ~80 bytes.
BEAT_EVERY_S = 0.5

CONTROL_ENV = "HEPTI_SERVE_CONTROL"  # host:port of the front end's channel, for rank 0
TOKEN_ENV = "HEPTI_SERVE_TOKEN"  # the secret rank 0 must present in its hello
MAX_HEADER = 1 << 20  # a header is a small JSON object; anything larger is not ours
_LEN = struct.Struct(">I")


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or it broke) before a whole frame arrived."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelClosed(f"channel closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send(sock: socket.socket, header: dict, payload: np.ndarray | None = None) -> None:
    """One frame: the header, then the array's bytes (C order) if there is one."""
    data = b"" if payload is None else np.ascontiguousarray(payload).tobytes()
    head = json.dumps({**header, "nbytes": len(data)}).encode()
    sock.sendall(_LEN.pack(len(head)) + head + data)


def recv(sock: socket.socket) -> tuple[dict, bytes]:
    """One frame: (header, payload bytes)."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ChannelClosed(f"a frame header of {n} bytes: not a hepti serve peer")
    header = json.loads(_recv_exact(sock, n))
    nbytes = int(header.get("nbytes", 0))
    return header, _recv_exact(sock, nbytes) if nbytes else b""


def split_frames(buf: bytes, max_header: int = MAX_HEADER) -> tuple[list[dict], bytes]:
    """The whole frames at the head of `buf` (a stream's bytes read so far) -> (their headers,
    the bytes after them: the start of a frame still coming). Payloads are skipped (a watch
    line's beats have none). ValueError when a header or payload is over max_header bytes, or
    a header is not JSON: not a hepti serve peer."""
    heads, at = [], 0
    while len(buf) - at >= _LEN.size:
        (n,) = _LEN.unpack_from(buf, at)
        if n > max_header:
            raise ValueError(f"a frame header of {n} bytes: not a hepti serve peer")
        start = at + _LEN.size
        if len(buf) - start < n:
            break
        header = json.loads(bytes(buf[start:start + n]))
        if not isinstance(header, dict):
            raise ValueError(f"a frame header that is not a JSON object: {header!r:.80}")
        nbytes = int(header.get("nbytes", 0))
        if not 0 <= nbytes <= max_header:
            raise ValueError(f"a frame payload of {nbytes} bytes where none was expected")
        if len(buf) - start - n < nbytes:
            break
        heads.append(header)
        at = start + n + nbytes
    return heads, bytes(buf[at:])


def pack_ids(inputs: list[np.ndarray]) -> tuple[list[int], np.ndarray]:
    """Token id lists as (lengths, one concatenated int64 array)."""
    lengths = [len(x) for x in inputs]
    flat = np.concatenate([np.asarray(x, np.int64) for x in inputs]) if inputs else np.zeros(0, np.int64)
    return lengths, flat


def unpack_ids(lengths: list[int], data: bytes) -> list[np.ndarray]:
    flat = np.frombuffer(data, np.int64)
    if flat.size != sum(lengths):
        raise ValueError(f"{flat.size} token ids for lengths summing to {sum(lengths)}")
    out, at = [], 0
    for n in lengths:
        out.append(flat[at:at + n])
        at += n
    return out


def connect(address: str, timeout: float = 30.0) -> socket.socket:
    """Rank 0's side: connect to host:port."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
