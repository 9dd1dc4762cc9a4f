"""Reductions whose lanes disagree: FMAs that take a warp shuffle's result as their addend.

``tl.sum(a * b, axis)`` ends in butterfly shuffles: each lane adds its partial sum to its
partner's. When a lane holds one product per reduced row, LLVM contracts that first step into
``fma(a_own, b_own, shuffled)``: its own product enters unrounded, the partner's rounded. The two
partners then hold sums that differ in the last bit, where the reduction's result should be one
value held by every lane of the group. Stored through shared memory by several of those lanes (a
layout conversion before the global store), they race: this is every racecheck hazard the SSD and
bidirectional backward kernels showed on an H100 (``sanitize.racecheck_hazards``). The product
rounded first (``triton_ops.rounded_product``, ``tl.fma(a, b, 0.0)`` in place of ``a * b``) leaves
nothing to contract; those kernels use it now, and racecheck reports no hazard in them.

Only FMAs inside ``tl.sum``'s combine count (Triton's standard.py in the chain of inlined calls):
an FMA there can only be the summed product contracted into the addition. A combine of one's own
(``tl.reduce``, the scans' linear recurrences) multiplies values both lanes already hold, so both
compute the same. The scan reads Triton 3.6's PTX (``fma.rn.f32`` on ``%r`` registers).

This scan reads the PTX that Triton keeps in its cache (``$TRITON_CACHE_DIR``, by default
``~/.triton/cache``), so it needs no GPU once a GPU run has filled the cache:

    python scripts/reliability/contraction.py /tmp/tc
"""
import argparse
import collections
import re
import sys
from pathlib import Path

BUTTERFLY = re.compile(r"shfl\.sync\.bfly\.b32\s+(%r\d+),")
FMA = re.compile(r"fma\.rn\.f32\s+%r\d+,\s*\S+,\s*\S+,\s*(%r\d+);")
# ".loc 3 263 15 // standard.py:263:15 @[ standard.py:293:36 @[ chunk_scan_bwd.py:173:46 ] ]": the
# chain of inlined calls, innermost first; Triton's own frames (standard.py) are left out
BARE_LOCATION = re.compile(r"^\s*\.loc\s")
LOCATION = re.compile(r"\.loc\s+\d+\s+\d+\s+\d+\s+//\s+(.*)$")
POSITION = re.compile(r"([\w.]+:\d+):\d+")
TRITON_FRAMES = ("standard.py:", "core.py:", "math.py:")


def shuffled_addends(ptx):
    """{source line: how many FMAs there add a butterfly shuffle's result to a product}, in the
    combine of ``tl.sum`` only (see the module)."""
    found, shuffled, where, in_sum = collections.Counter(), set(), "?", False
    for line in ptx.splitlines():
        if BARE_LOCATION.search(line):  # every .loc moves on, also one that names no call chain
            m = LOCATION.search(line)
            chain = POSITION.findall(m.group(1)) if m else []
            in_sum = any(p.startswith("standard.py:") for p in chain)
            where = " < ".join(p for p in chain if not p.startswith(TRITON_FRAMES)) or "?"
        if m := BUTTERFLY.search(line):
            shuffled.add(m.group(1))
        elif in_sum and (m := FMA.search(line)) and m.group(1) in shuffled:
            found[where] += 1
    return found


def scan(cache_dir):
    """[(kernel, source line, count)] over every PTX file in a Triton cache directory."""
    rows = collections.Counter()
    for path in Path(cache_dir).glob("*/*.ptx"):
        ptx = path.read_text()
        # the kernel's own file is the PTX's first: its folder tells ssd/ from bidirectional/
        first = re.search(r'\.file\s+1\s+"([^"]+)"', ptx)
        kernel = f"{Path(first.group(1)).parent.name}/{path.stem}" if first else path.stem
        for where, n in shuffled_addends(ptx).items():
            rows[(kernel, where)] += n
    return [(kernel, where, n) for (kernel, where), n in sorted(rows.items())]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dirs", nargs="+", help="Triton cache directories")
    args = parser.parse_args(argv)
    rows = [row for d in args.cache_dirs for row in scan(d)]
    for kernel, where, n in rows:
        print(f"{n:5d} FMA with a shuffled addend  {kernel}  ({where})")
    print(f"contraction: {len(rows)} (kernel, line) pairs")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
