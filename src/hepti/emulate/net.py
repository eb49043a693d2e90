"""The emulated network: one namespace per device on a private bridge, links shaped by `tc htb`.

Topology (a star, like devices on one Ethernet switch):

    root namespace:  bridge hpt<pid>br (no address) ── veth hpt<pid>v<i> ──┐
    namespace hepti-<pid>-<i>:                        emu0 10.213.0.(10+i) ┘   one per device
    namespace hepti-<pid>-head:                       emu0 10.213.0.1          mpiexec (unshaped)

Each device's link is shaped in both directions on the egress of both veth ends: in the
namespace (the device's upload) and on the bridge side (its download). `netem` is not in this
kernel, so no delay is added: a link has the rate given and the latency of a veth (tens of
microseconds).

Why HTB with a small bucket, not TBF (measured here, MTU 1500, TCP with timestamps):
- A real link has no credit: after an idle spell the next message still takes its size over the
  rate. A token bucket refills while the device computes and lets the next message's first
  `burst` bytes through at veth speed.
- TBF must hold a whole packet in its bucket, and TCP hands the qdisc GSO packets of up to
  64 KiB. A smaller TBF bucket splits each into 1514-byte frames and re-arms its timer for every
  frame: ~35,000 timer interrupts a second at 240 Mbit/s, 20-40 us each, charged to whichever
  task runs on that CPU, so a capped rank next to a transfer lost most of its quota. So TBF's
  bucket was max(1 ms, 96 KiB), and on emu-mixed4 the 100 Mbit/s device's Reduce_scatters of
  ~169 KB took 6.4-10.2 ms against 13.5 at the rate; `proportional`, many such collectives
  per layer, ran 24-30% faster than predicted (MiniLM at 128 tokens).
- HTB sends a packet whenever its class has tokens left and then goes into debt for the rest,
  so a GSO packet passes whole (one timer per packet, no splitting) with a bucket of 1 ms.
  What a message can gain over a real link is that bucket plus its last packet's time on the
  link. The same run: `proportional` 411 ms against 374 predicted, `even` 426 against 360
  (under TBF 257 and 304), `auto` 57 against 59 (58); the profile fits 930, 930, 240 and
  104 Mbit/s for links of 940, 940, 240 and 100.
- tc counts Ethernet frames (1514 bytes) while TCP delivers 1448 payload bytes per frame, so the
  wire rate is set to link_mbit * 1514/1448 and a TCP stream (or an MPI transfer) measures
  link_mbit. Without the factor, 100 Mbit/s measured 95.5.
- Packets are at most 1 ms of the cluster's slowest link (`packet_bytes`, each device's
  `gso_max_size`; 12,500 bytes on emu-mixed4). What HTB lets through at once after an idle
  spell is one packet: with 64 KiB ones a collective's message of up to 64 KiB to or from the
  100 Mbit/s device passed at veth speed, up to 5 ms early, and on emu-mixed4 MiniLM
  `proportional` (24 collectives per forward, the slow device's blocks of 20-60 KB) ran -22% of
  its prediction over 3 rounds; capped, -9.5% (1 round). Fast links then carry more packets,
  each a timer event when the shaper throttles (1 ms of the fastest link is 9 packets).
- ACKs go first. With one FIFO per direction, a device's ACKs waited behind its own bulk
  upload (20 ms of it), its senders stalled for them, and its download idled: `even` on
  emu-mixed4 (BERT-base at 256 tokens, 786 KB collectives) ran 8.0 s against 3.7 predicted. A
  real host's default qdisc (fq_codel) keeps each flow's packets apart, so its ACKs do not wait
  behind bulk. Here packets under 128 bytes (pure ACKs, with timestamps and SACK blocks) take a
  class that is served first: 4.2 s.
- The bulk FIFO holds 20 ms of traffic but at least 1 MiB: 256 KiB dropped about 1,000 packets
  of the 100 Mbit/s device's upload per run of that case (three peers' streams at once) and
  TCP's recovery cost time; with 1 MiB, no drop and 3.4 s (-8% of the prediction).
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
BURST_S = 0.001  # the bucket: 1 ms of traffic ...
MIN_BURST = 2 * 1514  # ... and at least two frames
GSO_MAX = 64 << 10  # the largest packet TCP hands the qdisc
QUEUE_S = 0.020  # the bulk FIFO: 20 ms of traffic ...
MIN_QUEUE = 1 << 20  # ... and at least one collective's incast into a slow link
SMALL_QUEUE = 64 << 10  # the FIFO of small packets (ACKs)
SMALL_SHARE = 0.02  # the small packets' guaranteed share of the rate (they may borrow it all)
PACKET_S = 0.001  # TCP's largest packet: 1 ms of the cluster's slowest link ...
MIN_PACKET = 3 * 1448  # ... but at least three frames' payload
CLONE_NEWNET = 0x40000000


def htb_args(link_mbit: float) -> dict[str, str]:
    """The shaper's settings for a TCP payload rate of link_mbit Mbit/s, in tc's units: the
    link's `rate`, its bucket (`burst`), the bulk FIFO's `limit`, and the guaranteed rates of
    the small-packet and bulk classes (`small`, `bulk`), which share the link's rate."""
    rate_bit = link_mbit * 1e6 * WIRE_PER_PAYLOAD
    burst = max(int(rate_bit / 8 * BURST_S), MIN_BURST)
    limit = max(int(rate_bit / 8 * QUEUE_S), MIN_QUEUE)
    kbit = rate_bit / 1000
    return {"rate": f"{round(kbit)}kbit", "burst": str(burst), "limit": str(limit),
            "small": f"{max(8, round(kbit * SMALL_SHARE))}kbit",
            "bulk": f"{round(kbit * (1 - SMALL_SHARE))}kbit"}


def _shaper(tc: list[str], dev: str, link_mbit: float, change: bool = False) -> list[Action]:
    """HTB: class 1:1 is the link; under it 1:10 takes packets of under 128 bytes (ACKs) before
    1:20, the rest, each with its FIFO. `replace` throughout (the filter has a fixed handle), so
    the same actions set up a link and change its rate later; a `change` leaves out the root
    qdisc, which htb cannot change in place ("Change operation not supported by specified
    qdisc", a warning at every scheduled rate change) and which a rate does not touch."""
    a = htb_args(link_mbit)
    # quantum only weighs borrowing between classes of one priority; set, it keeps HTB from
    # warning about r2q
    common = ["ceil", a["rate"], "burst", a["burst"], "cburst", a["burst"], "quantum", str(GSO_MAX)]
    root = [] if change else [cmd(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
                                  "default", "20")]
    return root + [
            cmd(*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                "rate", a["rate"], *common),
            cmd(*tc, "class", "replace", "dev", dev, "parent", "1:1", "classid", "1:10", "htb",
                "rate", a["small"], "prio", "0", *common),
            cmd(*tc, "class", "replace", "dev", dev, "parent", "1:1", "classid", "1:20", "htb",
                "rate", a["bulk"], "prio", "1", *common),
            cmd(*tc, "qdisc", "replace", "dev", dev, "parent", "1:10", "handle", "10:", "bfifo",
                "limit", str(SMALL_QUEUE)),
            cmd(*tc, "qdisc", "replace", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo",
                "limit", a["limit"]),
            # IPv4 total length < 128 (the u16 at byte 2): pure ACKs, with timestamps and SACK
            cmd(*tc, "filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "handle", "800::800", "u32", "match", "u16", "0", "0xff80", "at", "2", "flowid", "1:10")]


def shape_actions(names: RunNames, i: int, link_mbit: float, change: bool = False) -> list[Action]:
    """Shape device i's link both ways (`change`: a running link's new rate)."""
    return (_shaper(["tc", "-n", names.netns(i)], INNER_IFACE, link_mbit, change)
            + _shaper(["tc"], names.veth(i), link_mbit, change))


def loss_actions(names: RunNames, i: int, loss: float) -> list[Action]:
    """Device i's link silent (loss 100: every packet dropped, both ways) or back (0), as a
    board's Wi-Fi that goes quiet and returns: the bridge's end of its veth goes down, or up.

    The bridge's end, not the device's: with its own end down the device would lose its route
    and every send would fail at once (ENETUNREACH), a death rather than silence. With the
    bridge's end down the device's end only loses its carrier: its packets are dropped, the
    bridge drops what comes for it, no connection is reset and no call fails (measured here: a
    TCP stream across it went silent for 12 s without an error on either side, and a connect
    to the device timed out). The shaper on both ends stays configured, so 0 restores the link
    as it was. (`netem`, which could drop a share of packets, is not in this kernel.)"""
    return [cmd("ip", "link", "set", names.veth(i), "down" if loss >= 100 else "up")]


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


def packet_bytes(spec: ClusterSpec) -> int:
    """The largest packet TCP may hand a device's qdisc (its `gso_max_size`): what HTB lets
    through at once after an idle spell, so at most 1 ms of the slowest link the spec ever has.
    Set on every device, since a slow device's download is the others' uploads."""
    links = [d.link_mbit for d in spec.devices if d.link_mbit is not None]
    links += [e.link_mbit for e in spec.schedule if e.link_mbit is not None]
    if not links:
        return GSO_MAX
    return int(min(GSO_MAX, max(MIN_PACKET, min(links) * 1e6 / 8 * PACKET_S)))


def setup_actions(names: RunNames, spec: ClusterSpec) -> list[Action]:
    """Bridge, head namespace, one namespace per device, and the shapers."""
    acts: list[Action] = [
        cmd("ip", "link", "add", names.bridge, "type", "bridge"),
        cmd("ip", "link", "set", names.bridge, "addrgenmode", "none"),
        cmd("ip", "link", "set", names.bridge, "up"),
    ]
    acts += _node_actions(names, names.head_netns, names.head_veth, names.head_address)
    packet = packet_bytes(spec)
    for i, dev in enumerate(spec.devices):
        acts += _node_actions(names, names.netns(i), names.veth(i), names.address(i))
        if packet < GSO_MAX:
            acts.append(cmd("ip", "-n", names.netns(i), "link", "set", INNER_IFACE,
                            "gso_max_size", str(packet)))
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
