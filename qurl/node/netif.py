"""The network interface a node reaches another address through (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).

gloo and NCCL pick the address they advertise to their peers from the interface named in
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; unset, gloo takes the address the machine's hostname
resolves to. On many nodes (and in a network namespace) that is a loopback address, and a group
spanning two nodes then fails at `init_process_group` ("connectFullMesh failed ... remote=
[127.0.0.1]"). The right interface is the one the kernel routes node 0's address (deploy.host)
through: a UDP socket "connected" to it (no packet is sent) gets that interface's address as its
source, and the interface holding that address is the answer.

    python -m qurl.node.netif 10.0.0.1     # prints e.g. eth0 (used by `qurl launch`'s printed commands)

Linux only (SIOCGIFADDR); a host nothing routes to is a one-line error, exit 2.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import sys

_SIOCGIFADDR = 0x8915  # linux/sockios.h: the primary IPv4 address of an interface
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def source_address(host: str) -> str:
    """The local IPv4 address the kernel sends packets to `host` from."""
    try:
        addr = socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"{host!r} does not resolve: {e}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))  # UDP: only routes, sends nothing
        except OSError as e:
            raise ValueError(f"no route to {host} ({addr}): {e}") from None
        return s.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """{interface name: its primary IPv4 address} of the interfaces that have one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address (down, or IPv6 only)
                continue
    return out


def interface_to(host: str) -> str:
    """The name of the interface this machine reaches `host` through, e.g. 'eth0' ('lo' for a
    loopback host). ValueError (one line) when nothing routes there."""
    src = source_address(host)
    for name, addr in interface_addresses().items():
        if addr == src:
            return name
    raise ValueError(f"no interface holds {src}, the address this machine reaches {host} from")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m qurl.node.netif HOST", file=sys.stderr)
        return 2
    try:
        print(interface_to(args[0]))
    except ValueError as e:
        print(f"qurl.node.netif: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
