"""Who may change the one shared engine: the presenter gate every page event passes through.

Every Gradio event is callable by name (gradio_client, or a raw POST to the queue), so hiding a button protects
nothing: `Access.guard(demo)` refuses, on the server, every event function not marked `audience` unless the
visitor is the presenter. Default-deny: a handler added later is the presenter's until someone decides otherwise.

Modes: "open" (a desk: loopback, no token, everyone is presenter), "token" (the presenter is whoever entered the
secret on the page, or sends it as the X-Presenter-Token header), "public" (no secret off loopback, with --share
or on Spaces: nobody changes shared state). Who is asking is identity.py's to say; this file turns it into a role,
the audience's fair shares (Seats) and a bound on what each visitor may have in gradio's queue (QueueBound).
"""
from __future__ import annotations

import functools
import hmac
import inspect
import ipaddress
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .identity import Guesses, Proxies, VisitorIds, Who

log = logging.getLogger("watch_llm.access")

OPEN, TOKEN, PUBLIC = "open", "token", "public"
TOKEN_ENV = "WATCH_LLM_PRESENTER_TOKEN"  # a Space keeps it as a secret (Settings -> Variables and secrets)
TOKEN_HEADER = "x-presenter-token"  # gradio_client(url, headers={"X-Presenter-Token": ...}) for scripts
OWNER_ENV = "WATCH_LLM_SPACE_OWNER_PRESENTS"  # "1" on a Space with `hf_oauth: true`: its owner, logged in, presents
MAX_PERSON_PRIORITY = 999  # people's priorities stay ahead of simulated users' (traffic.SIMULATED_PRIORITY)
MAX_UNLOCKED = 64  # presenter visitors remembered (oldest forgotten first)
MODE_LINES = {OPEN: "everyone at this page may change the engine (it listens on this machine only)",
              TOKEN: "presenter mode: whoever enters the presenter token steers; everyone else chats and watches",
              PUBLIC: "public mode: nobody may change the shared engine (give --presenter-token to steer it)"}


def audience(fn: Callable) -> Callable:
    """Mark an event function as one any visitor may call: it reads, or changes only the visitor's own things."""
    fn.audience = True
    return fn


def is_loopback(host: str | None) -> bool:
    host = (host or "").strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def on_spaces() -> bool:
    return bool(os.environ.get("SPACE_ID"))


def space_owner() -> str | None:
    return os.environ.get("SPACE_AUTHOR_NAME") or (os.environ.get("SPACE_ID") or "").split("/")[0] or None


def logged_in_as(request) -> str | None:
    """The Hugging Face user logged in through gradio's OAuth (gr.LoginButton), or None."""
    raw = getattr(request, "request", None)
    try:
        info = raw.session.get("oauth_info") if raw is not None else None
    except Exception:  # no session middleware: OAuth is not set up
        return None
    if not isinstance(info, dict) or (info.get("expires_at") or float("inf")) < time.time():
        return None
    name = (info.get("userinfo") or {}).get("preferred_username")
    return name if isinstance(name, str) and name else None


def decide_mode(server_name: str | None, share: bool, token: str | None, spaces: bool | None = None) -> str:
    if token:
        return TOKEN
    spaces = on_spaces() if spaces is None else spaces
    return OPEN if is_loopback(server_name) and not share and not spaces else PUBLIC


@dataclass(frozen=True)
class Visitor:
    session: str | None  # gradio's session hash (one browser tab)
    presenter: bool
    who: Who | None = None  # who the server says is asking (None: no request to tell)
    note: str = ""  # why a token sent with the call was not taken (too soon after wrong ones)


class Refused(Exception):
    """A visitor asked for what only the presenter may do. app.py shows it as gradio's error toast."""


class Access:
    def __init__(self, mode: str = OPEN, token: str | None = None, owner: str | None = None,
                 proxies: Proxies | None = None, ids: VisitorIds | None = None,
                 guesses: Guesses | None = None) -> None:
        """`owner`: a Hugging Face user who is the presenter once logged in (the Space's owner), or None."""
        if mode not in (OPEN, TOKEN, PUBLIC):
            raise ValueError(f"access mode must be open, token or public, got {mode!r}")
        if mode == TOKEN and not token:
            raise ValueError("token mode needs a presenter token")
        self.mode = mode
        self.owner = owner or None
        self._token = token or None
        self.proxies = proxies or Proxies()
        self.ids = ids or VisitorIds()
        self.guesses = guesses or Guesses()
        self._unlocked: dict[str, float] = {}  # visitor key -> when it unlocked
        self._lock = threading.Lock()
        self.refusals = 0  # calls refused since start (the tests count them)

    @classmethod
    def for_launch(cls, server_name: str | None, share: bool, token: str | None = None,
                   owner_presents: bool | None = None, forwarded_allow_ips: str | None = None) -> Access:
        token = token or os.environ.get(TOKEN_ENV) or None
        if owner_presents is None:
            owner_presents = os.environ.get(OWNER_ENV, "").strip().lower() in ("1", "true", "yes")
        owner = space_owner() if owner_presents and on_spaces() else None
        return cls(decide_mode(server_name, share, token), token, owner,
                   Proxies.for_launch(forwarded_allow_ips, on_spaces()))

    @property
    def shared(self) -> bool:
        """Token and public modes: shares and bounds apply."""
        return self.mode != OPEN

    # ---- who is asking ---------------------------------------------------------------------------------------
    def who(self, request=None, session: str | None = None) -> Who:
        """Who sent `request` (None: the event's own): its issued visitor id when its session holds one, else its
        address."""
        request = request if request is not None else current_request()
        client = getattr(request, "client", None)
        address = self.proxies.address(getattr(client, "host", None), getattr(request, "headers", None))
        return self.ids.who(session if session is not None else getattr(request, "session_hash", None), address)

    def admit(self, presented, request=None) -> str | None:
        """A page loaded: its visitor id (VisitorIds.admit)."""
        request = request if request is not None else current_request()
        who = self.who(request)
        return self.ids.admit(getattr(request, "session_hash", None), who.address, presented)

    def visitor(self, request=None) -> Visitor:
        """Decided once per request: a wrong X-Presenter-Token counts as one guess, however often the event asks."""
        request = request if request is not None else current_request()
        session = getattr(request, "session_hash", None)
        if self.mode == OPEN:
            return Visitor(session, True)
        if request is None:
            return Visitor(session, False)
        known = _decided(request)
        if known is not None:
            return known
        who = self.who(request)
        if self.owner is not None and logged_in_as(request) == self.owner:
            visitor = Visitor(session, True, who)
        elif self.mode == PUBLIC:
            visitor = Visitor(session, False, who)
        else:
            with self._lock:
                unlocked = who.issued and who.key in self._unlocked
            if unlocked:
                visitor = Visitor(session, True, who)
            else:
                ok, note = self._header_token(request, who)
                visitor = Visitor(session, ok, who, note)
        _remember(request, visitor)
        return visitor

    def _header_token(self, request, who: Who) -> tuple[bool, str]:
        """A header token is a guess like any other, slowed per source."""
        headers = getattr(request, "headers", None) or {}
        sent = headers.get(TOKEN_HEADER) if hasattr(headers, "get") else None
        if not sent:
            return False, ""
        return self._guess(sent, who)

    def _guess(self, candidate, who: Who) -> tuple[bool, str]:
        """(right, why not taken): a guess checked only when its source may try again."""
        wait = self.guesses.wait(who)
        if wait > 0:
            return False, (f"after a wrong presenter token the next one from here is taken only {math.ceil(wait)} s "
                           f"later: try again then")
        if self._matches(candidate):
            self.guesses.succeeded(who)
            return True, ""
        self.guesses.failed(who)
        return False, "That is not the presenter token."

    def api_share(self, request) -> Who | None:
        """Who an API request's share is counted against, or None when it is uncapped: open mode, and in token mode
        a request that sends the presenter token in the same header the page uses."""
        if self.mode == OPEN:
            return None
        who = self.who(request, session="")
        if self.mode == TOKEN and self._header_token(request, who)[0]:
            return None
        return who

    def _matches(self, candidate: str) -> bool:
        if not isinstance(candidate, str) or self._token is None:
            return False
        return hmac.compare_digest(candidate.encode("utf-8", "replace"), self._token.encode("utf-8"))

    def unlock(self, candidate: str, request=None) -> str:
        """The page's "become presenter": right -> this visitor is the presenter from now on (every page that
        holds its visitor id, until the last of them closes)."""
        if self.mode == OPEN:
            return MODE_LINES[OPEN].capitalize() + "."
        if self.mode == PUBLIC:
            return f"Public mode: {self.how_to_unlock()}"
        request = request if request is not None else current_request()
        who = self.who(request)
        if not who.issued:  # refused unchecked: an unknown page is no oracle
            return ("⚠️ This page has no visitor id (reload it), or this call is a script's: send the token as the "
                    "X-Presenter-Token header instead.")
        right, why = self._guess((candidate or "").strip(), who)
        if not right:
            return f"⚠️ {why}"
        with self._lock:
            self._unlocked[who.key] = time.time()
            while len(self._unlocked) > MAX_UNLOCKED:
                self._unlocked.pop(min(self._unlocked, key=self._unlocked.get))
        log.info("presenter: unlocked by %s", who.describe())
        return ("Unlocked: you are the presenter (in every tab of this browser while one of them stays open). Every "
                "change you make is shown to the room.")

    def forget(self, request=None) -> None:
        """A tab closed: its session's visitor id goes, and with a presenter's last tab, its rights."""
        request = request if request is not None else current_request()
        who = self.who(request)
        self.ids.forget(getattr(request, "session_hash", None))
        if who.issued and self.ids.sessions_of(who.key) == 0:
            with self._lock:
                self._unlocked.pop(who.key, None)

    # ---- what the page says ----------------------------------------------------------------------------------
    def how_to_unlock(self) -> str:
        owner = (f" (or log in with Hugging Face as {self.owner}, the Space's owner)" if self.owner else "")
        if self.mode == TOKEN:
            return f"enter the presenter token in the Presenter box at the top to unlock them{owner}."
        if self.owner:
            return f"log in with Hugging Face as {self.owner}, the Space's owner, to unlock them."
        return (f"nobody may change this shared engine. To steer it, run your own copy (on Spaces: Duplicate this "
                f"Space) or start it with --presenter-token (or the {TOKEN_ENV} secret).")

    def banner(self, visitor: Visitor) -> str:
        if self.mode == OPEN:
            return ""
        if visitor.presenter:
            return "**Presenter**: you steer the shared engine; every change you make is shown to the room."
        return "**Audience**: chat and watch live. The controls that change the shared engine are locked: " \
               + self.how_to_unlock()

    # ---- the gate --------------------------------------------------------------------------------------------
    def require_presenter(self, what: str, request=None) -> Visitor:
        visitor = self.visitor(request)
        if not visitor.presenter:
            self.refusals += 1
            log.info("refused: %s asked to %s", visitor.who.describe() if visitor.who else "a caller", what)
            held = visitor.note if visitor.note.startswith("after a wrong") else ""
            raise Refused(f"Only the presenter may {what}: {self.how_to_unlock()}" + (f" ({held})" if held else ""))
        return visitor

    def gated(self, fn: Callable, what: str, refuse: Callable[[str], Exception]) -> Callable:
        """`fn` behind the presenter check, the same shape to gradio (signature, generator or not); a refusal is
        raised before fn runs, so nothing it would change is touched."""
        def check() -> None:
            try:
                self.require_presenter(what)
            except Refused as exc:
                raise refuse(str(exc)) from None

        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen(*args, **kwargs):
                check()
                yield from fn(*args, **kwargs)
            wrapped = gen
        elif inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(f"{what}: async event functions are not gated yet")
        else:
            @functools.wraps(fn)
            def plain(*args, **kwargs):
                check()
                return fn(*args, **kwargs)
            wrapped = plain
        wrapped.presenter_only = True
        return wrapped

    def guard(self, demo, refuse: Callable[[str], Exception]) -> list[str]:
        """Every event function of `demo` not marked `audience` behind the presenter check; their names."""
        gated = []
        for block_fn in presenter_functions(demo):
            name = block_fn.api_name or block_fn.name or "fn"
            block_fn.fn = self.gated(block_fn.fn, f"use {describe_action(name)}", refuse)
            gated.append(name)
        return gated


def presenter_functions(demo) -> list:
    """All but those marked `audience` (and those with no server function: a JavaScript-only event, a Stop that
    only cancels)."""
    return [block_fn for block_fn in demo.fns.values()
            if block_fn.fn is not None and not getattr(block_fn.fn, "audience", False)
            and not getattr(block_fn.fn, "presenter_only", False)]


def presenter_controls(demo) -> list:
    """The buttons whose events only the presenter may call: the page shows them locked to everyone else."""
    from gradio.components import Button
    ids = {target[0] for block_fn in presenter_functions(demo) for target in block_fn.targets}
    return [demo.blocks[i] for i in sorted(ids) if isinstance(demo.blocks.get(i), Button)]


def describe_action(name: str) -> str:
    """An event function's name as words for a refusal ("do_apply" -> "apply"; a lambda: "this control")."""
    words = name.removeprefix("do_").replace("_", " ").strip()
    return "this control" if not words or words.startswith("<") else words


def _decided(request) -> Visitor | None:
    return getattr(request, "_watch_llm_visitor", None) if hasattr(request, "__dict__") else None


def _remember(request, visitor: Visitor) -> None:
    if hasattr(request, "__dict__"):
        try:
            request._watch_llm_visitor = visitor
        except AttributeError:  # a request type that keeps no attributes: decided again next time
            pass


def current_request():
    try:
        from gradio.context import LocalContext
    except ImportError:
        return None
    return LocalContext.request.get(None)


class Seats:
    """The audience's fair shares: at most `per_visitor` replies in flight per visitor (a Who), at most
    `per_address` from one address in all (a classroom behind one NAT shares it; 0: no such bound), and replies of
    at most `max_tokens`. The presenter and open mode are not limited."""

    def __init__(self, per_visitor: int = 2, max_tokens: int = 256, per_address: int = 16) -> None:
        if per_visitor < 1 or max_tokens < 1 or per_address < 0:
            raise ValueError(f"per_visitor and max_tokens must be >= 1 and per_address >= 0, got {per_visitor}, "
                             f"{max_tokens} and {per_address}")
        self.per_visitor = per_visitor
        self.max_tokens = max_tokens
        self.per_address = per_address
        self._in_flight: dict[str, int] = {}
        self._by_address: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, who: Who) -> int:
        """One more reply for `who`; ValueError (a 429 on the API) past either share. Returns how many its address
        already had on their way: the reply's priority (engine/policies.py), so an address's first reply is served
        before a flood's sixteenth."""
        with self._lock:
            held = self._in_flight.get(who.key, 0)
            if held >= self.per_visitor:
                raise ValueError(f"you already have {held} replies on their way (at most {self.per_visitor} at a "
                                 f"time for each visitor of this shared engine): wait for one to finish")
            from_there = self._by_address.get(who.address, 0)
            if self.per_address and from_there >= self.per_address:
                raise ValueError(f"{from_there} replies are already on their way to your network's address (at most "
                                 f"{self.per_address} at a time from one address on this shared engine): wait "
                                 f"for one to finish")
            self._in_flight[who.key] = held + 1
            self._by_address[who.address] = from_there + 1
            return min(from_there, MAX_PERSON_PRIORITY)

    def give_back(self, who: Who) -> None:
        with self._lock:
            for table, key in ((self._in_flight, who.key), (self._by_address, who.address)):
                held = table.get(key, 0) - 1
                if held > 0:
                    table[key] = held
                else:
                    table.pop(key, None)

    def in_flight(self, key: str) -> int:
        with self._lock:
            return self._in_flight.get(key, 0)

    def from_address(self, address: str) -> int:
        with self._lock:
            return self._by_address.get(address, 0)


class QueueBound:
    """What each visitor, and each address in all, may have waiting or running in gradio's queue (its max_size
    bounds the whole); more are refused when they join, before anything is spent on them. Page loads count only
    against the address (a room behind one NAT loads its pages at once, before any has its visitor id)."""

    def __init__(self, access: Access, per_visitor: int = 8, per_address: int = 128) -> None:
        self.access, self.per_visitor, self.per_address = access, per_visitor, per_address
        self._events: dict[str, tuple[str, str]] = {}  # event id -> (visitor key, address)
        self._lock = threading.Lock()
        self.refused = 0

    def install(self, demo) -> None:
        """Wraps the queue's push: where every event joins (the page, gradio_client, /call)."""
        queue = demo._queue
        push = queue.push
        loads = {fn_id for fn_id, fn in demo.fns.items() if any(t[1] == "load" for t in fn.targets)}

        async def bounded_push(body, request, username):
            who = self.access.who(request, session=body.session_hash or "")
            live = queue.event_ids_to_events
            why = self.check(who, body.fn_index in loads, live)
            if why:  # too many from this visitor: 429, as the API says it (gradio's own "queue full" is the room's)
                self.refused += 1
                from fastapi import HTTPException
                raise HTTPException(status_code=429, detail=why, headers={"Retry-After": "1"})
            ok, event_id, state = await push(body, request, username)
            if ok:
                with self._lock:
                    self._events[event_id] = ("" if body.fn_index in loads else who.key, who.address)
            return ok, event_id, state
        queue.push = bounded_push

    def check(self, who: Who, page_load: bool, live) -> str:
        """Why `who` may not add an event now ("" when they may); forgets events that have left the queue."""
        with self._lock:
            for event_id in [e for e in self._events if e not in live]:
                del self._events[event_id]
            mine = 0 if page_load else sum(1 for key, _ in self._events.values() if key == who.key)
            theirs = sum(1 for _, address in self._events.values() if address == who.address)
        if mine >= self.per_visitor:
            return (f"You have {mine} requests waiting or running on this shared page (at most {self.per_visitor} "
                    f"each): wait for them to finish.")
        if theirs >= self.per_address:
            return (f"Your network's address has {theirs} requests waiting or running on this shared page (at most "
                    f"{self.per_address}): wait for some to finish.")
        return ""
