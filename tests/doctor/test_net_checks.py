"""The network checks (``doctor/_net_checks.py``): NCCL_* variables, interfaces, names."""

from __future__ import annotations

import ctypes
import random
import sys

import pytest

from trainperf.doctor import (
    IfnameFilter,
    check_hostname,
    check_nccl_env,
    check_socket_ifname,
    nccl_default_interfaces,
    parse_nccl_ifname,
)
from trainperf.doctor._net_checks import c_strtoll

HERE: dict[str, list[str]] = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.2"],
    "eth1": ["10.1.0.2"],
    "docker0": ["172.17.0.1"],
    "ifb0": [],  # exists, no address: NCCL and gloo skip it
}

# --------------------------------------------------------------------------- NCCL_SOCKET_IFNAME


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("eth", IfnameFilter(False, False, ("eth",))),
        ("=eth0,eth1", IfnameFilter(False, True, ("eth0", "eth1"))),
        ("^docker,lo", IfnameFilter(True, False, ("docker", "lo"))),
        ("^=docker0", IfnameFilter(True, True, ("docker0",))),
        (" eth0 , ", IfnameFilter(False, False, ("eth0",))),
    ],
)
def test_parse_nccl_ifname_as_nccls_docs_describe(value: str, parsed: IfnameFilter) -> None:
    assert parse_nccl_ifname(value) == parsed


def test_prefixes_and_exact_names_match_differently() -> None:
    assert parse_nccl_ifname("eth").matches("eth10")
    assert not parse_nccl_ifname("=eth1").matches("eth10")
    assert parse_nccl_ifname("=eth1").matches("eth1")


def test_nccls_default_prefers_ib_then_anything_but_docker_and_lo() -> None:
    assert nccl_default_interfaces(HERE) == ["eth0", "eth1"]
    assert nccl_default_interfaces({**HERE, "ib0": ["10.2.0.2"]}) == ["ib0"]
    assert nccl_default_interfaces({"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"]}) == ["docker0"]
    assert nccl_default_interfaces({"lo": ["127.0.0.1"], "ifb0": []}) == ["lo"]


def test_a_bogus_nccl_socket_ifname_is_named_and_fails() -> None:
    check = check_socket_ifname("bogus0", None, HERE)
    assert check.verdict == "fail"
    assert "NCCL_SOCKET_IFNAME='bogus0': no interface matching 'bogus0'" in check.value
    assert "eth0" in check.fix and "ifb0" not in check.fix.split("(")[1].split(")")[0]


@pytest.mark.parametrize("value", ["", "x", "^"])
def test_a_nccl_socket_ifname_under_2_characters_is_ignored_like_nccl_does(value: str) -> None:
    check = check_socket_ifname(value, None, HERE)
    assert check.verdict == "ok"
    assert f"NCCL_SOCKET_IFNAME={value!r}, which NCCL ignores" in check.value
    assert "NCCL picks eth0, eth1" in check.value


def test_an_entry_that_matches_nothing_next_to_one_that_does_warns() -> None:
    check = check_socket_ifname("=eth0,etho1", None, HERE)
    assert check.verdict == "warn" and "'etho1' matches no interface" in check.value
    assert "NCCL uses eth0" in check.value


def test_an_interface_without_an_address_does_not_count() -> None:
    assert check_socket_ifname("ifb", None, HERE).verdict == "fail"


def test_exclusions() -> None:
    ok = check_socket_ifname("^docker,lo", None, HERE)
    assert ok.verdict == "ok" and "leaves eth0, eth1" in ok.value
    everything = check_socket_ifname("^e,d,l", None, HERE)
    assert everything.verdict == "fail" and "excludes every interface" in everything.value


def test_unset_variables_are_fine_and_say_what_will_be_used() -> None:
    check = check_socket_ifname(None, None, HERE)
    assert check.verdict == "ok" and "NCCL picks eth0, eth1" in check.value
    assert "ifb0 (no address)" in check.value


def test_gloo_socket_ifname_takes_exact_names() -> None:
    assert check_socket_ifname(None, "eth0,eth1", HERE).verdict == "ok"
    prefix = check_socket_ifname(None, "eth", HERE)
    assert prefix.verdict == "fail" and "'eth' does not exist" in prefix.value
    bare = check_socket_ifname(None, "ifb0", HERE)
    assert bare.verdict == "fail" and "has no address" in bare.value
    assert "Unable to find address for" in bare.value


# --------------------------------------------------------------------------- names


def test_hostname_on_an_interface_is_ok() -> None:
    check = check_hostname("node1", ["10.0.0.2"], HERE)
    assert check.verdict == "ok" and "10.0.0.2 (eth0)" in check.value


def test_hostname_resolving_to_loopback_only_is_fine_on_one_host() -> None:
    check = check_hostname("node1", ["127.0.1.1"], {"lo": ["127.0.0.1", "127.0.1.1"]})
    assert check.verdict == "ok" and "loopback only" in check.value


def test_hostname_that_does_not_resolve_or_is_elsewhere_warns() -> None:
    missing = check_hostname("node1", None, HERE)
    assert missing.verdict == "warn" and "/etc/hosts" in missing.fix
    elsewhere = check_hostname("node1", ["10.9.9.9"], HERE)
    assert elsewhere.verdict == "warn" and "on no interface here" in elsewhere.value


def test_master_addr_must_resolve() -> None:
    bad = check_hostname("node1", ["10.0.0.2"], HERE, master_addr="node-99", master_resolved=None)
    assert bad.verdict == "fail" and "MASTER_ADDR='node-99' does not resolve" in bad.fix
    good = check_hostname("node1", ["10.0.0.2"], HERE, master_addr="node1",
                          master_resolved=["10.0.0.2"])  # fmt: skip
    assert good.verdict == "ok" and "MASTER_ADDR='node1' -> 10.0.0.2" in good.value


# --------------------------------------------------------------------------- NCCL_* variables


def test_no_nccl_variable_is_ok() -> None:
    check = check_nccl_env({"PATH": "/bin"})
    assert check.verdict == "ok" and check.value == "NCCL variables: none set"


def test_p2p_off_warns_and_p2p_plus_shm_off_fails() -> None:
    p2p = check_nccl_env({"NCCL_P2P_DISABLE": "1"})
    assert p2p.verdict == "warn" and "host memory" in p2p.fix
    level = check_nccl_env({"NCCL_P2P_LEVEL": "loc"})
    assert level.verdict == "warn" and "NCCL_P2P_LEVEL=LOC" in level.fix
    both = check_nccl_env({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
    assert both.verdict == "fail" and "TCP sockets" in both.fix
    assert check_nccl_env({"NCCL_P2P_DISABLE": "0"}).verdict == "ok"


def test_a_flag_without_a_number_reads_as_0_and_says_so() -> None:
    check = check_nccl_env({"NCCL_P2P_DISABLE": "true"})
    assert check.verdict == "warn" and "'true' is not a number: NCCL reads it as 0" in check.fix
    assert "host memory" not in check.fix  # NCCL keeps peer-to-peer on


@pytest.mark.parametrize(
    ("raw", "p2p_off", "note"),
    [
        ("01", True, ""),  # octal 1
        ("0x1", True, ""),
        (" 1", True, ""),
        ("1abc", True, "NCCL reads it as 1"),  # strtoll stops at the first non-digit
        ("1 ", True, ""),  # trailing blanks are not worth a word
        ("00", False, ""),
        ("08", False, "NCCL reads it as 0"),  # a leading 0 is octal: 8 is not a digit
        ("abc", False, "not a number"),
        ("", False, ""),
        ("99999999999999999999", False, "out of range"),  # ERANGE: NCCL keeps its default
    ],
)
def test_nccl_flags_are_read_as_nccls_strtoll_reads_them(
    raw: str, p2p_off: bool, note: str
) -> None:
    check = check_nccl_env({"NCCL_P2P_DISABLE": raw})
    assert ("host memory" in check.fix) is p2p_off
    assert note in check.fix
    if not p2p_off and not note:
        assert check.verdict == "ok"


@pytest.mark.parametrize("name", ["NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"])
@pytest.mark.parametrize("raw", ["2", "-1", "0x10", "7abc"])
def test_p2p_and_shm_are_switched_off_only_at_exactly_1(name: str, raw: str) -> None:
    # NCCL: `if (disable == 1)` for P2P, `ncclParamShmDisable() == 1` for SHM.
    check = check_nccl_env({name: raw, "NCCL_P2P_DISABLE": "1"} if "SHM" in name else {name: raw})
    assert "host memory" not in check.fix if "P2P" in name else check.verdict != "fail"
    assert "off only at 1" in check.fix


def test_ib_is_switched_off_by_any_nonzero_value() -> None:
    # NCCL: `if (ncclParamIbDisable()) return ncclInternalError;`
    check = check_nccl_env({"NCCL_IB_DISABLE": "2"}, ib_devices=["mlx5_0"])
    assert "traffic between nodes goes through TCP sockets" in check.fix


def test_p2p_disable_is_read_into_a_c_int_as_nccl_does() -> None:
    assert "host memory" in check_nccl_env({"NCCL_P2P_DISABLE": str(2**32 + 1)}).fix


def test_a_numeric_p2p_level_is_read_as_nccl_reads_it() -> None:
    assert "never uses peer-to-peer" in check_nccl_env({"NCCL_P2P_LEVEL": "00"}).fix
    assert check_nccl_env({"NCCL_P2P_LEVEL": "02"}).verdict == "ok"


_C_STRTOLL_CASES = [
    "",
    " ",
    "0",
    "1",
    "-1",
    "+1",
    "01",
    "010",
    "08",
    "0x",
    "0X1f",
    "0xg",
    "0x1g",
    "-0x10",
    "+-1",
    "- 1",
    " \t\n\v\f\r42",
    "1abc",
    "1 ",
    "abc",
    "00x1",
    "0b1",
    "1e3",
    "1.5",
    "\u0663",
    "\uff11",
    "1\u00a0",
    "\u00a01",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "0x7fffffffffffffff",
    "0x8000000000000000",
    "-0x8000000000000000",
    "0777777777777777777777",
    "01777777777777777777777",
    "99999999999999999999",
    "0x" + "f" * 20,
]


def _libc_strtoll(text: str) -> tuple[int | None, int]:
    """libc's own ``strtoll(text, &end, 0)``: the value (None on ERANGE) and bytes read."""
    libc = ctypes.CDLL(None, use_errno=True)
    strtoll = libc.strtoll
    strtoll.restype = ctypes.c_longlong
    strtoll.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    buffer = ctypes.create_string_buffer(text.encode())
    end = ctypes.c_void_p()
    ctypes.set_errno(0)
    value = strtoll(ctypes.addressof(buffer), ctypes.byref(end), 0)
    failed = ctypes.get_errno() != 0
    return (None if failed else value), (end.value or 0) - ctypes.addressof(buffer)


@pytest.mark.skipif(sys.platform == "win32", reason="compares with the C library's strtoll")
def test_c_strtoll_matches_the_c_librarys() -> None:
    generated = random.Random(0)
    alphabet = " \t+-0123456789abcdefxXg"
    cases = _C_STRTOLL_CASES + [
        "".join(generated.choice(alphabet) for _ in range(generated.randint(1, 8)))
        for _ in range(2000)
    ]
    for text in cases:
        value, end = c_strtoll(text)
        assert (value, len(text[:end].encode())) == _libc_strtoll(text), repr(text)


def test_infiniband_variables_against_the_devices_here() -> None:
    assert check_nccl_env({"NCCL_IB_DISABLE": "1"}, ib_devices=[]).verdict == "ok"
    ib_off = check_nccl_env({"NCCL_IB_DISABLE": "1"}, ib_devices=["mlx5_0"])
    assert ib_off.verdict == "warn" and "mlx5_0" in ib_off.fix
    no_ib = check_nccl_env({"NCCL_NET": "IB"}, ib_devices=[])
    assert no_ib.verdict == "fail" and "no InfiniBand" in no_ib.fix
    assert check_nccl_env({"NCCL_NET": "IB"}, ib_devices=["mlx5_0"]).verdict == "ok"
    assert check_nccl_env({"NCCL_NET": "Socket"}, ib_devices=["mlx5_0"]).verdict == "warn"


def test_debugging_variables_are_named() -> None:
    check = check_nccl_env({"NCCL_ALGO": "Ring", "NCCL_DEBUG": "INFO"})
    assert check.verdict == "warn" and "NCCL_ALGO='Ring' is a debugging setting" in check.fix
    assert "NCCL_DEBUG=INFO" in check.value


def test_hostname_on_another_loopback_address_is_this_host() -> None:
    # Debian and Ubuntu map the hostname to 127.0.1.1, which lo does not list but serves:
    # gloo binds to it, as to 127.0.0.1.
    check = check_hostname("vm", ["127.0.1.1"], {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2"]})
    assert check.verdict == "ok"
    assert "127.0.1.1 (lo)" in check.value and "loopback only" in check.value
    elsewhere = check_hostname("vm", ["10.9.9.9"], {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]})
    assert elsewhere.verdict == "warn" and "no address of this host" in elsewhere.fix
