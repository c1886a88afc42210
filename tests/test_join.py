"""How a room joins and what the projector shows: the address given for each way the app is launched, a QR code
that decodes back to it (read by a small decoder here, from the SVG and from the pixels Chromium drew), the join
panel's refresh, and the projector page served on its own URL."""
from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
import segno

from playground import join
from playground.join import JoinAddress, join_address, qr_svg

LAN_IP = "192.168.1.20"


class FakeUdp:
    """socket.socket for lan_ipv4's probe: says which source address the route gives; sending anything fails."""
    connected: list = []

    def __init__(self, family=socket.AF_INET, kind=socket.SOCK_STREAM, *args):
        assert (family, kind) == (socket.AF_INET, socket.SOCK_DGRAM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def connect(self, address):
        FakeUdp.connected.append(address)

    def getsockname(self):
        return (LAN_IP, 54321)

    def send(self, *args):
        raise AssertionError("the address is found without sending anything")

    sendto = sendall = send


@pytest.fixture()
def on_a_lan(monkeypatch):
    FakeUdp.connected = []
    monkeypatch.setattr(join.socket, "socket", FakeUdp)
    monkeypatch.setattr(join, "interface_ipv4s", lambda: [("lo", "127.0.0.1")])
    monkeypatch.setattr(join.socket, "gethostbyname_ex", lambda name: (name, [], ["127.0.1.1"]))
    return FakeUdp


# ---- the address ---------------------------------------------------------------------------------------------
def test_on_spaces_the_spaces_own_host_wins(on_a_lan):
    env = {"SPACE_ID": "alice/watch-llm", "SPACE_HOST": "alice-watch-llm.hf.space"}
    got = join_address("0.0.0.0", 7860, "https://abc.gradio.live", env=env)
    assert got.url == "https://alice-watch-llm.hf.space/" and got.room_can_open
    assert "anywhere" in got.how
    # a custom domain: Spaces lists the hf.space name first
    env["SPACE_HOST"] = "alice-watch-llm.hf.space,llm.example.org"
    assert join_address("0.0.0.0", 7860, None, env=env).url == "https://alice-watch-llm.hf.space/"
    # no host said: the Space's page on the Hub still opens it
    assert join_address("0.0.0.0", 7860, None, env={"SPACE_ID": "alice/watch-llm"}).url == \
        "https://huggingface.co/spaces/alice/watch-llm"


def test_a_share_link_is_given_as_it_is(on_a_lan):
    got = join_address("127.0.0.1", 7860, "https://0123abcd.gradio.live", env={})
    assert got.url == "https://0123abcd.gradio.live" and got.room_can_open
    assert "share link" in got.how and "anyone" in got.how
    # not an address at all: never given to a room
    assert join_address("0.0.0.0", 7860, "javascript:alert(1)", env={}).url == f"http://{LAN_IP}:7860/"


@pytest.mark.parametrize("bound", ["0.0.0.0", "::", None])
def test_on_all_interfaces_the_lan_address_found_without_sending(on_a_lan, bound):
    env = {"GRADIO_SERVER_NAME": "0.0.0.0"} if bound is None else {}
    got = join_address(bound, 7861, None, env=env)
    assert got.url == f"http://{LAN_IP}:7861/" and got.room_can_open
    assert "same network" in got.how and LAN_IP in got.how
    assert on_a_lan.connected and all(not address[0].startswith("127.") for address in on_a_lan.connected)


def test_without_a_default_route_the_lan_address_is_an_interfaces_never_loopback(monkeypatch):
    class NoRoute(FakeUdp):
        def connect(self, address):
            raise OSError("Network is unreachable")
    monkeypatch.setattr(join.socket, "socket", NoRoute)
    monkeypatch.setattr(join.socket, "gethostbyname_ex", lambda name: (name, [], ["127.0.1.1", "10.1.2.3"]))
    # a room's own router with no way out: the Wi-Fi interface's address, not a container bridge's
    monkeypatch.setattr(join, "interface_ipv4s", lambda: [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"),
                                                          ("wlan0", "192.168.8.23")])
    assert join_address("0.0.0.0", 7860, None, env={}).url == "http://192.168.8.23:7860/"
    # no interface said: what the host name resolves to
    monkeypatch.setattr(join, "interface_ipv4s", lambda: [])
    assert join_address("0.0.0.0", 7860, None, env={}).url == "http://10.1.2.3:7860/"
    # only loopback (and a route through it): nothing to give, and the panel says what to do
    monkeypatch.setattr(join.socket, "gethostbyname_ex", lambda name: (name, [], ["127.0.1.1"]))
    got = join_address("0.0.0.0", 7860, None, env={})
    assert got.url is None and not got.room_can_open and "--share" in got.how


def test_a_launched_page_gives_the_address_it_was_launched_on(on_a_lan):
    demo = SimpleNamespace(share_url=None)  # a gr.Blocks before launch()
    assert join.launched_address(demo, env={}).url is None
    demo.server_name, demo.server_port = "0.0.0.0", 7862
    assert join.launched_address(demo, env={}).url == f"http://{LAN_IP}:7862/"
    demo.share_url = "https://0123abcd.gradio.live"  # the tunnel came up
    assert join.launched_address(demo, env={}).url == "https://0123abcd.gradio.live"


def test_this_machines_lan_address_is_never_loopback():
    ip = join.lan_ipv4()
    assert ip is None or not ip.startswith(("127.", "0.", "169.254."))
    found = dict(join.interface_ipv4s())
    if sys.platform == "linux":  # the ioctl reads the kernel's own list: loopback is always on it
        assert found.get("lo") == "127.0.0.1"
    assert ip is None or ip in found.values() or not found


def test_a_specific_address_is_that_address(on_a_lan):
    assert join_address("192.168.1.30", 7860, None, env={}).url == "http://192.168.1.30:7860/"
    assert join_address("fd00::5", 7860, None, env={}).url == "http://[fd00::5]:7860/"
    assert on_a_lan.connected == []  # nothing to look up


@pytest.mark.parametrize("bound", ["127.0.0.1", "localhost", "::1", None])
def test_loopback_says_only_this_machine_and_how_to_open_it(on_a_lan, bound):
    got = join_address(bound, 7860, None, env={})
    assert got.url in ("http://127.0.0.1:7860/", "http://localhost:7860/", "http://[::1]:7860/")
    assert not got.room_can_open
    assert "Only this machine" in got.how
    assert "GRADIO_SERVER_NAME=0.0.0.0 python app.py --presenter-token" in got.how and "--share" in got.how


# ---- the QR code -----------------------------------------------------------------------------------------------
def svg_modules(svg: str) -> tuple[int, set[tuple[int, int]], list[ET.Element]]:
    """(the side in modules, the dark modules as (row, col), the paths) of qr_svg's SVG, read from its path
    data: what a browser would draw, not what segno was asked for."""
    root = ET.fromstring(svg)
    side = int(root.get("viewBox").split()[2])
    paths = list(root.iter("{http://www.w3.org/2000/svg}path"))
    (line,) = [p for p in paths if p.get("stroke")]
    assert line.get("stroke") == "#000"
    dark, x, y = set(), 0.0, 0.0
    for op, args in re.findall(r"([MmHh])([-\d.\s]+)", line.get("d")):
        nums = [float(v) for v in args.split()]
        if op in "Mm":
            x, y = (nums[0], nums[1]) if op == "M" else (x + nums[0], y + nums[1])
        else:
            end = x + nums[0] if op == "h" else nums[0]
            dark |= {(int(y), col) for col in range(int(x), int(end))}
            x = end
    return side, dark, paths


# ISO/IEC 18004 for versions 1-6: the data codewords of each error-correction block (the EC codewords follow all
# of them, and a decoder of an undamaged code needs only where the data ends)
BLOCKS = {(1, "L"): [19], (1, "M"): [16], (1, "Q"): [13], (1, "H"): [9],
          (2, "L"): [34], (2, "M"): [28], (2, "Q"): [22], (2, "H"): [16],
          (3, "L"): [55], (3, "M"): [44], (3, "Q"): [17] * 2, (3, "H"): [13] * 2,
          (4, "L"): [80], (4, "M"): [32] * 2, (4, "Q"): [24] * 2, (4, "H"): [9] * 4,
          (5, "L"): [108], (5, "M"): [43] * 2, (5, "Q"): [15, 15, 16, 16], (5, "H"): [11, 11, 12, 12],
          (6, "L"): [68] * 2, (6, "M"): [27] * 4, (6, "Q"): [19] * 4, (6, "H"): [15] * 4}
MASKS = [lambda i, j: (i + j) % 2 == 0, lambda i, j: i % 2 == 0, lambda i, j: j % 3 == 0,
         lambda i, j: (i + j) % 3 == 0, lambda i, j: (i // 2 + j // 3) % 2 == 0,
         lambda i, j: (i * j) % 2 + (i * j) % 3 == 0, lambda i, j: ((i * j) % 2 + (i * j) % 3) % 2 == 0,
         lambda i, j: ((i + j) % 2 + (i * j) % 3) % 2 == 0]
ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ $%*+-./:"


def decode_qr(grid: list[list[int]]) -> tuple[str, int, str]:
    """(text, version, error level) of an undamaged QR code (versions 1-6, numeric/alphanumeric/byte segments):
    the format bits, the unmasked zigzag of data modules, the blocks de-interleaved, the segments read. Written
    from the standard, apart from segno, so that a code segno drew but a phone could not read fails here."""
    n = len(grid)
    version = (n - 17) // 4
    assert 1 <= version <= 6 and n == 17 + 4 * version
    raw = [grid[8][c] for c in (0, 1, 2, 3, 4, 5, 7, 8)] + [grid[r][8] for r in (7, 5, 4, 3, 2, 1, 0)]
    again = [grid[n - 1 - r][8] for r in range(7)] + [grid[8][n - 8 + c] for c in range(8)]
    assert raw == again, "the two copies of the format information differ"
    fmt = int("".join(map(str, raw)), 2) ^ 0x5412
    level, mask = "MLHQ"[fmt >> 13], MASKS[(fmt >> 10) & 7]

    def reserved(r: int, c: int) -> bool:
        near_finder = (r <= 8 and (c <= 8 or c >= n - 8)) or (r >= n - 8 and c <= 8)
        p = n - 7  # versions 2-6 have one alignment pattern, centred here
        return near_finder or r == 6 or c == 6 or (version > 1 and abs(r - p) <= 2 and abs(c - p) <= 2)

    bits, upward, col = [], True, n - 1
    while col > 0:
        col -= col == 6  # the vertical timing line is skipped
        for r in (range(n - 1, -1, -1) if upward else range(n)):
            bits += [grid[r][c] ^ mask(r, c) for c in (col, col - 1) if not reserved(r, c)]
        upward, col = not upward, col - 2
    codewords = [int("".join(map(str, bits[i:i + 8])), 2) for i in range(0, len(bits) - 7, 8)]
    sizes = BLOCKS[version, level]
    blocks: list[list[int]] = [[] for _ in sizes]
    it = iter(codewords)
    for i in range(max(sizes)):
        for b, size in enumerate(sizes):
            if i < size:
                blocks[b].append(next(it))
    stream = "".join(f"{v:08b}" for block in blocks for v in block)
    pos, text = 0, ""

    def take(k: int) -> int:
        nonlocal pos
        pos += k
        return int(stream[pos - k:pos] or "0", 2)

    while pos + 4 <= len(stream) and (mode := take(4)):
        if mode == 0b0100:
            text += bytes(take(8) for _ in range(take(8))).decode("latin-1")  # the standard's default
        elif mode == 0b0010:
            count = take(9)
            for _ in range(count // 2):
                text += "".join(ALNUM[v] for v in divmod(take(11), 45))
            text += ALNUM[take(6)] if count % 2 else ""
        elif mode == 0b0001:
            count = take(10)
            for _ in range(count // 3):
                text += f"{take(10):03d}"
            if count % 3:
                text += f"{take(3 * (count % 3) + 1):0{count % 3}d}"
        else:
            raise AssertionError(f"segment mode {mode:04b} is not one a URL needs")
    return text, version, level


URLS = ["http://192.168.1.20:7860/", "https://0123abcd4567ef89.gradio.live",
        "https://alice-watch-llm-a-longer-space-name.hf.space/"]


@pytest.mark.parametrize("url", URLS)
def test_the_qr_code_is_segnos_code_for_the_url_and_decodes_to_it(url):
    svg = qr_svg(url)
    side, dark, paths = svg_modules(svg)
    code = segno.make(url, error="m", micro=False)
    assert not code.is_micro and code.error in "MQH"  # at least M: segno raises it when the size allows
    border = join.QR_BORDER
    assert side == len(code.matrix) + 2 * border
    expected = {(r + border, c + border) for r, row in enumerate(code.matrix) for c, v in enumerate(row) if v}
    assert dark == expected  # module for module: a fixed or a wrong image has other dark modules
    assert len(dark) == sum(map(sum, code.matrix))
    grid = [[int((r + border, c + border) in dark) for c in range(side - 2 * border)]
            for r in range(side - 2 * border)]
    assert decode_qr(grid) == (url, code.version, code.error)


def test_the_qr_code_has_a_white_quiet_zone_and_no_outside_reference():
    svg = qr_svg(URLS[0], size_px=240)
    side, dark, paths = svg_modules(svg)
    (background,) = [p for p in paths if p.get("fill")]
    assert background.get("fill") == "#fff" and background.get("d") == f"M0 0h{side}v{side}h-{side}z"
    assert all(join.QR_BORDER <= r < side - join.QR_BORDER and join.QR_BORDER <= c < side - join.QR_BORDER
               for r, c in dark)
    root = ET.fromstring(svg)
    width = int(root.get("width"))
    assert width == int(root.get("height")) and width % side == 0 and abs(width - 240) <= side / 2
    inside = svg.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace's name, never fetched
    for outside in ("<script", "href", "url(", "<image", "<use", "<foreignObject", "<style", "http", "@import"):
        assert outside not in inside, outside
    assert not re.search(r"\son\w+\s*=", inside)  # no event handler attribute


def test_other_urls_give_other_codes():
    assert len({svg_modules(qr_svg(url))[1].__len__() for url in URLS}) > 1
    assert svg_modules(qr_svg(URLS[0]))[1] != svg_modules(qr_svg(URLS[0] + "x"))[1]


# ---- the panel -------------------------------------------------------------------------------------------------
def test_the_panel_escapes_text_and_sends_only_what_changed():
    import gradio as gr
    address = [JoinAddress("https://a.gradio.live/?q=<b>&x", "say <i>hi</i>")]
    people = [3]
    with gr.Blocks():
        panel = join.build_join_panel(lambda: address[0], lambda: people[0])
    assert panel["outputs"] == [panel["url"], panel["qr"], panel["how"], panel["people"]]
    url, qr, how, count = panel["refresh"]()
    assert "&lt;b&gt;&amp;x" in url and "<b>" not in url
    assert "&lt;i&gt;hi" in how and "<i>" not in how
    assert qr.startswith("<svg") and count == "<div>3 people here now</div>"
    sent: dict = {}
    assert not any(v == gr.skip() for v in panel["refresh"](sent))
    assert all(v == gr.skip() for v in panel["refresh"](sent))  # nothing changed: nothing sent
    people[0] = 1
    *same, count = panel["refresh"](sent)
    assert all(v == gr.skip() for v in same) and count == "<div>1 person here now</div>"
    address[0] = JoinAddress("https://b.gradio.live", "the share link came up")
    url, qr, how, count = panel["refresh"](sent)
    assert "b.gradio.live" in url and qr == qr_svg("https://b.gradio.live") and count == gr.skip()


def test_an_address_the_room_cannot_open_gets_no_qr_code():
    url, qr, how, _ = join.join_parts(JoinAddress("http://127.0.0.1:7860/", "only here", room_can_open=False), 0)
    assert "127.0.0.1" in url and qr == ""
    assert join.join_parts(JoinAddress(None, "no network", room_can_open=False), 0)[:2] == \
        ("<div>No address to give yet</div>", "")


# ---- the projector ---------------------------------------------------------------------------------------------
def small_page(view: list, address: list, people: list, every_s: float = 0.5):
    """A page with only the join panel (refreshed by its own clock, as app.py's is) and the projector, every event
    behind the page's gate in public mode: an event not marked audience would be refused to the browser."""
    import gradio as gr

    from playground.access import PUBLIC, Access, audience
    from playground.projector import build_projector
    with gr.Blocks(title="join test") as demo:
        gr.Markdown("The main page")
        panel = join.build_join_panel(lambda: address[0], lambda: people[0])
        clock, sent = gr.Timer(every_s), gr.State({})

        @audience
        def refresh(already: dict):
            now = dict(already)
            return (*panel["refresh"](now), now)
        clock.tick(refresh, sent, [*panel["outputs"], sent], show_progress="hidden", postprocess=False)
    projector = build_projector(demo, lambda: view[0], every_s=every_s)
    access = Access(PUBLIC)
    gated = access.guard(demo, lambda message: gr.Error(message))
    return demo, projector, gated


def chart_spec(title: str) -> dict:
    from viz.figures import figure, scatter
    return figure([scatter(x=[0, 1, 2, 3], y=[3, 1, 4, 1], name="tokens/s")], title=title)


def test_the_projector_is_a_page_of_its_own_that_only_reads():
    from playground.projector import ProjectorView
    view = [ProjectorView("A lesson")]
    demo, projector, gated = small_page(view, [JoinAddress(None, "none")], [0])
    assert gated == []  # every event of the panel's clock and of the projector is the audience's
    assert projector["path"] == "/projector" and ("projector", "Projector", False) in demo.pages
    config = demo.get_config_file()
    main, page = config["page"][""], config["page"]["projector"]
    kinds = {c["id"]: c["type"] for c in config["components"]}
    # nothing of the main page on the projector's, and its events are its own
    assert not set(main["components"]) & set(page["components"])
    assert {kinds[i] for i in page["components"]} <= {"navbar", "html", "markdown", "row", "column", "plot",
                                                       "state", "timer"}
    assert page["dependencies"] and not set(main["dependencies"]) & set(page["dependencies"])
    # neither page shows gradio's bar of pages (a mounted, hidden Navbar on each)
    assert [c["props"]["visible"] for c in config["components"] if c["type"] == "navbar"] == ["hidden", "hidden"]


def test_build_projector_refuses_to_run_inside_the_blocks():
    import gradio as gr

    from playground.projector import build_projector
    with gr.Blocks() as demo, pytest.raises(ValueError, match="after the `with gr.Blocks"):
        build_projector(demo, lambda: None)


def test_projector_values_send_each_part_once_and_the_chart_in_large_type():
    import json

    import gradio as gr

    from playground.projector import PLOT_FONT, PLOT_HEIGHT, ProjectorView, projector_values
    spec = chart_spec("prefix cache")
    view = ProjectorView("Prefix <caching>", "**Look for:** x", "| a |\n|---|\n| 1 |", spec, "before")
    sent: dict = {}
    title, phase, text, numbers, chart = projector_values(view, sent)
    assert title == "<div>Prefix &lt;caching&gt;</div>" and (phase, text) == ("before", "**Look for:** x")
    figure = json.loads(chart["plot"])
    assert figure["layout"]["height"] >= PLOT_HEIGHT and figure["layout"]["font"]["size"] == PLOT_FONT
    assert figure["data"] == spec["data"] and spec["layout"]["height"] < PLOT_HEIGHT  # the shared spec untouched
    assert all(v == gr.skip() for v in projector_values(view, sent))
    moved = ProjectorView(view.title, view.text, "| a |\n|---|\n| 2 |", chart_spec("prefix cache"), "after")
    again = projector_values(moved, sent)
    assert [v == gr.skip() for v in again] == [True, False, True, False, True]  # same chart
    assert projector_values(None, {})[0] == "<div>Waiting for the presenter to start a lesson</div>"


def test_lesson_view_shows_the_running_lesson():
    from playground.course import load_lessons
    from playground.projector import lesson_view
    lesson = load_lessons()[0]
    spec = chart_spec("the lesson's chart")
    assert lesson_view(SimpleNamespace(run=None)) is None
    run = SimpleNamespace(lesson=lesson, result=None)
    asked = []
    runner = SimpleNamespace(run=run, phase_line=lambda: "**before** the switch", result_table=lambda r: "table",
                             chart=lambda shown: asked.append(shown) or spec)
    view = lesson_view(runner)
    assert view.title == lesson.title and view.chart is spec and asked == [lesson]
    assert "Look for:" in view.text and "Question for the room:" in view.text and view.numbers == ""
    assert view.phase == "**before** the switch"
    run.result = {"metric": "x"}
    assert lesson_view(runner).numbers == "table"


# ---- served, in Chromium ---------------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


def pixels_to_grid(png: bytes, side_modules: int) -> list[list[int]]:
    """The modules Chromium drew: each module's centre pixel in a screenshot of the <svg> alone."""
    import io

    from PIL import Image
    image = Image.open(io.BytesIO(png)).convert("L")
    step = image.width / side_modules
    return [[int(image.getpixel((int((c + 0.5) * step), int((r + 0.5) * step))) < 128) for c in range(side_modules)]
            for r in range(side_modules)]


@pytest.mark.slow
@pytest.mark.served
@pytest.mark.skipif(not (os.path.exists(CHROMIUM) or shutil.which("chromium")),
                    reason="no chromium: apt-get install -y chromium")
def test_projector_and_join_panel_in_a_real_browser(browser, tmp_path):
    from playground.page_client import free_port
    from playground.projector import ProjectorView
    view = [ProjectorView("Prefix caching: one system prompt, shared",
                          "**Look for:** the hit rate climbing.\n\n**Question for the room:** how much sooner does "
                          "the first token come?", "", chart_spec("prefix cache hit rate"), "**before** the switch")]
    address = [JoinAddress(f"http://{LAN_IP}:7860/", "This machine's address on its local network.")]
    people = [7]
    demo, _, _ = small_page(view, address, people)
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    assert join.launched_address(demo, env={}) == join_address("127.0.0.1", port, None, env={})
    assert join.launched_address(demo, env={}).url == url
    context = browser.new_context(viewport={"width": 1600, "height": 1200})
    try:
        page = context.new_page()
        page.goto(url + "projector")
        title = page.get_by_text("Prefix caching: one system prompt, shared")
        title.wait_for(timeout=60_000)
        size = title.evaluate("e => parseFloat(getComputedStyle(e).fontSize)")
        assert size >= 28, f"the title is {size}px"
        page.wait_for_function("() => document.querySelectorAll('#projector-chart .main-svg .scatterlayer .trace')"
                               ".length > 0", timeout=60_000)
        text_size = page.locator("#projector-text p").first.evaluate("e => parseFloat(getComputedStyle(e).fontSize)")
        assert text_size >= 24
        # nothing else: no tabs, controls, chat or bar of pages; nothing of the main page
        assert page.evaluate("() => Array.from(document.querySelectorAll('nav, [role=tab], textarea, input, "
                             "#projector button')).filter(e => e.getClientRects().length).length") == 0
        assert page.get_by_text("Join this session").count() == 0
        page.screenshot(path=str(tmp_path / "projector-before.png"), full_page=True)
        # the lesson moves on: the window follows without a reload
        view[0] = ProjectorView(view[0].title, view[0].text, "| | before | after |\n|---|---:|---:|\n"
                                "| time to first token | 120 ms | 41 ms |", view[0].chart, "**done**")
        page.get_by_text("41 ms").wait_for(timeout=30_000)
        page.screenshot(path=str(tmp_path / "projector-after.png"), full_page=True)

        main = context.new_page()
        main.goto(url)
        main.get_by_text("7 people here now").wait_for(timeout=60_000)
        assert main.evaluate("() => document.querySelectorAll('nav').length") == 0  # no bar of pages on top
        assert main.get_by_text(f"http://{LAN_IP}:7860/").count() == 1
        qr = main.locator("#join-qr svg")
        qr.wait_for(timeout=30_000)
        side = len(segno.make(address[0].url, error="m", micro=False).matrix) + 2 * join.QR_BORDER
        grid = pixels_to_grid(qr.screenshot(), side)
        border = join.QR_BORDER
        assert not any(v for row in grid[:border] + grid[-border:] for v in row)  # the quiet zone, drawn white
        assert not any(row[:border] + row[-border:] != [0] * 2 * border for row in grid)
        assert decode_qr([row[border:-border] for row in grid[border:-border]])[0] == address[0].url
        main.screenshot(path=str(tmp_path / "join-panel.png"), full_page=True)
        # people come, and the share link comes up: the panel follows
        people[0] = 31
        address[0] = JoinAddress("https://0123abcd.gradio.live", "gradio's share link (--share).")
        main.get_by_text("31 people here now").wait_for(timeout=30_000)
        main.get_by_text("https://0123abcd.gradio.live").wait_for(timeout=30_000)
        side = len(segno.make(address[0].url, error="m", micro=False).matrix) + 2 * border
        main.wait_for_function("(w) => document.querySelector('#join-qr svg')?.getAttribute('viewBox') === w",
                               arg=f"0 0 {side} {side}", timeout=30_000)
        grid = pixels_to_grid(main.locator("#join-qr svg").screenshot(), side)
        assert decode_qr([row[border:-border] for row in grid[border:-border]])[0] == address[0].url
        main.screenshot(path=str(tmp_path / "join-panel-shared.png"), full_page=True)
    finally:
        context.close()
        demo.close()
