#!/usr/bin/env bash
# Vendor MathJax 3 into book/_static/mathjax (ignored by git) so the built pages typeset their math
# from a file inside _build/html, with no CDN: a reader offline sees equations, not raw LaTeX.
# _config.yml points Sphinx's mathjax_path at mathjax/tex-chtml.js inside book/_static.
# Safe to run again: does nothing when the pinned version is already there.
#
# Kept from the package: the tex-chtml component, its CommonHTML fonts (woff-v2), the TeX
# extensions the autoloader fetches on first use (\boldsymbol, \cancel, \color, ...), the
# menu and assistive-MathML modules, and the licence. Not kept: the speech rule engine and the
# other combined components (about 20 MB the book never loads).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.2.2
SHA256=1b9c0a1c44df864e915690558e72adb9cc5203360daefd385084ced3b6c64c09  # mathjax-3.2.2.tgz
DEST=book/_static/mathjax

if [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ] && [ -f "$DEST/tex-chtml.js" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the package's tarball straight from the npm registry (no npm needed), checked against the pin
python3 -c "import sys, urllib.request; open(sys.argv[2], 'wb').write(urllib.request.urlopen(sys.argv[1], timeout=120).read())" \
  "https://registry.npmjs.org/mathjax/-/mathjax-$VERSION.tgz" "$tmp/mathjax-$VERSION.tgz"
echo "$SHA256  $tmp/mathjax-$VERSION.tgz" | sha256sum -c --quiet -
tar -xzf "$tmp/mathjax-$VERSION.tgz" -C "$tmp"
es5="$tmp/package/es5"
rm -rf "$DEST"
mkdir -p "$DEST/input/tex" "$DEST/output/chtml" "$DEST/a11y"
cp "$es5/tex-chtml.js" "$DEST/"
cp -r "$es5/input/tex/extensions" "$DEST/input/tex/"
cp -r "$es5/output/chtml/fonts" "$DEST/output/chtml/"
cp "$es5/a11y/assistive-mml.js" "$DEST/a11y/"
cp -r "$es5/ui" "$DEST/"
cp "$tmp/package/LICENSE" "$DEST/"
echo "$VERSION" > "$DEST/VERSION"
echo "fetch_mathjax: MathJax $VERSION in $DEST ($(du -sh "$DEST" | cut -f1))"
