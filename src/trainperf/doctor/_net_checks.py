"""The network checks of ``trainperf doctor --dist``: pure functions of their inputs.

``nccl_env`` reads the ``NCCL_*`` variables that switch a transport off or name one that is
not there, ``ifname`` matches ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` against this
host's interfaces, and ``hostname`` checks that the names the rendezvous and gloo resolve
lead to an address here. Import everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainperf.doctor._checks import Check, CheckStatus

__all__ = [
    "IfnameFilter",
    "check_hostname",
    "check_nccl_env",
    "check_socket_ifname",
    "nccl_default_interfaces",
    "parse_nccl_ifname",
]

_SEVERITY = {"ok": 0, "warn": 1, "fail": 2}


# What C's isspace() skips before a number in the "C" locale.
_C_SPACE = " \t\n\v\f\r"
_C_DIGITS = {8: "01234567", 10: "0123456789", 16: "0123456789abcdefABCDEF"}
_INT64 = (-(2**63), 2**63 - 1)


def _c_base(text: str, i: int) -> tuple[int, int]:
    """strtoll's base 0 at ``text[i]``: ``(base, where its digits start)``."""
    if text[i : i + 1] != "0":
        return 10, i
    if text[i + 1 : i + 2] in ("x", "X") and text[i + 2 : i + 3] in tuple(_C_DIGITS[16]):
        return 16, i + 2
    return 8, i  # a lone "0", or "0x" with no hex digit after it, reads as 0


def c_strtoll(text: str) -> tuple[int | None, int]:
    """``text`` read as C's ``strtoll(text, &end, 0)`` reads it: how NCCL reads its integers.

    Leading white space, an optional sign, then hex after ``0x``, octal after a leading
    ``0``, or decimal, up to the first character that is not a digit of that base (``"1abc"``
    is 1, ``"08"`` is 0); no digits at all read as 0.

    Returns:
        ``(value, end)``: the value, None where it overflows 64 bits (strtoll sets ``ERANGE``
        and NCCL keeps its default); the characters read, 0 when there was no number.

    Example:
        >>> c_strtoll("01"), c_strtoll("0x1f"), c_strtoll("1abc"), c_strtoll("08")
        ((1, 2), (31, 4), (1, 1), (0, 1))
        >>> c_strtoll("abc"), c_strtoll("99999999999999999999")
        ((0, 0), (None, 20))
    """
    i = len(text) - len(text.lstrip(_C_SPACE))
    sign = -1 if text[i : i + 1] == "-" else 1
    if text[i : i + 1] in ("+", "-"):
        i += 1
    base, start = _c_base(text, i)
    end = start
    while end < len(text) and text[end] in _C_DIGITS[base]:
        end += 1
    if end == start:
        return 0, 0
    value = sign * int(text[start:end], base)
    return (value if _INT64[0] <= value <= _INT64[1] else None), end


def nccl_flag(raw: str | None) -> bool:
    """Whether NCCL reads ``raw`` as a non-zero integer (unset, empty, out of range: no):
    how ``NCCL_IB_DISABLE`` switches InfiniBand off.

    Example:
        >>> nccl_flag("01"), nccl_flag("1abc"), nccl_flag("00"), nccl_flag("abc")
        (True, True, False, False)
    """
    value = c_strtoll(raw)[0] if raw else None
    return value is not None and value != 0


def nccl_one(raw: str | None, *, c_int: bool = False) -> bool:
    """Whether NCCL reads ``raw`` as exactly 1: how ``NCCL_P2P_DISABLE`` and
    ``NCCL_SHM_DISABLE`` switch their transport off (``== 1`` in NCCL; 2 leaves it on).

    ``c_int``: the value goes through C's ``strtol`` into an ``int``, as NCCL reads
    ``NCCL_P2P_DISABLE``: kept to its low 32 bits, and an overflow (``LONG_MAX``) is -1.

    Example:
        >>> nccl_one("1"), nccl_one("0x1"), nccl_one("2"), nccl_one("-1"), nccl_one(None)
        (True, True, False, False, False)
        >>> nccl_one(str(2**32 + 1), c_int=True), nccl_one(str(2**32 + 1))
        (True, False)
    """
    value = c_strtoll(raw)[0] if raw else None
    if value is not None and c_int:
        value = (value + 2**31) % 2**32 - 2**31
    return value == 1


def p2p_level_off(raw: str | None) -> bool:
    """Whether ``NCCL_P2P_LEVEL`` rules peer-to-peer out: ``LOC``, or an old-style number
    (NCCL reads one with strtol when the value starts with a digit) that is 0.

    Example:
        >>> p2p_level_off("loc"), p2p_level_off("00"), p2p_level_off("NVL"), p2p_level_off(None)
        (True, True, False, False)
    """
    level = (raw or "").strip().upper()
    if level == "LOC":
        return True
    return level[:1] in tuple(_C_DIGITS[10]) and c_strtoll(level)[0] == 0


class _Findings:
    """What a check found, each with its status; the worst one is the check's verdict."""

    def __init__(self) -> None:
        self.items: list[tuple[CheckStatus, str]] = []

    def warn(self, text: str) -> None:
        self.items.append(("warn", text))

    def fail(self, text: str) -> None:
        self.items.append(("fail", text))

    def check(self, name: str, value: str, fix_suffix: str = "") -> Check:
        if not self.items:
            return Check(name, "ok", value)
        worst = max((status for status, _ in self.items), key=_SEVERITY.__getitem__)
        return Check(name, worst, value, "; ".join(t for _, t in self.items) + fix_suffix)


def _flag(env: Mapping[str, str], name: str, found: _Findings, *, one: bool = False) -> bool:
    """Whether NCCL reads ``name`` as switching its transport off: a non-zero integer, or
    exactly 1 where ``one`` (``NCCL_P2P_DISABLE``, ``NCCL_SHM_DISABLE``). A value it reads
    otherwise than written (no number, trailing characters, octal, out of range, another
    number where only 1 counts) is a finding of its own."""
    raw = env.get(name)
    if not raw:
        return False
    value, end = c_strtoll(raw)
    if value is None:
        found.warn(
            f"{name}={raw!r} is out of range (64 bits): NCCL ignores it and keeps its default "
            "(use 0 or 1)"
        )
    elif end == 0:
        found.warn(f"{name}={raw!r} is not a number: NCCL reads it as 0 (use 0 or 1)")
    elif raw[end:].strip(_C_SPACE):
        found.warn(
            f"{name}={raw!r}: NCCL reads it as {value} (C's strtoll: a leading 0 means octal, "
            "and it stops at the first other character); use 0 or 1"
        )
    if not one:
        return nccl_flag(raw)
    off = nccl_one(raw, c_int=name == "NCCL_P2P_DISABLE")
    if value not in (None, 0, 1) and not off:
        found.warn(f"{name}={raw!r}: NCCL switches the transport off only at 1 (use 0 or 1)")
    return off


def _p2p_off(env: Mapping[str, str], found: _Findings) -> bool:
    """Findings on the variables that turn peer-to-peer off; whether one of them does."""
    disabled = _flag(env, "NCCL_P2P_DISABLE", found, one=True)
    if disabled:
        found.warn(
            "NCCL_P2P_DISABLE=1: GPUs exchange data through host memory instead of "
            "NVLink/PCIe peer-to-peer, at a fraction of the bandwidth; keep it only "
            "where the p2p check shows P2P broken"
        )
    level_off = p2p_level_off(env.get("NCCL_P2P_LEVEL"))
    if level_off:
        found.warn(
            f"NCCL_P2P_LEVEL={env['NCCL_P2P_LEVEL'].strip().upper()} never uses peer-to-peer"
        )
    return disabled or level_off


def _network(env: Mapping[str, str], ib_devices: Sequence[str], found: _Findings) -> None:
    ib = ", ".join(ib_devices)
    if _flag(env, "NCCL_IB_DISABLE", found) and ib_devices:
        found.warn(
            f"NCCL_IB_DISABLE=1 although {ib} is here: traffic between nodes goes "
            "through TCP sockets"
        )
    net = (env.get("NCCL_NET") or "").strip().lower()
    if net == "ib" and not ib_devices:
        found.fail(
            "NCCL_NET=IB but this host has no InfiniBand/RoCE device "
            "(/sys/class/infiniband is empty): NCCL fails at start-up"
        )
    elif net == "socket" and ib_devices:
        found.warn(f"NCCL_NET=Socket ignores {ib}: traffic between nodes goes through TCP")


def check_nccl_env(env: Mapping[str, str], ib_devices: Sequence[str] = ()) -> Check:
    """``NCCL_*`` variables that switch transports off, or name a network that is not here.

    Args:
        env: the environment.
        ib_devices: InfiniBand/RoCE devices on this host (``/sys/class/infiniband``).

    Example:
        >>> check_nccl_env({"NCCL_P2P_DISABLE": "1"}).verdict
        'warn'
        >>> check_nccl_env({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}).verdict
        'fail'
        >>> check_nccl_env({"NCCL_NET": "IB"}, ib_devices=[]).verdict
        'fail'
        >>> check_nccl_env({}).verdict
        'ok'
    """
    found = _Findings()
    p2p_off = _p2p_off(env, found)
    if _flag(env, "NCCL_SHM_DISABLE", found, one=True):
        found.warn(
            "NCCL_SHM_DISABLE=1: without peer-to-peer, ranks on this host fall back to TCP sockets"
        )
        if p2p_off:
            found.fail(
                "peer-to-peer and shared memory are both off: every transfer between "
                "GPUs of this host goes through TCP sockets, tens of times slower"
            )
    _network(env, ib_devices, found)
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        if env.get(name):
            found.warn(
                f"{name}={env[name]!r} is a debugging setting (NCCL's docs: do not "
                "keep it in scripts)"
            )
    shown = sorted(k for k in env if k.startswith("NCCL_"))
    value = "NCCL variables: " + (", ".join(f"{k}={env[k]}" for k in shown) or "none set")
    return found.check("nccl_env", value, "; unset the variable unless it is needed")


# --------------------------------------------------------------------------- interfaces


@dataclass(frozen=True)
class IfnameFilter:
    """``NCCL_SOCKET_IFNAME`` parsed as NCCL parses it.

    A comma-separated list of prefixes; a leading ``^`` excludes instead of selecting, and
    a ``=`` (after the ``^`` if any) makes every entry an exact name (NCCL's env docs).

    Attributes:
        exclude: the list names interfaces not to use.
        exact: entries are whole names, not prefixes.
        entries: the names or prefixes.
    """

    exclude: bool
    exact: bool
    entries: tuple[str, ...]

    def matches(self, interface: str) -> bool:
        """Whether ``interface`` is named by an entry (before the exclusion is applied).

        Example:
            >>> parse_nccl_ifname("eth").matches("eth0"), parse_nccl_ifname("=eth").matches("eth0")
            (True, False)
        """
        if self.exact:
            return interface in self.entries
        return any(interface.startswith(entry) for entry in self.entries)


def parse_nccl_ifname(value: str) -> IfnameFilter:
    """Parse ``NCCL_SOCKET_IFNAME``: ``eth``, ``=eth0,eth1``, ``^docker``, ``^=docker0``.

    Example:
        >>> parse_nccl_ifname("^=docker0,lo")
        IfnameFilter(exclude=True, exact=True, entries=('docker0', 'lo'))
    """
    text = value.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    text = text.removeprefix("=")
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    return IfnameFilter(exclude, exact, entries)


def nccl_default_interfaces(interfaces: Mapping[str, Sequence[str]]) -> list[str]:
    """The interfaces NCCL picks with no ``NCCL_SOCKET_IFNAME``: InfiniBand (``ib*``) first,
    then any but ``docker*`` and ``lo``, then ``docker*``, then ``lo`` (only those with an
    address).

    Example:
        >>> nccl_default_interfaces({"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"], "ifb0": []})
        ['eth0']
    """
    usable = [name for name, addresses in interfaces.items() if addresses]
    for pick in (
        lambda n: n.startswith("ib"),
        lambda n: not n.startswith(("docker", "lo")),
        lambda n: n.startswith("docker"),
        lambda n: n.startswith("lo"),
    ):
        found = [n for n in usable if pick(n)]
        if found:
            return found
    return []


def _nccl_ifname(value: str, interfaces: Mapping[str, Sequence[str]]) -> tuple[CheckStatus, str]:
    parsed = parse_nccl_ifname(value)
    usable = [n for n, addresses in interfaces.items() if addresses]
    if parsed.exclude:
        left = [n for n in usable if not parsed.matches(n)]
        if not left:
            return "fail", f"NCCL_SOCKET_IFNAME={value!r} excludes every interface with an address"
        return "ok", f"NCCL_SOCKET_IFNAME={value!r} leaves {', '.join(left)}"
    chosen = [n for n in usable if parsed.matches(n)]
    kind = "named" if parsed.exact else "matching"
    unmatched = [
        e
        for e in parsed.entries
        if not any((n == e if parsed.exact else n.startswith(e)) for n in usable)
    ]
    if not chosen:
        return "fail", (
            f"NCCL_SOCKET_IFNAME={value!r}: no interface {kind} {', '.join(map(repr, unmatched))} "
            "has an address here, so NCCL finds no socket interface and fails at start-up"
        )
    if unmatched:
        return "warn", (
            f"NCCL_SOCKET_IFNAME={value!r}: {', '.join(map(repr, unmatched))} matches no "
            f"interface here (a typo?); NCCL uses {', '.join(chosen)}"
        )
    return "ok", f"NCCL_SOCKET_IFNAME={value!r} selects {', '.join(chosen)}"


def _gloo_ifname(value: str, interfaces: Mapping[str, Sequence[str]]) -> tuple[CheckStatus, str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    missing = [n for n in names if not interfaces.get(n)]
    if missing:
        absent = [n for n in missing if n not in interfaces]
        why = "does not exist" if absent == missing else "has no address (or does not exist)"
        return "fail", (
            f"GLOO_SOCKET_IFNAME={value!r}: {', '.join(map(repr, missing))} {why} here (gloo "
            "takes exact names, no prefixes), so gloo fails with 'Unable to find address for'"
        )
    return "ok", f"GLOO_SOCKET_IFNAME={value!r}"


def check_socket_ifname(
    nccl_ifname: str | None, gloo_ifname: str | None, interfaces: Mapping[str, Sequence[str]]
) -> Check:
    """``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` against this host's interfaces.

    Args:
        nccl_ifname: ``NCCL_SOCKET_IFNAME``, None when unset (NCCL then picks by itself, as
            it does for a value of 0 or 1 characters, which it ignores).
        gloo_ifname: ``GLOO_SOCKET_IFNAME``, None when unset (gloo resolves the hostname).
        interfaces: every interface (``socket.if_nameindex()``) and its IP addresses; NCCL
            and gloo use only interfaces that have one.

    Example:
        >>> here = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}
        >>> check = check_socket_ifname("bogus0", None, here)
        >>> check.verdict, "'bogus0'" in check.value
        ('fail', True)
        >>> check_socket_ifname("^docker", "eth0", here).verdict
        'ok'
    """
    results: list[tuple[CheckStatus, str]] = []
    # NCCL reads the variable only when it is longer than one character (strlen > 1):
    # "" or "e" is as good as unset.
    if nccl_ifname is None or len(nccl_ifname) <= 1:
        default = nccl_default_interfaces(interfaces)
        picks = ", ".join(default) or "none"
        how = (
            " unset"
            if nccl_ifname is None
            else f"={nccl_ifname!r}, which NCCL ignores (it reads 2+ characters)"
        )
        results.append(("ok", f"NCCL_SOCKET_IFNAME{how} (NCCL picks {picks})"))
    else:
        results.append(_nccl_ifname(nccl_ifname, interfaces))
    if gloo_ifname is not None:
        results.append(_gloo_ifname(gloo_ifname, interfaces))
    else:
        results.append(("ok", "GLOO_SOCKET_IFNAME unset (gloo uses the hostname's address)"))
    listed = ", ".join(f"{n} {'/'.join(a) or '(no address)'}" for n, a in interfaces.items())
    value = "; ".join(text for _, text in results) + f"; interfaces: {listed or 'none'}"
    worst = max((status for status, _ in results), key=_SEVERITY.__getitem__)
    if worst == "ok":
        return Check("ifname", "ok", value)
    usable = ", ".join(n for n, a in interfaces.items() if a)
    fix = (
        f"name an interface that exists here ({usable}): `ip -br addr` lists them; "
        "NCCL_SOCKET_IFNAME takes prefixes (eth, ^docker, =eth0), GLOO_SOCKET_IFNAME exact names"
    )
    return Check("ifname", worst, value, fix)


# --------------------------------------------------------------------------- names


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_hostname(
    hostname: str,
    resolved: Sequence[str] | None,
    interfaces: Mapping[str, Sequence[str]],
    *,
    master_addr: str | None = None,
    master_resolved: Sequence[str] | None = None,
) -> Check:
    """The hostname (what gloo binds to by default) and ``MASTER_ADDR`` resolve to addresses.

    Without ``GLOO_SOCKET_IFNAME``, gloo resolves the hostname and binds to that address; if
    it cannot, it falls back to the loopback address, which works on one host only.

    Args:
        hostname: ``socket.gethostname()``.
        resolved: the hostname's addresses (``getaddrinfo``); None when it does not resolve.
        interfaces: this host's interfaces and their addresses.
        master_addr: ``MASTER_ADDR``, None when unset.
        master_resolved: its addresses; None when it does not resolve.

    Example:
        >>> here = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}
        >>> check_hostname("node1", ["10.0.0.2"], here).verdict
        'ok'
        >>> check_hostname("node1", None, here).verdict
        'warn'
        >>> check_hostname("node1", ["10.0.0.2"], here, master_addr="nowhere").verdict
        'fail'
    """
    owner = {a: n for n, addresses in interfaces.items() for a in addresses}
    # Linux routes all of 127.0.0.0/8 to the loopback interface, which lists only 127.0.0.1:
    # Debian's and Ubuntu's /etc/hosts give the hostname 127.0.1.1, and gloo binds to it.
    lo = next((n for a, n in owner.items() if _is_loopback(a)), "lo")
    owner.update({a: lo for a in resolved or () if a not in owner and _is_loopback(a)})
    found = _Findings()
    if resolved is None:
        value = f"{hostname!r} does not resolve"
        found.warn(
            "gloo falls back to the loopback address: fine on one host, but other "
            "nodes cannot reach it; add the hostname to /etc/hosts or set "
            "GLOO_SOCKET_IFNAME"
        )
    else:
        places = [f"{a} ({owner.get(a, 'on no interface here')})" for a in resolved]
        value = f"{hostname!r} resolves to {', '.join(places)}"
        if not any(a in owner for a in resolved):
            found.warn(
                f"{hostname!r} resolves to no address of this host, so gloo cannot "
                "bind to it and falls back to loopback: fix /etc/hosts or set "
                "GLOO_SOCKET_IFNAME"
            )
        elif all(_is_loopback(a) for a in resolved):
            value += "; loopback only: fine on one host, set GLOO_SOCKET_IFNAME across nodes"
    if master_addr is not None and master_resolved is None:
        value += f"; MASTER_ADDR={master_addr!r} does not resolve"
        found.fail(
            f"MASTER_ADDR={master_addr!r} does not resolve: the rendezvous cannot "
            "connect; use an address or a name in DNS or /etc/hosts"
        )
    elif master_addr is not None and master_resolved is not None:
        value += f"; MASTER_ADDR={master_addr!r} -> {', '.join(master_resolved)}"
    return found.check("hostname", value)
