"""Each chapter is authored as a jupytext pair (book/NN_topic.py in percent format + the .ipynb
holding GPU outputs). Fail if a pair disagrees in any cell's type, source or tags, or if either
half is missing."""
import pathlib
import sys

import jupytext


def cells(path):
    nb = jupytext.read(path)
    return [(c.cell_type, c.source.strip(), sorted(c.metadata.get("tags", []))) for c in nb.cells]


def main() -> int:
    book = pathlib.Path(__file__).resolve().parent.parent / "book"
    problems = []
    scripts = {p.stem for p in book.glob("[0-9][0-9]_*.py")}
    notebooks = {p.stem for p in book.glob("[0-9][0-9]_*.ipynb")}
    problems += [f"{s}.py has no .ipynb (run: jupytext --to ipynb book/{s}.py)" for s in sorted(scripts - notebooks)]
    problems += [f"{s}.ipynb has no .py pair" for s in sorted(notebooks - scripts)]
    for stem in sorted(scripts & notebooks):
        py, nb = cells(book / f"{stem}.py"), cells(book / f"{stem}.ipynb")
        if py != nb:
            first = next((i for i, (p, n) in enumerate(zip(py, nb)) if p != n), min(len(py), len(nb)))
            problems.append(f"{stem}: .py and .ipynb differ from cell {first} "
                            f"(run: jupytext --update --to ipynb book/{stem}.py, then re-run the GPU pipeline)")
    for p in problems:
        print("check_pairs:", p, file=sys.stderr)
    if not problems:
        print(f"check_pairs: {len(scripts)} chapter pairs agree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
