"""Who a visitor is, as the server decides it: never a value the client chose.

A client's address is the TCP peer's, unless that peer is a proxy we were told to trust (`--forwarded-allow-ips`,
as uvicorn and vLLM name it); then it is the right-most X-Forwarded-For (or Forwarded) hop that is not itself a
trusted proxy, so whatever a client writes into those headers sits left of the hop a trusted proxy appended and
is never read. An IPv6 client is its /64: one host usually holds the whole network.

A page's visitor id is issued by the server when the page loads (VisitorIds.admit), signed, and bound to the
page's gradio session; the browser keeps it (localStorage) so a reload is the same visitor. A call whose session
the server never bound is one more call from its address ("ip:" + address), whatever session hash it invents. New
ids are issued to one address at a bounded rate, and what one address holds in total is bounded elsewhere
(access.Seats, access.QueueBound): a new id costs a script only a page load.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("watch_llm.access")

# where a Hugging Face Space's own proxies sit: the container is reachable only through them, and the client is the
# right-most hop outside these networks
PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8",
                    "169.254.0.0/16", "::1/128", "fc00::/7", "fe80::/10")
MAX_TRACKED = 20_000  # addresses, sessions or guessers remembered (oldest forgotten first)
ANONYMOUS = "ip:"  # a key for calls the server cannot tie to an issued visitor id: the address's own
BURST_GAP_S = 60.0  # wrong guesses from one address this far apart are two bursts (one log line each)


@dataclass(frozen=True)
class Who:
    key: str  # what shares and limits count against: "v:<id>" for an issued visitor, "ip:<address>" otherwise
    address: str  # the client's address, after trusted proxies (an IPv6 client's /64)
    issued: bool  # holds a visitor id the server issued

    def describe(self) -> str:
        return f"visitor {self.key[2:10]}… at {self.address}" if self.issued else f"an unknown page at {self.address}"


NOBODY = Who(ANONYMOUS + "unknown", "unknown", False)  # a call with no request to tell who sent it


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a header or a socket writes it ("1.2.3.4", "1.2.3.4:80", "[::1]:80", '"[2001:db8::1]"')."""
    text = (text or "").strip().strip('"')
    if text.startswith("["):
        text = text[1:text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.split(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def address_key(ip) -> str:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Proxies:
    """Which peers may tell us who their client is (X-Forwarded-For / Forwarded)."""

    def __init__(self, trusted: str | Iterable[str] = "") -> None:
        """`trusted`: addresses and networks, comma-separated or a list; "*" trusts every peer (only for a server
        nothing can reach but its proxy); "" trusts none (the default off Spaces)."""
        items = [t.strip() for t in (trusted.split(",") if isinstance(trusted, str) else trusted) if t.strip()]
        self.everyone = "*" in items
        self.networks = []
        for item in items:
            if item == "*":
                continue
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError as exc:
                raise ValueError(f"--forwarded-allow-ips: {item[:60]!r} is not an address or a network") from exc
        self.setting = ",".join(items)

    @classmethod
    def for_launch(cls, setting: str | None, spaces: bool) -> Proxies:
        """None: on Spaces, its internal networks (the real client is the hop their proxy appended); elsewhere
        none, so a client on loopback cannot claim another address."""
        if setting is None:
            return cls(PRIVATE_NETWORKS if spaces else "")
        return cls(setting)

    def trusts(self, ip) -> bool:
        return ip is not None and (self.everyone or any(ip in net for net in self.networks if
                                                        net.version == ip.version))

    def address(self, peer: str | None, headers) -> str:
        ip = _ip(peer)
        if ip is None:
            return (peer or "unknown")[:64]
        if not self.trusts(ip):
            return address_key(ip)
        hops = forwarded_hops(headers)
        for hop in reversed(hops):
            hop_ip = _ip(hop)
            if hop_ip is None:  # a trusted proxy passed on something that is not an address: count it as itself
                return hop.strip()[:64] or "unknown"
            if not self.trusts(hop_ip):
                return address_key(hop_ip)
        first = _ip(hops[0]) if hops else None
        return address_key(first or ip)


def _values(headers, name: str) -> list[str]:
    if headers is None:
        return []
    if hasattr(headers, "getlist"):
        return list(headers.getlist(name))
    value = headers.get(name) if hasattr(headers, "get") else None
    return [value] if value else []


def forwarded_hops(headers) -> list[str]:
    """The hops a request passed through, client first: X-Forwarded-For, or else RFC 7239's Forwarded for=."""
    xff = [h for v in _values(headers, "x-forwarded-for") for h in v.split(",") if h.strip()]
    if xff:
        return xff
    hops = []
    for value in _values(headers, "forwarded"):
        for element in value.split(","):
            for pair in element.split(";"):
                name, _, v = pair.strip().partition("=")
                if name.lower() == "for" and v:
                    hops.append(v)
    return hops


def _keep(table: OrderedDict, key: str, value) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_TRACKED:
        table.popitem(last=False)


class Buckets:
    """A token bucket per key (an address): `burst` at once, then `per_s` a second."""

    def __init__(self, burst: float, per_s: float) -> None:
        self.burst, self.per_s = float(burst), float(per_s)
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, when)

    def _tokens(self, key: str, now: float) -> float:
        tokens, when = self._state.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - when) * self.per_s)

    def wait(self, key: str, now: float | None = None) -> float:
        """Seconds until `key` has a token (0: it has one now)."""
        now = time.monotonic() if now is None else now
        tokens = self._tokens(key, now)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.per_s if self.per_s > 0 else float("inf")

    def take(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens = self._tokens(key, now)
        if tokens < 1:
            return False
        _keep(self._state, key, (tokens - 1, now))
        return True


class VisitorIds:
    """Visitor ids: issued at page load, signed, bound to the page's session."""

    def __init__(self, burst: int = 60, per_minute: float = 20.0, ttl_s: float = 12 * 3600,
                 secret: bytes | None = None) -> None:
        """`burst` new ids to one address at once (a room arriving behind one NAT), then `per_minute`."""
        self.ttl_s = ttl_s
        self._secret = secret or secrets.token_bytes(32)  # a restart invalidates every id issued before it
        self._buckets = Buckets(burst, per_minute / 60.0)
        self._sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()  # session hash -> (visitor id, address)
        self._lock = threading.Lock()
        self.refused = 0  # page loads given no id (their address issued too many)

    def _sign(self, vid: str, issued: int) -> str:
        return hmac.new(self._secret, f"{vid}.{issued}".encode(), hashlib.sha256).hexdigest()[:32]

    def verify(self, token) -> str | None:
        """The visitor id in a signed token this server issued and that has not expired, or None."""
        if not isinstance(token, str) or len(token) > 128 or token.count(".") != 2:
            return None
        vid, issued, mac = token.split(".")
        if not issued.isdigit() or not hmac.compare_digest(mac, self._sign(vid, int(issued))):
            return None
        return vid if time.time() - int(issued) <= self.ttl_s else None

    def admit(self, session: str | None, address: str, presented=None) -> str | None:
        """A page loaded: bind its session to the visitor id it presents (signed by us, unexpired) or to a new one.
        Returns the signed id for the page to keep, or None when its address has had too many new ones lately
        (the page then counts as its address)."""
        if not session:
            return None
        vid = self.verify(presented)
        token = presented if vid else None
        with self._lock:
            if vid is None:
                if not self._buckets.take(address):
                    self.refused += 1
                    return None
                vid = secrets.token_hex(12)
                issued = int(time.time())
                token = f"{vid}.{issued}.{self._sign(vid, issued)}"
            _keep(self._sessions, session, (vid, address))
        return token

    def new_ids_wait(self, address: str) -> float:
        with self._lock:
            return self._buckets.wait(address)

    def who(self, session: str | None, address: str) -> Who:
        with self._lock:
            bound = self._sessions.get(session) if session else None
        if bound is None:
            return Who(ANONYMOUS + address, address, False)
        return Who("v:" + bound[0], address, True)

    def forget(self, session: str | None) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    def sessions_of(self, key: str) -> int:
        """How many live pages hold this visitor's id."""
        vid = key[2:]
        with self._lock:
            return sum(1 for v, _ in self._sessions.values() if v == vid)

    def count(self) -> int:
        """Pages with a visitor id now (the room's size, as far as open pages go)."""
        with self._lock:
            return len(self._sessions)


class Guesses:
    """Wrong presenter-token guesses, through any path (the Unlock box, the X-Presenter-Token header on a page event
    or on the API): each source (a visitor, or an address's unidentified calls) may try again after a delay that
    grows with its failures, and is locked out after a burst; a source that has failed also draws on its address's
    budget of about one guess a second, so fresh ids do not multiply the rate. A source with no failure is never
    slowed: the presenter's first try goes through however many strangers guess from the same network."""

    def __init__(self, free: int = 3, lockout_after: int = 10, lockout_s: float = 900.0, forget_s: float = 900.0,
                 per_address_per_s: float = 1.0, address_burst: int = 5) -> None:
        self.free, self.lockout_after, self.lockout_s, self.forget_s = free, lockout_after, lockout_s, forget_s
        self._sources: OrderedDict[str, list[float]] = OrderedDict()  # key -> [failures, last failure, next try]
        self._addresses = Buckets(address_burst, per_address_per_s)
        self._bursts: OrderedDict[str, float] = OrderedDict()  # address -> its latest wrong guess (for the log)
        self._lock = threading.Lock()
        self.checked = 0  # guesses compared with the token (right or wrong)
        self.held_back = 0  # guesses refused unchecked (too soon)

    def delay(self, failures: int) -> float:
        if failures >= self.lockout_after:
            return self.lockout_s
        return 1.0 if failures <= self.free else min(2.0 ** (failures - self.free), self.lockout_s)

    def _state(self, key: str, now: float) -> list[float] | None:
        state = self._sources.get(key)
        if state is not None and now - state[1] > max(self.forget_s, self.delay(int(state[0]))):
            del self._sources[key]
            return None
        return state

    def wait(self, who: Who, now: float | None = None) -> float:
        """Seconds before this source's next guess may be checked (0: now). A guess that comes sooner is refused
        without being compared with the token (held_back)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            state = self._state(who.key, now)
            if state is None:
                return 0.0
            wait = max(0.0, state[2] - now, self._addresses.wait(who.address, now))
            if wait > 0:
                self.held_back += 1
            return wait

    def failed(self, who: Who, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.checked += 1
            state = self._state(who.key, now) or [0, now, now]
            state[0] += 1
            state[1] = now
            state[2] = now + self.delay(int(state[0]))
            _keep(self._sources, who.key, state)
            self._addresses.take(who.address, now)
            failures = int(state[0])
            new_burst = now - self._bursts.get(who.address, -BURST_GAP_S) >= BURST_GAP_S
            _keep(self._bursts, who.address, now)
        # one log line a burst: when wrong guesses start coming from an address, and when one locks a source out
        if new_burst:
            log.warning("presenter token: wrong guesses from %s (first from %s); each source's next ones are slowed",
                        who.address, who.describe())
        if failures == self.lockout_after:
            log.warning("presenter token: %s locked out for %.0f s after %d wrong guesses", who.describe(),
                        self.lockout_s, failures)

    def succeeded(self, who: Who) -> None:
        with self._lock:
            self.checked += 1
            self._sources.pop(who.key, None)
