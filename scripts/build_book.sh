#!/usr/bin/env bash
# Build the book strictly (any warning fails) and check that every page of _toc.yml came out.
# HTML lands in _build/html. Notebooks are not executed: pages show their stored GPU outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
bash scripts/fetch_mathjax.sh  # MathJax served from the build (a no-op once it is there)
rm -rf _build/html
jupyter-book build . -W -n --keep-going
python - <<'PY'
import pathlib, sys, yaml
def files(entries):  # chapters and their sections, at any depth
    for entry in entries:
        yield entry["file"]
        yield from files(entry.get("sections", []))

toc = yaml.safe_load(open("_toc.yml"))
pages = [toc["root"]] + [page for part in toc["parts"] for page in files(part["chapters"])]
missing = [p for p in pages if not pathlib.Path("_build/html", p + ".html").is_file()]
if not pathlib.Path("_build/html/index.html").is_file():
    missing.append("index")
if missing:
    sys.exit(f"book build: missing pages: {missing}")
print(f"book build: {len(pages)} pages present under _build/html")
PY
