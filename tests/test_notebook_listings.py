"""The chapters' stored source listings show the package as it is. A cell that calls show_source or
show_fragment on a function of mamba_annotated stores the listing its GPU run printed; a later change
to that function leaves the stored listing stale, which the book then shows and which strict nbval
on the GPU fails on, while CI's nbval-lax does not compare outputs. So each stored listing is
compared here with the function's source now."""
import ast
import importlib
import json
import pathlib

import pytest

from mamba_annotated.figures import source_fragment, source_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))


def imported_names(cells) -> dict:
    """{name: object} of every ``from mamba_annotated... import name`` in the chapter's code cells."""
    names = {}
    for tree in cells:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mamba_annotated"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def listings(path):
    """(cell number, the listing the last show_source/show_fragment call of the cell would display now,
    the stored markdown outputs) of each listing cell of a chapter whose function the chapter imports
    from the package (Jupyter displays a cell's last expression only)."""
    nb = json.loads(path.read_text())
    code = [(i, cell) for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"]
    trees = {}
    for i, cell in code:
        try:
            trees[i] = ast.parse("".join(cell["source"]))
        except SyntaxError:  # a cell with IPython syntax holds no listing
            pass
    names = imported_names(trees.values())
    for i, tree in trees.items():
        calls = [node.value for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                 and getattr(node.value.func, "id", None) in ("show_source", "show_fragment")]
        if not calls or calls[-1] is not getattr(tree.body[-1], "value", None):
            continue
        call = calls[-1]
        target = names.get(getattr(call.args[0], "id", None))
        if target is None:  # a function the chapter defines itself
            continue
        anchors = [ast.literal_eval(arg) for arg in call.args[1:]]
        text = source_of(target) if call.func.id == "show_source" else source_fragment(target, *anchors)
        stored = ["".join(out["data"]["text/markdown"]) for out in nb["cells"][i].get("outputs", [])
                  if "text/markdown" in out.get("data", {})]
        yield i, f"```python\n{text}```", stored


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_stored_listing_shows_the_current_source(path):
    checked = 0
    for cell, now, stored in listings(path):
        assert stored == [now], f"{path.name} cell {cell}: the stored listing is not the current source"
        checked += 1
    # the chapters that list package code list some of it through imports (chapter 0 lists none)
    assert checked or path.stem == "00_primer", path.name
