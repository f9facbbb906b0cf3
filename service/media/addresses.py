"""Which addresses a remote media host may resolve to: public unicast only. An IPv6 address that embeds
an IPv4 one (mapped, 6to4, Teredo, NAT64's well-known prefix) is judged by the IPv4 address as well."""
from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

# (what the address is, test), in the order a refusal names them.
_CATEGORIES = (
    ("an unspecified address", lambda ip: ip.is_unspecified),
    ("a loopback address", lambda ip: ip.is_loopback),
    ("a link-local address", lambda ip: ip.is_link_local),
    ("a multicast address", lambda ip: ip.is_multicast),
    ("a private address", lambda ip: ip.is_private),
    ("a reserved address", lambda ip: ip.is_reserved),
    ("not a globally routable address", lambda ip: not ip.is_global),
)


def _embedded(ip: IPAddress) -> list[IPAddress]:
    """The IPv4 addresses ``ip`` carries, then ``ip`` itself."""
    out: list[IPAddress] = []
    if isinstance(ip, ipaddress.IPv6Address):
        out += [v4 for v4 in (ip.ipv4_mapped, ip.sixtofour, ip.teredo and ip.teredo[1]) if v4 is not None]
        if ip in _NAT64:
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [*out, ip]


def refusal(address: str, *, allow_loopback: bool = False) -> str | None:
    """Why ``address`` (an IP literal, maybe with an IPv6 zone) may not be connected to ("10.0.0.1, which
    is a private address"), or None if it is public. ``allow_loopback`` (tests only) lets loopback addresses through."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    for candidate in _embedded(ip):
        if allow_loopback and candidate.is_loopback:
            continue
        for category, test in _CATEGORIES:
            if test(candidate):
                shown = str(candidate) if candidate == ip else f"{ip} (IPv4 {candidate})"
                return f"{shown}, which is {category}"
    return None
