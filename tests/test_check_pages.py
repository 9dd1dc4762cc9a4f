"""scripts/check_pages.py catches each kind of broken page it promises to, and passes a clean one.

Runs the real check (headless Chromium, offline) on small pages written here, with the MathJax that
scripts/fetch_mathjax.sh vendors; skipped where Chromium or that MathJax is missing.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATHJAX = ROOT / "book" / "_static" / "mathjax"
CHROMIUM = next((shutil.which(n) for n in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser",
                                             "google-chrome") if n and shutil.which(n)), None)

pytestmark = pytest.mark.skipif(not CHROMIUM or not (MATHJAX / "tex-chtml.js").is_file(),
                                reason="needs chromium and book/_static/mathjax (scripts/setup.sh)")

HEAD = """<!DOCTYPE html><html><head><meta charset="utf-8">
<style>body {{ margin: 0 }} article.bd-article {{ width: 400px; margin: 20px }}</style>{extra}</head>
<body><article class="bd-article">{body}</article></body></html>"""
WITH_MATHJAX = '<script defer src="_static/mathjax/tex-chtml.js"></script>'

PAGES = {
    "clean": (WITH_MATHJAX, r'<p>Inline <span class="math">\(a_t\)</span>.</p>'
                            r'<div class="math">\[h_t = a_t h_{t-1} + b_t\]</div>'
                            '<div class="highlight"><pre>short = 1</pre></div>'),
    "broken_image": ("", '<img src="no_such_image.png" alt="x">'),
    "math_error": (WITH_MATHJAX, r'<div class="math">\[x^2^3\]</div>'),
    "untypeset": (WITH_MATHJAX, r'<div class="math">\[\frac{a}{b\]</div>'),
    "undefined_macro": (WITH_MATHJAX, r'<div class="math">\[\nosuchmacro{x}\]</div>'),
    "raw_latex": ("", r"<p>Here $$\frac{a}{b}$$ was never typeset.</p>"),
    "wide_equation": (WITH_MATHJAX, '<div class="math">\\[' + " + ".join(f"x_{{{i}}}" for i in range(60))
                      + "\\]</div>"),
    "wide_listing": ("", '<div class="highlight"><pre>' + "x = 1 + " * 80 + "1</pre></div>"),
    "network": ('<script src="http://127.0.0.1:9/remote.js"></script>', "<p>needs a remote script</p>"),
}
EXPECT = {
    "broken_image": "broken image: no_such_image.png",
    "math_error": "MathJax error: Double exponent",
    "untypeset": r"formula not typeset: \[\frac{a}{b\]",
    "undefined_macro": r"MathJax error: undefined macro in \nosuchmacro{x}",
    "raw_latex": "raw LaTeX in the text",
    "wide_equation": "display equation",
    "wide_listing": "code listing",
    "network": "needed the network: http://127.0.0.1:9/remote.js",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    html = tmp_path_factory.mktemp("html")
    shutil.copytree(MATHJAX, html / "_static" / "mathjax")
    for name, (extra, body) in PAGES.items():
        (html / f"{name}.html").write_text(HEAD.format(extra=extra, body=body))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_pages.py"), "--html", str(html),
                          "--width", "1200", "--pages", *PAGES], capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout + run.stderr


def test_clean_page_passes(report):
    code, out = report
    assert code == 1, out  # the broken pages fail the run
    assert "check_pages: clean @1200px: 1 display equations, 1 code listings, 0 outputs, 0 images: ok" in out, out


@pytest.mark.parametrize("page", sorted(EXPECT))
def test_each_breakage_is_reported(report, page):
    _, out = report
    lines = [line for line in out.splitlines() if line.startswith(f"{page} @1200px: ")]
    assert any(EXPECT[page] in line for line in lines), out
