"""The emulated network: one namespace per device on a private bridge, links shaped by `tc tbf`.

Topology (a star, like devices on one Ethernet switch):

    root namespace:  bridge hpt<pid>br (no address) ── veth hpt<pid>v<i> ──┐
    namespace hepti-<pid>-<i>:                        emu0 10.213.0.(10+i) ┘   one per device
    namespace hepti-<pid>-head:                       emu0 10.213.0.1          mpiexec (unshaped)

Each device's link is shaped in both directions with a token bucket filter on the egress of
both veth ends: in the namespace (the device's upload) and on the bridge side (its download).
`netem` is not in this kernel, so no delay is added: a link has the rate given and the
latency of a veth (tens of microseconds).

Sizing the bucket (measured here, MTU 1500, TCP with timestamps):
- tc counts Ethernet frames (1514 bytes) while TCP delivers 1448 payload bytes per frame, so the
  wire rate is set to link_mbit * 1514/1448 and a TCP stream (or an MPI transfer) measures
  link_mbit. Without the factor, 100 Mbit/s measured 95.5.
- The bucket must hold about 1 ms of traffic at high rates: at 940 Mbit/s a 30 KB bucket
  reached only 834, 80 KB reached 938.
- The bucket must also hold one whole TCP segment: TCP hands the qdisc GSO packets of up to
  64 KiB. With a 16 KiB floor, a 240 Mbit/s link (31 KB bucket) split each into 1514-byte frames
  and re-armed its timer (qdisc_watchdog) for every frame, two tbfs per packet: ~35,000 timer
  interrupts a second while a transfer ran, 20-40 us each. Their CPU time is charged to
  whichever task runs on that CPU, so a capped rank computing next to a transfer lost most of
  its quota (the offload primary at 240 Mbit/s took 19.6 ms for 3 ms of compute; perf counted
  18,200 watchdog expiries of 23,000 timer expiries). A 96 KiB floor passes a GSO packet whole,
  one timer per packet (350 expiries). It is also tc's own rule, burst >= rate / HZ.
  So buckets are max(1 ms of traffic, 96 KiB). A message smaller than the bucket passes at veth
  speed after an idle spell: up to 3.3 ms early at 240 Mbit/s, 7.9 ms at 100. Bulk rates (what
  `hepti profile` fits, from its two largest messages) are unchanged.
- The queue holds 20 ms of traffic; more adds queueing delay to small messages behind a bulk one.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading

from hepti.emulate.actions import Action, cmd
from hepti.emulate.names import INNER_IFACE, PREFIX_LEN, RunNames
from hepti.emulate.spec import ClusterSpec, EmulateError

WIRE_PER_PAYLOAD = 1514 / 1448  # Ethernet frame bytes per TCP payload byte at MTU 1500
BURST_S = 0.001
MIN_BURST = 96 << 10  # see the module docstring: one whole 64 KiB GSO packet
QUEUE_LATENCY_MS = 20
CLONE_NEWNET = 0x40000000


def tbf_args(link_mbit: float) -> list[str]:
    """`tc qdisc ... tbf` parameters giving a TCP payload rate of link_mbit Mbit/s."""
    rate_bit = link_mbit * 1e6 * WIRE_PER_PAYLOAD
    burst = max(int(rate_bit / 8 * BURST_S), MIN_BURST)
    return ["tbf", "rate", f"{round(rate_bit / 1000)}kbit", "burst", str(burst),
            "latency", f"{QUEUE_LATENCY_MS}ms"]


def shape_actions(names: RunNames, i: int, link_mbit: float) -> list[Action]:
    """Shape device i's link both ways (also used to change the rate while running)."""
    tbf = tbf_args(link_mbit)
    return [cmd("tc", "-n", names.netns(i), "qdisc", "replace", "dev", INNER_IFACE, "root", *tbf),
            cmd("tc", "qdisc", "replace", "dev", names.veth(i), "root", *tbf)]


def _node_actions(names: RunNames, netns: str, veth: str, address: str) -> list[Action]:
    return [
        cmd("ip", "netns", "add", netns),
        cmd("ip", "link", "add", veth, "type", "veth", "peer", "name", INNER_IFACE, "netns", netns),
        cmd("ip", "link", "set", veth, "addrgenmode", "none"),  # no IPv6 address outside the namespaces
        cmd("ip", "link", "set", veth, "master", names.bridge),
        cmd("ip", "link", "set", veth, "up"),
        cmd("ip", "-n", netns, "link", "set", "lo", "up"),
        cmd("ip", "-n", netns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", INNER_IFACE),
        cmd("ip", "-n", netns, "link", "set", INNER_IFACE, "up"),
    ]


def setup_actions(names: RunNames, spec: ClusterSpec) -> list[Action]:
    """Bridge, head namespace, one namespace per device, and the shapers."""
    acts: list[Action] = [
        cmd("ip", "link", "add", names.bridge, "type", "bridge"),
        cmd("ip", "link", "set", names.bridge, "addrgenmode", "none"),
        cmd("ip", "link", "set", names.bridge, "up"),
    ]
    acts += _node_actions(names, names.head_netns, names.head_veth, names.head_address)
    for i, dev in enumerate(spec.devices):
        acts += _node_actions(names, names.netns(i), names.veth(i), names.address(i))
        if dev.link_mbit is not None:
            acts += shape_actions(names, i, dev.link_mbit)
    return acts


def teardown_actions(names: RunNames, netns: list[str] | None = None,
                     links: list[str] | None = None) -> list[Action]:
    """Delete veths (each takes its peer and qdiscs with it), the bridge, then the namespaces."""
    netns = names.all_netns() if netns is None else netns
    links = names.all_veths() + [names.bridge] if links is None else links
    veths = [x for x in links if x != names.bridge]
    acts: list[Action] = [cmd("ip", "link", "del", x, gone_ok=True) for x in veths]
    if names.bridge in links:
        acts.append(cmd("ip", "link", "del", names.bridge, gone_ok=True))
    acts += [cmd("ip", "netns", "del", x, gone_ok=True) for x in netns]
    return acts


def list_netns() -> list[str]:
    """Names of the network namespaces `ip netns` knows."""
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the network interfaces of the root namespace."""
    p = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    out = []
    for line in p.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def netns_pids(netns: str) -> list[int]:
    """Processes living in a named network namespace."""
    p = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _setns(libc, netns: str) -> None:
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def probe_mesh(names: RunNames, timeout: float = 2.0) -> None:
    """Check that the head reaches every device and every device reaches every other, over TCP.

    A throwaway thread enters each namespace in turn (setns changes only the calling thread) to
    open listeners and connect; sockets stay in the namespace they were made in. A bridge whose
    traffic a host firewall drops (Docker's iptables FORWARD policy with br_netfilter) fails here
    with a clear message instead of as an MPI hang.
    """
    failure: list[str] = []

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        listeners: list[socket.socket] = []
        opened: list[socket.socket] = []
        try:
            for i in range(names.n_devices):
                _setns(libc, names.netns(i))
                s = socket.socket()
                s.bind((names.address(i), 0))
                s.listen(names.n_devices + 1)
                listeners.append(s)
            sources = [(names.head_netns, None)] + [(names.netns(i), i) for i in range(names.n_devices)]
            for netns, src in sources:
                _setns(libc, netns)
                for j, lst in enumerate(listeners):
                    if j == src:
                        continue
                    c = socket.socket()
                    opened.append(c)
                    c.settimeout(timeout)
                    try:
                        c.connect(lst.getsockname())
                    except OSError as e:
                        failure.append(f"{netns} cannot reach {names.address(j)} ({names.netns(j)}): {e}")
                        return
        except OSError as e:
            failure.append(str(e))
        finally:
            for s in opened + listeners:
                s.close()

    t = threading.Thread(target=work, name="hepti-emulate-probe")
    t.start()
    t.join()
    if failure:
        raise EmulateError(
            f"the emulated network does not work: {failure[0]}. If a firewall filters bridged "
            "traffic (Docker sets the iptables FORWARD policy to DROP and loads br_netfilter), allow "
            "it for this run with `sysctl net.bridge.bridge-nf-call-iptables=0`")
