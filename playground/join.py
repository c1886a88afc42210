"""How a room joins the session: the address to give attendees (and who can open it), its QR code, and a panel
that shows both with how many people are here. The panel only reads: every visitor may see it.
The panel hands back a `refresh()` for the page's existing clock: nothing here runs a timer of its own.
"""
from __future__ import annotations

import functools
import html
import io
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import gradio as gr
import segno

from .access import is_loopback

ALL_INTERFACES = ("0.0.0.0", "::", "")
# A UDP connect() to it sends nothing: the kernel only picks the interface its default route leaves by. Any address
# off this machine would do: a documentation one (TEST-NET-1).
ROUTE_PROBE = ("192.0.2.1", 80)
HOW_TO_OPEN = ("To open it to the room, start it as GRADIO_SERVER_NAME=0.0.0.0 python app.py --presenter-token "
               "SECRET (people on this network can then open it), or with --share (a public link).")


@dataclass(frozen=True)
class JoinAddress:
    url: str | None  # what attendees type or scan; None: there is none to give
    how: str  # one sentence: where the address comes from and who can open it
    room_can_open: bool = True  # False: only this machine can open `url` (no QR code is drawn for it)


def join_address(server_name: str | None, port: int, share_url: str | None,
                 env: Mapping[str, str] = os.environ) -> JoinAddress:
    """The address a room should open, for an app launched on `server_name`:`port` (None: gradio's default,
    GRADIO_SERVER_NAME or 127.0.0.1) with gradio's share link `share_url` (None: no `--share`, or not up yet)."""
    if env.get("SPACE_ID"):
        # SPACE_HOST is "alice-watch-llm.hf.space", or with a custom domain a comma-separated list that starts
        # with the hf.space name (as gradio's own OAuth reads it)
        host = (env.get("SPACE_HOST") or "").split(",")[0].strip()
        if host:
            return JoinAddress(f"https://{host}/", "This Hugging Face Space's own address: anyone can open it "
                               "from anywhere.")
        return JoinAddress(f"https://huggingface.co/spaces/{env['SPACE_ID']}",
                           "This Hugging Face Space's page on the Hub (the Space did not say its own host name): "
                           "anyone can open it from anywhere.")
    if share_url and share_url.startswith(("https://", "http://")):
        return JoinAddress(share_url, "gradio's share link (--share): anyone can open it from anywhere while this "
                           "app runs (gradio keeps a link up to a week).")
    name = (env.get("GRADIO_SERVER_NAME") or "127.0.0.1") if server_name is None else server_name.strip()
    if name in ALL_INTERFACES:
        ip = lan_ipv4()
        if ip is None:
            return JoinAddress(None, "The app listens on every network interface, but this machine has no network "
                               "address besides its own (loopback): connect it to the room's network, or start "
                               "it with --share (a public link).", room_can_open=False)
        return JoinAddress(f"http://{ip}:{port}/", f"This machine's address on its local network ({ip}): people "
                           f"on the same network (the room's Wi-Fi) can open it, others cannot.")
    if is_loopback(name):
        return JoinAddress(f"http://{host_in_url(name)}:{port}/", "Only this machine can open it: the app listens "
                           f"on {name}, its own loopback address. {HOW_TO_OPEN}", room_can_open=False)
    return JoinAddress(f"http://{host_in_url(name)}:{port}/", f"The address the app listens on ({name}): people "
                       f"whose network reaches it can open it.")


def launched_address(demo, env: Mapping[str, str] = os.environ) -> JoinAddress:
    """join_address for a gr.Blocks as its launch() left it (the host and port it bound, the share link once up):
    what a page built before the launch can call at every refresh."""
    port = getattr(demo, "server_port", None)
    if port is None:  # not launched yet: gradio sets these in launch()
        return JoinAddress(None, "The app has not started serving yet.", room_can_open=False)
    return join_address(getattr(demo, "server_name", None), port, getattr(demo, "share_url", None), env=env)


def host_in_url(name: str) -> str:
    try:
        return f"[{name}]" if ipaddress.ip_address(name.strip("[]")).version == 6 else name
    except ValueError:
        return name


def lan_ipv4() -> str | None:
    """This machine's IPv4 address on the interface its default route uses; else (a room's own router with no way
    out) the first on a network interface, else the first its host name resolves to. Never a loopback, unspecified
    or link-local address: no other machine reaches those."""
    candidates: list[str] = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(ROUTE_PROBE)
            candidates.append(probe.getsockname()[0])
    except OSError:  # no default route
        pass
    candidates += [ip for name, ip in interface_ipv4s() if not name.startswith(VIRTUAL_INTERFACES)]
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for candidate in candidates:
        try:
            ip = ipaddress.IPv4Address(candidate)
        except ValueError:
            continue
        if not (ip.is_loopback or ip.is_unspecified or ip.is_link_local):
            return str(ip)
    return None


# a container's or a VM's bridge: its address is this machine's own, not one the room's network reaches
VIRTUAL_INTERFACES = ("lo", "docker", "br-", "veth", "virbr", "vmnet", "cni", "flannel", "tailscale", "zt")
SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def interface_ipv4s() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for each interface that has one, in the kernel's order; [] where the standard
    library cannot tell (it lists interfaces everywhere, their addresses only through this Linux ioctl)."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return []
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface with no IPv4 address
                continue
            found.append((name, socket.inet_ntoa(packed[20:24])))
    return found


QR_ERROR = "m"  # medium (15% of the code may be unreadable): a projected code is blurred, keystoned, glared
QR_BORDER = 4  # the quiet zone the QR standard asks for, in modules: a scanner finds the code's edge by it


@functools.lru_cache(maxsize=8)  # every page's panel asks for the same address' code
def qr_svg(text: str, size_px: int = 240) -> str:
    """`text` as a QR code: an SVG (no script, no external reference) about `size_px` wide, black modules on a
    white quiet zone. Each module is a whole number of pixels, so that none is drawn blurred between two."""
    code = segno.make(text, error=QR_ERROR, micro=False)  # a micro QR code: many phone scanners miss them
    modules = code.symbol_size(scale=1, border=QR_BORDER)[0]
    side = modules * max(1, round(size_px / modules))
    out = io.BytesIO()
    # white behind everything: a dark page's background must not show through the quiet zone
    code.save(out, kind="svg", scale=1, border=QR_BORDER, dark="#000", light="#fff", xmldecl=False, svgns=True,
              omitsize=True, svgclass=None, lineclass=None, nl=False)
    svg = out.getvalue().decode("ascii")
    return svg.replace("<svg ", f'<svg width="{side}" height="{side}" shape-rendering="crispEdges" role="img" '
                       f'aria-label="QR code of the address" ', 1)


def people_line(count: int) -> str:
    return f"{count} {'person' if count == 1 else 'people'} here now"


URL_CSS = "font-size: 2.2rem; font-weight: 700; line-height: 1.2; word-break: break-all;"
QR_CSS = "line-height: 0; svg { max-width: 100%; height: auto; }"
HOW_CSS = "font-size: 1.1rem;"
PEOPLE_CSS = "font-size: 1.5rem; font-weight: 600;"


def join_parts(address: JoinAddress, count: int) -> tuple[str, str, str, str]:
    """The panel's four values (address, QR code, how, people), as HTML: every text escaped."""
    url = html.escape(address.url) if address.url else "No address to give yet"
    qr = qr_svg(address.url) if address.url and address.room_can_open else ""
    return (f"<div>{url}</div>", qr, f"<p>{html.escape(address.how)}</p>",
            f"<div>{html.escape(people_line(count))}</div>")


def build_join_panel(get_address: Callable[[], JoinAddress], count_people: Callable[[], int],
                     open: bool = True) -> dict:
    """The "Join this session" accordion. Returns its components, `"outputs"` (the four) and `"refresh"(sent=None)`,
    their new values: with `sent`, the page's record of what it was sent last (updated), what has not changed comes
    back as gr.skip(), so the page's clock sends the QR code again only when the address changes. `get_address`
    and `count_people` are called on every refresh: keep them cheap."""
    url, qr, how, people = join_parts(get_address(), count_people())
    with gr.Accordion("Join this session", open=open, elem_id="join-panel") as accordion:
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                # gr.HTML puts its value into the page as it is: join_parts escapes every text first
                url_box = gr.HTML(url, css_template=URL_CSS, js_on_load=None, elem_id="join-url")
                how_box = gr.HTML(how, css_template=HOW_CSS, js_on_load=None, elem_id="join-how")
                people_box = gr.HTML(people, css_template=PEOPLE_CSS, js_on_load=None, elem_id="join-people")
            with gr.Column(scale=1, min_width=260):
                qr_box = gr.HTML(qr, css_template=QR_CSS, js_on_load=None, elem_id="join-qr")

    def refresh(sent: dict | None = None) -> tuple:
        address, count = get_address(), count_people()
        values = join_parts(address, count)
        if sent is None:
            return values
        same_address, same_count = sent.get("join_address") == address, sent.get("join_people") == count
        sent["join_address"], sent["join_people"] = address, count
        return (*(gr.skip() if same_address else v for v in values[:3]), gr.skip() if same_count else values[3])

    return {"accordion": accordion, "url": url_box, "qr": qr_box, "how": how_box, "people": people_box,
            "outputs": [url_box, qr_box, how_box, people_box], "refresh": refresh}
