"""Two nodes on one machine: two network namespaces joined by a veth pair, optionally shaped.

    with NodePair() as pair:                 # namespaces q<pid>n0 / q<pid>n1, 10.77.0.1 / .2
        pair.shape("1gbit")                  # tc tbf at 1 Gbit/s on both ends of the link
        subprocess.run([*pair.exec_in(1), sys.executable, ...])   # a process on node 1
        pair.set_link(False); ...; pair.set_link(True)           # cut the link, restore it
    # both namespaces (and with them the veth pair) are gone here, whatever happened

Or move the calling thread into one (`enter(name)`: setns(2); threads it starts afterwards,
gloo's included, follow it) and back (`leave()`). Processes in the two namespaces share the
filesystem, pipes and queues; only their network differs. In a namespace the hostname resolves to
loopback, which is what makes this a faithful two-node test: anything that advertises
"my hostname's address" to a peer breaks here as it would across real nodes.

Links are emulated by tc on the veth pair: `tbf` (rate, with a burst of 2 ms at that rate, at
least 256 KiB so a 64 KiB GSO packet always fits) on both ends; a delay needs `netem`, which some
kernels lack (this VM's: CONFIG_NET_SCH_NETEM is off), and then `shape` raises a one-line error.
Needs root and iproute2; `unavailable()` says why not, for tests to skip on.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from typing import Sequence

CLONE_NEWNET = 0x40000000
NODES = ("10.77.0.1", "10.77.0.2")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip netns`, `tc`) to make two network namespaces"
    if os.geteuid() != 0:
        return "needs root: creating network namespaces (ip netns add) is privileged"
    return None


def rate_bits(rate: str) -> float:
    """'10gbit' -> 1e10 bits/s (kbit, mbit, gbit, bit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected e.g. 10gbit, 1gbit, 100mbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_links(spec: str) -> list[tuple[str, str | None]]:
    """'10gbit,1gbit,100mbit:10ms' -> [(rate, delay or None), ...] (rates checked)."""
    out = []
    for part in spec.split(","):
        rate, _, delay = part.strip().partition(":")
        rate_bits(rate)
        if delay and not re.fullmatch(r"\d+(\.\d+)?(ms|us|s)", delay):
            raise ValueError(f"link delay {delay!r}: expected e.g. 10ms")
        out.append((rate.strip().lower(), delay or None))
    return out


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


_HOME: list[int] = []  # fd of the namespace `enter` left, per nesting level


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")


def enter(name: str) -> None:
    """Move the calling thread into network namespace `name` (leave() moves it back)."""
    _HOME.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY))
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def leave() -> None:
    fd = _HOME.pop()
    try:
        _setns(fd)
    finally:
        os.close(fd)


class NodePair:
    """Two namespaces (node 0 and node 1) joined by one veth pair; a context manager that
    removes both on exit. `names`, `links` (node k's end), `addrs` (node k's address)."""

    def __init__(self, addrs: Sequence[str] = NODES, tag: str = "") -> None:
        tag = tag or f"q{os.getpid() % 100000}"
        self.names = [f"{tag}n0", f"{tag}n1"]
        self.links = [f"{tag}v0", f"{tag}v1"]
        self.addrs = list(addrs)

    def __enter__(self) -> "NodePair":
        try:
            _ip("netns", "add", self.names[0])
            _ip("netns", "add", self.names[1])
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for ns, link, addr in zip(self.names, self.links, self.addrs):
                _ip("link", "set", link, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in self.names:  # deleting a namespace deletes its end of the veth, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def exec_in(self, k: int) -> list[str]:
        """Command prefix that runs a program on node k."""
        return ["ip", "netns", "exec", self.names[k]]

    def shape(self, rate: str | None, delay: str | None = None) -> None:
        """Limit both directions to `rate` (tc tbf on each end; None: unshaped), with an added
        one-way `delay` per end (tc netem; a one-line error where the kernel lacks it)."""
        for ns, link in zip(self.names, self.links):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", link, "root"],
                           capture_output=True)
            if rate is None and delay is None:
                continue
            if delay is not None:
                cmd = ["netem", "delay", delay] + (["rate", rate] if rate else []) + \
                      ["limit", "100000"]
            else:
                burst = max(int(rate_bits(rate) / 8 * 0.002), 256 << 10)
                cmd = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
            done = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", link, "root", *cmd],
                                  capture_output=True, text=True)
            if done.returncode:
                why = done.stderr.strip().splitlines()[0] if done.stderr.strip() else "failed"
                raise RuntimeError(f"tc qdisc add ... {' '.join(cmd)}: {why}"
                                   + (" (this kernel has no sch_netem: a delay cannot be "
                                      "emulated)" if delay and "unknown" in why.lower() else ""))

    def set_link(self, up: bool) -> None:
        """Cut (False) or restore (True) the link: node 0's end down/up, which takes the
        carrier of node 1's end with it."""
        _ip("-n", self.names[0], "link", "set", self.links[0], "up" if up else "down")
