"""Open every page of a built site in headless Chromium and report what a reader would see broken.

``python tests/_browser.py docs/_build/html`` checks a site built by ``make docs``;
``tests/test_docs.py`` runs the same check on the site it builds. The site is served over
``http://127.0.0.1:PORT`` (Python's ``http.server`` in a thread, loopback only) and one Chromium tab
opens every ``*.html`` page in turn, driven through the DevTools protocol (a websocket; tornado's
client, which ipykernel already brings). Per page it records:

- console errors (``console.error``, uncaught exceptions, the browser's own error log);
- responses of the site with status >= 400, and requests of the site that failed (CSS, JS, fonts,
  images, ...);
- images (``<img>``, figures included) that did not load (``naturalWidth == 0`` once decoded);
- links to the site (``<a href>``) whose target is missing (HTTP 404, or a ``#fragment`` that names
  no element of a page that was opened).

Nothing outside the site is fetched: Chromium resolves every host but 127.0.0.1 to "not found"
(``--host-resolver-rules``), and what fails for that reason (MathJax from its CDN, say) is counted
as external, never as an error. Screenshots (1280x900) of chosen pages are written as PNG.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # nothing leaves the machine
]
VIEWPORT = {"width": 1280, "height": 900}
# Parts of a page a screenshot can show ("PAGE#part"); a notebook page has them once executed.
PARTS = {"listing": "div.cell_output div.highlight-python", "figure": "div.cell_output img",
         "answer": "details.answer"}


def find_chromium() -> str | None:
    """``$RINGATTN_CHROMIUM``, else the first of chromium, chromium-browser, google-chrome on PATH."""
    if os.environ.get("RINGATTN_CHROMIUM"):
        return os.environ["RINGATTN_CHROMIUM"]
    return next(filter(None, map(shutil.which, ["chromium", "chromium-browser", "google-chrome"])), None)


@dataclass
class Report:
    pages: list[str] = field(default_factory=list)           # the pages opened, site-relative
    errors: list[str] = field(default_factory=list)          # "page: what", every problem found
    external: set[str] = field(default_factory=set)          # URLs outside the site, not fetched
    links_checked: int = 0
    screenshots: list[Path] = field(default_factory=list)
    seconds: float = 0.0


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class serve:
    """``with serve(root) as base_url:`` the folder over http://127.0.0.1:PORT/ in a thread."""

    def __init__(self, root: Path):
        handler = functools.partial(_Quiet, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class _DevTools:
    """The DevTools protocol over one websocket: ``await send(method, params, session)``; events
    of a session go to ``on_event(method, params)``."""

    def __init__(self, ws):
        self.ws, self.ids, self.waiting, self.on_event = ws, itertools.count(1), {}, None
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self):
        while (raw := await self.ws.read_message()) is not None:
            msg = json.loads(raw)
            if "id" in msg and msg["id"] in self.waiting:
                self.waiting.pop(msg["id"]).set_result(msg)
            elif "method" in msg and self.on_event:
                self.on_event(msg["method"], msg.get("params", {}))
        for future in self.waiting.values():
            future.set_exception(ConnectionError("Chromium closed the DevTools connection"))

    async def send(self, method, params=None, session=None, timeout=60):
        msg_id = next(self.ids)
        future = self.waiting[msg_id] = asyncio.get_running_loop().create_future()
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.ws.write_message(json.dumps(msg))
        reply = await asyncio.wait_for(future, timeout)  # the reply may already be in
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})


# Run in the page once it has loaded: make lazy images load, wait for every image to decode (or
# fail), then report broken images, the site's links and the page's element ids (link fragments).
_INSPECT = """(async () => {
  const imgs = Array.from(document.images);
  imgs.forEach(img => { img.loading = "eager"; });
  await Promise.all(imgs.map(img => img.decode().catch(() => null)));
  return {
    broken: imgs.filter(img => !img.complete || img.naturalWidth === 0)
                .map(img => img.currentSrc || img.src || img.outerHTML.slice(0, 120)),
    links: Array.from(document.querySelectorAll("a[href]"), a => a.href),
    ids: Array.from(document.querySelectorAll("[id], a[name]"), e => e.id || e.name),
  };
})()"""


async def _check(chromium: str, base: str, pages: list[str], shots: dict[str, Path], report: Report):
    from tornado.websocket import websocket_connect

    profile = tempfile.mkdtemp(prefix="ringattn-chromium-")
    log = tempfile.TemporaryFile()  # Chromium's stderr (a pipe nobody reads could fill and block it)
    proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        for _ in range(300):  # Chromium writes "PORT\n/devtools/browser/ID" once it listens
            if port_file.exists() and len(port_file.read_text().split()) == 2:
                break
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{chromium} exited ({proc.returncode}): {log.read().decode()[-2000:]}")
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"{chromium} did not open its DevTools port within 30 s")
        port, path = port_file.read_text().split()
        ws = await websocket_connect(f"ws://127.0.0.1:{port}{path}", max_message_size=1 << 28)
        cdp = _DevTools(ws)
        target = (await cdp.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        session = (await cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        await _check_pages(cdp, session, base, pages, shots, report)
        await cdp.send("Browser.close")
        ws.close()
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


async def _check_pages(cdp, session, base, pages, shots, report):
    # the page being checked, its requests to the site still running, and every request to the site
    state = {"page": None, "pending": set(), "local": set(), "loaded": asyncio.Event()}
    local = lambda url: url.startswith(base)  # noqa: E731

    def problem(what):
        report.errors.append(f"{state['page']}: {what}")

    def on_event(method, p):
        if method == "Page.loadEventFired":
            state["loaded"].set()
        elif method == "Network.requestWillBeSent":
            if local(p["request"]["url"]):
                state["pending"].add(p["requestId"])
                state["local"].add(p["requestId"])
            elif p["request"]["url"].startswith(("http:", "https:")):  # not data: URLs
                report.external.add(p["request"]["url"])
        elif method == "Network.responseReceived":
            r = p["response"]
            if local(r["url"]) and r["status"] >= 400:
                problem(f"HTTP {r['status']} for {r['url'][len(base):]} ({p.get('type', '?')})")
        elif method in ("Network.loadingFinished", "Network.loadingFailed"):
            state["pending"].discard(p["requestId"])
            if method == "Network.loadingFailed" and not p.get("canceled") and p["requestId"] in state["local"]:
                problem(f"request failed: {p['errorText']} ({p.get('type', '?')})")
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            problem(f"console.{p['type']}: {text[:300]}")
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            problem(f"uncaught: {d.get('exception', {}).get('description', d.get('text'))[:300]}")
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            entry = p["entry"]
            if entry.get("url") and not local(entry["url"]):
                return  # an external resource that was not fetched, on purpose
            if entry.get("source") == "network":
                return  # reported above with its status
            problem(f"browser log: {entry['text'][:300]}")

    cdp.on_event = on_event
    for domain in ("Page", "Runtime", "Log", "Network"):
        await cdp.send(f"{domain}.enable", session=session)
    await cdp.send("Emulation.setDeviceMetricsOverride",
                   {**VIEWPORT, "deviceScaleFactor": 1, "mobile": False}, session=session)

    links: dict[str, str] = {}           # a link to the site, without fragment -> a page linking to it
    fragments: dict[tuple[str, str], str] = {}
    ids: dict[str, set[str]] = {}
    for page in pages:
        state.update(page=page, pending=set())
        state["loaded"].clear()
        await cdp.send("Page.navigate", {"url": base + page}, session=session)
        try:
            await asyncio.wait_for(state["loaded"].wait(), 30)
        except TimeoutError:
            problem("no load event within 30 s")
            continue
        for _ in range(100):  # the site's requests started by scripts after load (search index, ...)
            if not state["pending"]:
                break
            await asyncio.sleep(0.05)
        found = (await cdp.send("Runtime.evaluate", {"expression": _INSPECT, "awaitPromise": True,
                                                     "returnByValue": True}, session=session))
        found = found["result"]["value"]
        for src in found["broken"]:
            problem(f"image did not load: {src[len(base):] if local(src) else src}")
        ids[page] = set(found["ids"])
        for href in found["links"]:
            url, frag = urldefrag(href)
            if local(url):
                target = urlsplit(url[len(base):]).path or "index.html"
                links.setdefault(target, page)
                if frag:
                    fragments.setdefault((target, frag), page)
        report.pages.append(page)
        if page in shots:
            await _screenshot(cdp, session, shots[page], report)
        for part, selector in PARTS.items():  # "PAGE#part": that part of the page, if it has one
            if page + "#" + part in shots and await _scroll_to(cdp, session, selector):
                await _screenshot(cdp, session, shots[page + "#" + part], report)

    opened = set(report.pages)
    for target, page in sorted(links.items()):
        report.links_checked += 1
        if target in opened or target.endswith("/") and target + "index.html" in opened:
            continue
        try:
            urllib.request.urlopen(urllib.request.Request(base + target, method="HEAD"), timeout=10).close()
        except urllib.error.HTTPError as err:
            report.errors.append(f"{page}: link to {target} gives HTTP {err.code}")
    for (target, frag), page in sorted(fragments.items()):
        if target in ids and unquote(frag) not in ids[target]:
            report.errors.append(f"{page}: link to {target}#{frag}: no element with that id")


async def _scroll_to(cdp, session, selector) -> bool:
    js = f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return false; " \
         "if (e.tagName === 'DETAILS') e.open = true; e.scrollIntoView({block: 'start'}); return true; })()"
    found = await cdp.send("Runtime.evaluate", {"expression": js, "returnByValue": True}, session=session)
    await asyncio.sleep(0.2)
    return bool(found["result"].get("value"))


async def _screenshot(cdp, session, path: Path, report: Report):
    shot = await cdp.send("Page.captureScreenshot", {"format": "png"}, session=session)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
    report.screenshots.append(path)


def check_site(root: Path, screenshots: dict[str, Path] | None = None, chromium: str | None = None) -> Report:
    """Open every ``*.html`` under ``root`` in headless Chromium; ``screenshots`` maps a page
    (``"index.html"``) to a PNG path (``"PAGE#listing"``: the page scrolled to its first listing; see
    ``PARTS``)."""
    chromium = chromium or find_chromium()
    if not chromium:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set RINGATTN_CHROMIUM)")
    root = Path(root)
    pages = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html")
                   if p.relative_to(root).parts[0] != "_static")  # the theme's template macros, no pages
    report = Report()
    start = time.perf_counter()
    with serve(root) as base:
        asyncio.run(_check(chromium, base, pages, screenshots or {}, report))
    report.seconds = time.perf_counter() - start
    return report


SCREENSHOTS = ("index.html", "notebooks/03_the_ring.html", "notebooks/03_the_ring.html#listing",
               "notebooks/03_the_ring.html#figure", "notebooks/03_the_ring.html#answer")


def screenshot_paths(folder: Path, pages=SCREENSHOTS) -> dict[str, Path]:
    """``{page: folder/NAME.png}`` for :func:`check_site` (``PAGE#part`` -> ``NAME-part.png``)."""
    def name(page):
        path, _, part = page.partition("#")
        return Path(path).stem + (f"-{part}" if part else "") + ".png"
    return {page: folder / name(page) for page in pages}


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python tests/_browser.py SITE_DIR [PAGE ...]   (e.g. docs/_build/html; PAGEs "
              "or PAGE#part to screenshot besides the index and notebook 03)", file=sys.stderr)
        return 2
    root = Path(argv[0])
    report = check_site(root, screenshot_paths(root.parent / "screenshots", SCREENSHOTS + tuple(argv[1:])))
    print(f"{len(report.pages)} pages, {report.links_checked} links, {len(report.external)} external "
          f"URLs not fetched, {report.seconds:.1f} s; screenshots: {', '.join(map(str, report.screenshots))}")
    print("not fetched:", *sorted(report.external)[:10], sep="\n  ")
    print("\n".join(report.errors) or "no problems")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
