"""Open every built page of the book in headless Chromium, offline, and fail on what a reader would see broken.

Usage: python scripts/check_pages.py [--html _build/html] [--width 1200 ...] [--screenshots DIR] [--pages ...]

For the index and every page of _toc.yml, at each viewport width, the page is loaded from file://
with every other request refused (the check proves the pages need no network), every dropdown and
toggled block is opened, and the check fails on:
  - a request that needed the network (refused), or a file of the build that failed to load;
  - a JavaScript exception thrown by the page;
  - a broken image (loaded with naturalWidth 0);
  - MathJax not typesetting the page, a formula left untypeset, or a MathJax error
    (mjx-merror / data-mjx-error elements, undefined macros shown in red);
  - raw LaTeX in the visible text outside code ($$, \\begin{...}, \\frac, \\( ... );
  - a display equation wider than its column (its typeset width, plus its number if any, against
    the width of the block that holds it), or a code listing or cell output wider than its column
    (a <pre> whose scrollWidth exceeds its clientWidth, or whose box runs past the article).
Each failure names the page, the element (the equation's TeX, the listing's first line) and the
widths in CSS pixels. It prints what it checked: pages, display equations, code listings, outputs.

The test command checks two widths. 1200 px is the narrowest window that still shows both
sidebars, where the text column is narrowest on a desktop (624 px); wider windows, and the
one-sidebar layout below 1200 px, give a wider column. 390 px is a phone held upright (a 358 px
column, 326 px inside an admonition): display equations are broken into lines to fit it.

Why this way: Debian's `chromium` package is driven through the Chrome DevTools Protocol over
`--remote-debugging-pipe` (NUL-separated JSON on file descriptors 3 and 4), with nothing but the
standard library and PyYAML (already there for Jupyter Book). Widths can only be measured in a live
layout (`--dump-dom` cannot); Playwright wants to download a browser build of its own, which
cannot be fetched here; Selenium would add a PyPI package and Debian's chromedriver; a websocket
client would add a package and an open port. The pipe needs none of these. Chromium comes from
`apt-get install chromium` (scripts/setup.sh does it when missing and apt is usable); set CHROMIUM
to use another Chromium or Chrome binary.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from base64 import b64decode

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs in the page once it has loaded: waits for images, MathJax and fonts, then measures.
COLLECT_JS = r"""
(async () => {
  // Open what the reader can open (dropdowns, toggled cells, solutions), so it is checked too.
  for (const d of document.querySelectorAll('article details')) d.open = true;
  for (const e of document.querySelectorAll('.toggle-hidden')) e.classList.remove('toggle-hidden');
  const imgs = [...document.images];
  for (const img of imgs) if (img.loading === 'lazy') img.loading = 'eager';
  await Promise.all(imgs.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener('load', done); img.addEventListener('error', done);
  })));
  const maths = document.querySelectorAll('.math');
  let mathjax = 'none needed';
  if (maths.length) {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      await MathJax.startup.promise;
      mathjax = 'typeset';
    } else {
      mathjax = 'not loaded';
    }
  }
  await document.fonts.ready;
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));

  const out = {url: location.href, mathjax, images: 0, broken_images: [], math_errors: [],
               untypeset: [], raw_latex: [], wide: [], equations: 0, listings: 0, outputs: 0};
  const article = document.querySelector('article.bd-article') || document.querySelector('main') || document.body;
  const box = el => {  // content box of el, in viewport coordinates
    const r = el.getBoundingClientRect(), cs = getComputedStyle(el);
    const left = r.left + el.clientLeft + parseFloat(cs.paddingLeft);
    const width = el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    return {left, right: left + width, width};
  };
  const col = box(article);
  const short = s => s.replace(/\s+/g, ' ').trim().slice(0, 90);
  const texOf = el => {
    try {
      const items = MathJax.startup.document.getMathItemsWithin(el);
      if (items.length) return short(items[0].math);
    } catch (e) {}
    return short(el.textContent);
  };

  for (const img of imgs) {
    out.images++;
    if (!img.complete || img.naturalWidth === 0) out.broken_images.push(img.getAttribute('src'));
  }

  // MathJax: every formula typeset, no error nodes, no undefined macro (noundefined shows it red).
  for (const m of maths) {
    if (!m.querySelector('mjx-container')) out.untypeset.push(short(m.textContent));
  }
  for (const e of document.querySelectorAll('mjx-merror, [data-mjx-error]')) {
    out.math_errors.push((e.getAttribute('data-mjx-error') || 'error') + ': ' +
                         texOf(e.closest('.math') || e));
  }
  for (const e of document.querySelectorAll('mjx-container mjx-mtext')) {
    const c = getComputedStyle(e).color;
    if (c === 'rgb(255, 0, 0)') out.math_errors.push('undefined macro in ' + texOf(e.closest('.math') || e));
  }

  // Raw LaTeX in visible text outside code and typeset math.
  const skip = 'pre, code, script, style, textarea, kbd, mjx-container, .highlight, .MathJax';
  const rawPattern = /\$\$|\\(begin|end)\{|\\(frac|sum|prod|mathbf|mathrm|mathcal|operatorname|left|right|cdot|odot|otimes|times|bar|hat|tilde|sqrt|exp|log|alpha|beta|gamma|delta|Delta|sigma|lambda|leq|geq|top|text|quad)(?![a-zA-Z])|\\\(|\\\[|\$[^$\s][^$\n]{0,80}?[\\_^][^$\n]*?\$/;
  const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (!el || el.closest(skip)) continue;
    if (!el.getClientRects().length) continue;  // not rendered
    const m = node.data.match(rawPattern);
    if (m) {
      const at = Math.max(0, m.index - 30);
      out.raw_latex.push(short(node.data.slice(at, m.index + 60)));
    }
  }

  // Display equations: typeset width (plus the equation number) against the block holding it.
  for (const c of document.querySelectorAll('mjx-container[display="true"]')) {
    out.equations++;
    const holder = c.closest('div.math') || c.parentElement;
    const math = c.querySelector('mjx-math') || c;
    const eqno = holder.querySelector(':scope > .eqno');
    const need = math.getBoundingClientRect().width + (eqno ? eqno.getBoundingClientRect().width : 0);
    const have = Math.min(box(holder).width, col.width);
    const spill = Math.max(c.scrollWidth - c.clientWidth, 0);
    if (need > have + 1 || spill > 1) {
      out.wide.push({kind: 'display equation', what: texOf(holder),
                     width: Math.ceil(Math.max(need, c.scrollWidth)), column: Math.floor(have)});
    }
  }

  // Code listings (highlighted source) and cell outputs: no scrolling, nothing past the article.
  for (const pre of article.querySelectorAll('pre')) {
    const isListing = !pre.closest('.cell_output, .output');
    if (isListing) out.listings++; else out.outputs++;
    const r = pre.getBoundingClientRect();
    if (!r.width) continue;  // inside a closed dropdown: not shown
    const scrolls = pre.scrollWidth > pre.clientWidth + 1;
    const past = r.right > col.right + 1 || r.left < col.left - 1;
    if (scrolls || past) {
      out.wide.push({kind: isListing ? 'code listing' : 'cell output',
                     what: short(pre.textContent.split('\n')[0]),
                     width: Math.ceil(Math.max(pre.scrollWidth, r.width)),
                     column: Math.floor(Math.min(pre.clientWidth, col.width))});
    }
  }
  return JSON.stringify(out);
})()
"""


class Chromium:
    """A headless Chromium spoken to over --remote-debugging-pipe (CDP, NUL-separated JSON)."""

    def __init__(self, binary: str):
        self.profile = tempfile.mkdtemp(prefix="check_pages_")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():  # the child's fd 3 reads our commands, fd 4 writes its replies
            a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-quic", "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--no-pings", "--mute-audio", "--hide-scrollbars",
                "--allow-file-access-from-files", f"--user-data-dir={self.profile}", "about:blank"]
        self.log = open(os.path.join(self.profile, "chromium.log"), "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     preexec_fn=wire_fds, close_fds=False)
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._replies: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self.on_event = None
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        buf = b""
        while True:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                self._replies.put(None)
                return
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for raw in messages:
                msg = json.loads(raw)
                if "id" in msg:
                    self._replies.put(msg)
                elif self.on_event:
                    self.on_event(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        with self._lock:
            self._next_id += 1
            msg = {"id": self._next_id, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            os.write(self._to_child, json.dumps(msg).encode() + b"\0")
            return self._next_id

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict:
        want = self.send(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{method}: no reply from Chromium in {timeout:.0f} s")
            try:
                msg = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                self.log.flush()
                tail = pathlib.Path(self.log.name).read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError("Chromium exited; its last words: " + " | ".join(tail))
            if msg["id"] == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def close(self):
        try:
            self.send("Browser.close")
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


class Tab:
    """One page target with the network refused except file: and data: URLs."""

    def __init__(self, browser: Chromium, width: int, height: int = 900):
        self.b = browser
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.loaded = threading.Event()
        self.blocked: list[str] = []
        self.failed: list[str] = []
        self.exceptions: list[str] = []
        self.urls: dict[str, str] = {}
        browser.on_event = self._event
        for method in ("Page.enable", "Network.enable", "Runtime.enable"):
            self.call(method)
        self.call("Fetch.enable", {"patterns": [{"urlPattern": "*"}]})
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def call(self, method, params=None, timeout=60.0):
        return self.b.call(method, params, self.session, timeout)

    def _event(self, msg):
        if msg.get("sessionId") != self.session:
            return
        method, p = msg["method"], msg.get("params", {})
        if method == "Fetch.requestPaused":
            url = p["request"]["url"]
            if url.startswith(("file:", "data:", "blob:")):
                self.b.send("Fetch.continueRequest", {"requestId": p["requestId"]}, self.session)
            else:
                self.blocked.append(url)
                self.b.send("Fetch.failRequest", {"requestId": p["requestId"], "errorReason": "BlockedByClient"},
                            self.session)
        elif method == "Network.requestWillBeSent":
            self.urls[p["requestId"]] = p["request"]["url"]
        elif method == "Network.loadingFailed":
            url = self.urls.get(p["requestId"], "?")
            if url.startswith("file:"):
                self.failed.append(f"{url} ({p.get('errorText')})")
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            text = d.get("exception", {}).get("description") or d.get("text", "")
            self.exceptions.append(text.splitlines()[0] if text else "exception")
        elif method == "Page.loadEventFired":
            self.loaded.set()

    def open(self, url: str, timeout: float = 60.0):
        self.loaded.clear()
        self.call("Page.navigate", {"url": url})
        if not self.loaded.wait(timeout):
            raise TimeoutError(f"{url}: no load event in {timeout:.0f} s")

    def follow_redirect(self, url: str, timeout: float = 30.0):
        """If the page at url redirects (meta refresh), wait until the page it leads to has loaded.
        The redirect can replace the document while a question is being asked (Chromium then
        answers "Inspected target navigated or closed"): every question is asked again until the
        deadline, the first one included."""
        here = f"location.href !== {json.dumps(url)}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not self.evaluate(f"{here} || !!document.querySelector('meta[http-equiv=refresh]')"):
                    return  # no redirect
                if self.evaluate(f"{here} && document.readyState === 'complete'"):
                    return  # redirected, and the new page has loaded
            except RuntimeError:  # the old document went away mid-call
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{url}: redirect did not complete in {timeout:.0f} s")

    def evaluate(self, expression: str, timeout: float = 90.0):
        r = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                           "returnByValue": True}, timeout)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"].get("exception", {}).get("description", r["exceptionDetails"]))
        return r["result"].get("value")

    def screenshot(self, path: pathlib.Path):
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(b64decode(shot["data"]))


def toc_pages(root: pathlib.Path) -> list[str]:
    def files(entries):
        for entry in entries:
            yield entry["file"]
            yield from files(entry.get("sections", []))

    toc = yaml.safe_load((root / "_toc.yml").read_text())
    parts = toc.get("parts") or [{"chapters": toc.get("chapters", [])}]
    return [toc["root"]] + [page for part in parts for page in files(part["chapters"])]


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("check_pages: no Chromium found; install Debian's package (apt-get install chromium) "
             "or set CHROMIUM to a Chromium/Chrome binary")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--html", default=str(ROOT / "_build" / "html"), help="the built book")
    ap.add_argument("--width", type=int, action="append", help="viewport width in CSS px (repeatable; default 1200 and 390)")
    ap.add_argument("--screenshots", help="write a full-page PNG of each page here")
    ap.add_argument("--pages", nargs="+", help="pages to check, relative to --html without .html "
                    "(default: the index and every page of _toc.yml)")
    args = ap.parse_args()
    html = pathlib.Path(args.html).resolve()
    widths = args.width or [1200, 390]
    names = args.pages or ["index"] + toc_pages(ROOT)
    pages = [(p, html / f"{p}.html") for p in names]
    missing = [name for name, path in pages if not path.is_file()]
    if missing:
        print(f"check_pages: pages missing under {html}: {missing} (build the book first)")
        return 1
    if args.screenshots:
        pathlib.Path(args.screenshots).mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    browser = Chromium(find_chromium())
    problems: list[str] = []
    totals = {"equations": 0, "listings": 0, "outputs": 0, "images": 0}
    try:
        for width in widths:
            tab = Tab(browser, width)
            for name, path in pages:
                where = f"{name} @{width}px"
                tab.blocked.clear(); tab.failed.clear(); tab.exceptions.clear()
                try:
                    tab.open(path.as_uri())
                    tab.follow_redirect(path.as_uri())  # the index sends the reader to the first page
                    out = json.loads(tab.evaluate(COLLECT_JS))
                except Exception as e:  # a page that hangs or breaks the browser is a failure too
                    problems.append(f"{where}: could not be checked: {e}")
                    continue
                if args.screenshots:
                    tab.screenshot(pathlib.Path(args.screenshots) / f"{name.replace('/', '_')}_{width}.png")
                found = []
                found += [f"needed the network: {u}" for u in tab.blocked]
                found += [f"failed to load: {u}" for u in tab.failed]
                found += [f"JavaScript error: {e}" for e in tab.exceptions]
                found += [f"broken image: {s}" for s in out["broken_images"]]
                if out["mathjax"] == "not loaded":
                    found.append("MathJax did not load")
                found += [f"formula not typeset: {t}" for t in out["untypeset"]]
                found += [f"MathJax error: {t}" for t in out["math_errors"]]
                found += [f"raw LaTeX in the text: ...{t}..." for t in out["raw_latex"]]
                found += [f"{w['kind']} {w['width']}px wide in a {w['column']}px column: {w['what']}"
                          for w in out["wide"]]
                problems += [f"{where}: {f}" for f in found]
                if width == widths[0] and name != "index":  # the index shows the first page again
                    for key in totals:
                        totals[key] += out[key]
                print(f"check_pages: {where}: {out['equations']} display equations, {out['listings']} code "
                      f"listings, {out['outputs']} outputs, {out['images']} images"
                      + (f" -> {len(found)} problem(s)" if found else ": ok"), flush=True)
    finally:
        browser.close()
    seconds = time.monotonic() - start
    which = "" if args.pages else f" (index + {len(pages) - 1} of _toc.yml)"
    summary = (f"{len(pages)} pages{which} at {', '.join(map(str, widths))} px, "
               f"offline: {totals['equations']} display equations, {totals['listings']} code listings, "
               f"{totals['outputs']} cell outputs, {totals['images']} images, in {seconds:.1f} s")
    if problems:
        print("\n".join(problems))
        print(f"check_pages: FAILED, {len(problems)} problem(s) in {summary}")
        return 1
    print(f"check_pages: all clear in {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
