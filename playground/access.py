"""Who may change the one shared engine: the presenter gate every page event passes through.

Every Gradio event is callable by name (gradio_client, or a raw POST to the queue), so hiding a button protects
nothing: `Access.guard(demo)` wraps every event function of the built page and refuses, on the server, each one
not marked `audience` unless the visitor is the presenter. Default-deny: a handler added later is the presenter's
until someone decides the audience may call it.

Modes (`decide_mode`): "open" (a desk: loopback, no token, everyone is presenter, as before), "token" (the
presenter is whoever entered the secret on the page, or sends it as the X-Presenter-Token header), "public"
(no secret configured off loopback, with --share or on Spaces: nobody changes shared state).
"""
from __future__ import annotations

import functools
import hmac
import inspect
import ipaddress
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

OPEN, TOKEN, PUBLIC = "open", "token", "public"
TOKEN_ENV = "WATCH_LLM_PRESENTER_TOKEN"  # a Space keeps it as a secret (Settings -> Variables and secrets)
TOKEN_HEADER = "x-presenter-token"  # gradio_client(url, headers={"X-Presenter-Token": ...}) for scripts
OWNER_ENV = "WATCH_LLM_SPACE_OWNER_PRESENTS"  # "1" on a Space with `hf_oauth: true`: its owner, logged in, presents
MAX_UNLOCKED = 64  # presenter sessions remembered (oldest forgotten first)
FAILED_UNLOCK_DELAY_S = 1.0  # a wrong token answers this late: with one unlock at a time, guessing is slow


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
    """The Space's owner, as Spaces names it (SPACE_AUTHOR_NAME, or the first part of SPACE_ID)."""
    return os.environ.get("SPACE_AUTHOR_NAME") or (os.environ.get("SPACE_ID") or "").split("/")[0] or None


def logged_in_as(request) -> str | None:
    """The Hugging Face user logged in through gradio's OAuth (gr.LoginButton) behind a gr.Request, or None."""
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
    """token when a secret is given; open on a loopback address, without --share, off Spaces; public otherwise."""
    if token:
        return TOKEN
    spaces = on_spaces() if spaces is None else spaces
    return OPEN if is_loopback(server_name) and not share and not spaces else PUBLIC


@dataclass(frozen=True)
class Visitor:
    session: str | None  # gradio's session hash (one browser tab)
    presenter: bool


class Refused(Exception):
    """A visitor asked for what only the presenter may do. app.py shows it as gradio's error toast."""


class Access:
    def __init__(self, mode: str = OPEN, token: str | None = None, owner: str | None = None) -> None:
        """`owner`: a Hugging Face user who is the presenter once logged in (the Space's owner), or None."""
        if mode not in (OPEN, TOKEN, PUBLIC):
            raise ValueError(f"access mode must be open, token or public, got {mode!r}")
        if mode == TOKEN and not token:
            raise ValueError("token mode needs a presenter token")
        self.mode = mode
        self.owner = owner or None
        self._token = token or None
        self._unlocked: OrderedDict[str, float] = OrderedDict()  # session hash -> when it unlocked
        self._lock = threading.Lock()
        self.refusals = 0  # calls refused since start (the tests count them)

    @classmethod
    def for_launch(cls, server_name: str | None, share: bool, token: str | None = None,
                   owner_presents: bool | None = None) -> Access:
        token = token or os.environ.get(TOKEN_ENV) or None
        if owner_presents is None:
            owner_presents = os.environ.get(OWNER_ENV, "").strip().lower() in ("1", "true", "yes")
        owner = space_owner() if owner_presents and on_spaces() else None
        return cls(decide_mode(server_name, share, token), token, owner)

    # ---- who is asking ---------------------------------------------------------------------------------------
    def visitor(self, request=None) -> Visitor:
        """The visitor behind `request` (a gr.Request; None: the event's own, from gradio's context)."""
        request = request if request is not None else current_request()
        session = getattr(request, "session_hash", None)
        if self.mode == OPEN:
            return Visitor(session, True)
        if request is None:
            return Visitor(session, False)
        if self.owner is not None and logged_in_as(request) == self.owner:
            return Visitor(session, True)
        if self.mode == PUBLIC:
            return Visitor(session, False)
        with self._lock:
            if session is not None and session in self._unlocked:
                return Visitor(session, True)
        headers = getattr(request, "headers", None) or {}
        sent = headers.get(TOKEN_HEADER) if hasattr(headers, "get") else None
        return Visitor(session, bool(sent) and self._matches(sent))

    def presents_api(self, request) -> bool:
        """Whether an API request is the presenter's, uncapped by the audience's shares: everyone's at a desk (open
        mode); in token mode, a request that sends the presenter token in the same header the page uses."""
        if self.mode == OPEN:
            return True
        sent = request.headers.get(TOKEN_HEADER)
        return self.mode == TOKEN and bool(sent) and self._matches(sent)

    def _matches(self, candidate: str) -> bool:
        if not isinstance(candidate, str) or self._token is None:
            return False
        return hmac.compare_digest(candidate.encode("utf-8", "replace"), self._token.encode("utf-8"))

    def unlock(self, candidate: str, request=None) -> str:
        """The page's "become presenter": right -> this tab is the presenter's from now on."""
        if self.mode == OPEN:
            return "Everyone at this page may change the engine (it listens on this machine only)."
        if self.mode == PUBLIC:
            return f"Public mode: {self.how_to_unlock()}"
        request = request if request is not None else current_request()
        session = getattr(request, "session_hash", None)
        if not self._matches((candidate or "").strip()):
            time.sleep(FAILED_UNLOCK_DELAY_S)
            return "⚠️ That is not the presenter token."
        if session is None:
            return "⚠️ This call has no session to unlock; send the token as the X-Presenter-Token header instead."
        with self._lock:
            self._unlocked[session] = time.time()
            self._unlocked.move_to_end(session)
            while len(self._unlocked) > MAX_UNLOCKED:
                self._unlocked.popitem(last=False)
        return "Unlocked: you are the presenter in this tab. Every change you make is shown to the room."

    def forget(self, request=None) -> None:
        """A tab closed: its presenter rights go with it."""
        request = request if request is not None else current_request()
        session = getattr(request, "session_hash", None)
        with self._lock:
            self._unlocked.pop(session, None)

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
        """One line for the top of the page: the visitor's role and, when locked, how to unlock."""
        if self.mode == OPEN:
            return ""
        if visitor.presenter:
            return "**Presenter**: you steer the shared engine; every change you make is shown to the room."
        return "**Audience**: chat and watch live. The controls that change the shared engine are locked: " \
               + self.how_to_unlock()

    def refusal(self, what: str) -> str:
        return f"Only the presenter may {what}: {self.how_to_unlock()}"

    # ---- the gate --------------------------------------------------------------------------------------------
    def require_presenter(self, what: str, request=None) -> Visitor:
        visitor = self.visitor(request)
        if not visitor.presenter:
            self.refusals += 1
            raise Refused(self.refusal(what))
        return visitor

    def gated(self, fn: Callable, what: str, refuse: Callable[[str], Exception]) -> Callable:
        """`fn` behind the presenter check, the same shape to gradio (signature, generator or not); a refusal is
        raised as refuse(message) before fn runs, so nothing it would change is touched."""
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
        """Put every event function of `demo` not marked `audience` behind the presenter check. Returns the
        names of the functions gated (the tests enumerate them)."""
        gated = []
        for block_fn in presenter_functions(demo):
            name = block_fn.api_name or block_fn.name or "fn"
            block_fn.fn = self.gated(block_fn.fn, f"use {describe_action(name)}", refuse)
            gated.append(name)
        return gated


def presenter_functions(demo) -> list:
    """The event functions of a built gradio page that only the presenter may call: all but those marked
    `audience` (and those with no server function: a JavaScript-only event, a Stop that only cancels)."""
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


def current_request():
    """The gr.Request of the event being handled (gradio keeps it in a context variable while an event runs)."""
    try:
        from gradio.context import LocalContext
    except ImportError:
        return None
    return LocalContext.request.get(None)


class Seats:
    """Fair shares of the engine for the audience: at most `per_visitor` chats in flight per visitor (session),
    and replies of at most `max_tokens`. The presenter and a desk (open mode) are not limited."""

    def __init__(self, per_visitor: int = 2, max_tokens: int = 256) -> None:
        if per_visitor < 1 or max_tokens < 1:
            raise ValueError(f"per_visitor and max_tokens must be >= 1, got {per_visitor} and {max_tokens}")
        self.per_visitor = per_visitor
        self.max_tokens = max_tokens
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, visitor: str) -> None:
        """One more chat for `visitor`; ValueError (said in the chat) when they already have their share."""
        with self._lock:
            held = self._in_flight.get(visitor, 0)
            if held >= self.per_visitor:
                raise ValueError(f"you already have {held} replies on their way (at most {self.per_visitor} at a "
                                 f"time for each visitor of this shared engine): wait for one to finish")
            self._in_flight[visitor] = held + 1

    def give_back(self, visitor: str) -> None:
        with self._lock:
            held = self._in_flight.get(visitor, 0) - 1
            if held > 0:
                self._in_flight[visitor] = held
            else:
                self._in_flight.pop(visitor, None)

    def in_flight(self, visitor: str) -> int:
        with self._lock:
            return self._in_flight.get(visitor, 0)
