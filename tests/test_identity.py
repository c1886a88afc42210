"""Who a visitor is, as the server decides it (playground/identity.py): client addresses behind trusted proxies
only, visitor ids only the server can mint, and presenter-token guesses slowed and locked out per source."""
from __future__ import annotations

import pytest

from playground.identity import (
    PRIVATE_NETWORKS,
    Buckets,
    Guesses,
    Proxies,
    VisitorIds,
    Who,
    address_key,
    forwarded_hops,
)


def test_no_proxy_is_trusted_by_default_so_headers_change_nothing():
    proxies = Proxies()
    spoofed = {"x-forwarded-for": "6.6.6.6", "forwarded": "for=7.7.7.7"}
    assert proxies.address("127.0.0.1", spoofed) == "127.0.0.1"  # uvicorn's own default trusts loopback's
    assert proxies.address("203.0.113.9", spoofed) == "203.0.113.9"


def test_a_trusted_proxys_hop_is_read_from_the_right():
    nginx = Proxies("127.0.0.1")
    # nginx appends the peer it saw: whatever the client wrote sits left of it and is never reached
    assert nginx.address("127.0.0.1", {"x-forwarded-for": "6.6.6.6, 127.0.0.3"}) == "127.0.0.3"
    assert nginx.address("127.0.0.1", {"x-forwarded-for": "198.51.100.7"}) == "198.51.100.7"
    assert nginx.address("127.0.0.2", {"x-forwarded-for": "6.6.6.6"}) == "127.0.0.2"  # not the trusted proxy
    assert nginx.address("127.0.0.1", {}) == "127.0.0.1"  # the proxy itself, or a direct local client
    # RFC 7239's Forwarded when there is no X-Forwarded-For; ports and brackets are not part of who it is
    assert nginx.address("127.0.0.1", {"forwarded": 'for="[2001:db8::1]:4711";proto=https, for=192.0.2.60:80'}) \
        == "192.0.2.60"
    chain = Proxies("10.0.0.0/8, 127.0.0.1")
    assert chain.address("127.0.0.1", {"x-forwarded-for": "6.6.6.6, 198.51.100.7, 10.1.2.3"}) == "198.51.100.7"


def test_on_spaces_the_client_is_the_hop_outside_its_networks():
    spaces = Proxies.for_launch(None, spaces=True)
    assert spaces.setting == ",".join(PRIVATE_NETWORKS)
    assert spaces.address("10.20.0.5", {"x-forwarded-for": "1.1.1.1, 203.0.113.4, 10.20.0.9"}) == "203.0.113.4"
    assert Proxies.for_launch(None, spaces=False).setting == ""
    assert Proxies.for_launch("127.0.0.1", spaces=True).setting == "127.0.0.1"  # a setting given wins


def test_ipv6_clients_are_their_64_and_bad_settings_are_refused():
    assert address_key(__import__("ipaddress").ip_address("2001:db8:1:2:aaaa::1")) == "2001:db8:1:2::/64"
    assert Proxies().address("2001:db8:1:2::5", {}) == Proxies().address("2001:db8:1:2:ffff::9", {})
    assert Proxies().address("::ffff:192.0.2.1", {}) == "192.0.2.1"
    with pytest.raises(ValueError, match="not an address"):
        Proxies("127.0.0.1, localhost")
    assert forwarded_hops({"x-forwarded-for": "a, b", "forwarded": "for=c"}) == ["a", " b"]


def test_ids_are_issued_by_the_server_and_kept_across_a_reload():
    ids = VisitorIds(burst=3, per_minute=60)
    token = ids.admit("tab-1", "198.51.100.7")
    who = ids.who("tab-1", "198.51.100.7")
    assert who.issued and who.key.startswith("v:")
    assert ids.who("made-up-hash", "198.51.100.7") == Who("ip:198.51.100.7", "198.51.100.7", False)
    # the page kept its signed id: a reload (a new session) is the same visitor, and costs no new id
    assert ids.admit("tab-1-reloaded", "198.51.100.7", token) == token
    assert ids.who("tab-1-reloaded", "198.51.100.7").key == who.key
    assert ids.sessions_of(who.key) == 2
    # a forged or altered id is not taken: the page gets a new one
    vid, issued, mac = token.split(".")
    for forged in (f"{'0' * 24}.{issued}.{mac}", f"{vid}.{int(issued) + 1}.{mac}", f"{vid}.{issued}.{'0' * 32}",
                   "x" * 500, 42, None):
        assert ids.verify(forged) is None
    other = VisitorIds(burst=3)
    assert other.verify(token) is None  # another server's (or a restarted one's) secret
    ids.forget("tab-1")
    assert not ids.who("tab-1", "198.51.100.7").issued and ids.sessions_of(who.key) == 1


def test_one_address_gets_new_ids_at_a_bounded_rate():
    ids = VisitorIds(burst=3, per_minute=6)
    tokens = [ids.admit(f"tab-{i}", "203.0.113.5") for i in range(5)]
    assert all(tokens[:3]) and tokens[3:] == [None, None] and ids.refused == 2
    assert not ids.who("tab-4", "203.0.113.5").issued  # it counts as its address
    assert ids.admit("tab-x", "192.0.2.1")  # another address is not held back
    assert 9 < ids.new_ids_wait("203.0.113.5") <= 10  # 6 a minute: the next in 10 s


def test_buckets_refill():
    bucket = Buckets(burst=2, per_s=0.5)
    assert bucket.take("a", now=0) and bucket.take("a", now=0) and not bucket.take("a", now=0)
    assert bucket.wait("a", now=1.0) == pytest.approx(1.0)
    assert bucket.take("a", now=2.0)


def test_guesses_slow_each_source_and_lock_it_out():
    guesses = Guesses(free=3, lockout_after=6, lockout_s=600, per_address_per_s=100, address_burst=100)
    bob = Who("v:bob", "192.0.2.1", True)
    now = 0.0
    assert guesses.wait(bob, now) == 0
    for n in range(1, 7):
        guesses.failed(bob, now)
        wait = guesses.wait(bob, now)
        assert wait == (1.0 if n <= 3 else 600 if n == 6 else 2.0 ** (n - 3)), n
        assert guesses.wait(bob, now + wait / 2) > 0  # too soon: refused unchecked
        now += wait
    assert guesses.wait(bob, now - 1) > 0  # locked out for the whole lockout
    assert guesses.held_back >= 7 and guesses.checked == 6
    guesses.succeeded(bob)
    assert guesses.wait(bob, now) == 0


def test_fresh_ids_do_not_multiply_an_addresss_guesses_but_the_presenter_is_never_slowed():
    guesses = Guesses(per_address_per_s=1.0, address_burst=3)
    strangers = [Who(f"v:s{i}", "127.0.0.1", True) for i in range(50)]
    now = 100.0
    for who in strangers:  # each fresh id's first guess is checked (new ids come at a bounded rate: VisitorIds)
        assert guesses.wait(who, now) == 0
        guesses.failed(who, now)
    checked = 0
    for tick in range(1, 101):  # then all fifty try again every 0.1 s for 10 s: the address's budget decides
        for who in strangers:
            if guesses.wait(who, now + tick / 10) == 0:
                guesses.failed(who, now + tick / 10)
                checked += 1
    assert 8 <= checked <= 11  # about one a second
    presenter = Who("v:presenter", "127.0.0.1", True)
    assert guesses.wait(presenter, now + 10) == 0  # no failure of its own: checked at once
    anonymous = Who("ip:127.0.0.1", "127.0.0.1", False)
    guesses.failed(anonymous, now + 10)
    assert guesses.wait(anonymous, now + 10.5) > 0  # an address's unidentified calls are one source
