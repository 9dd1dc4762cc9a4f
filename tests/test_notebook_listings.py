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

from mamba_annotated.figures import listing_of, source_fragment

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


def code_cells(path):
    """(notebook, {cell number: parsed source}) of a chapter's code cells (a cell with IPython syntax,
    which holds no listing, is left out)."""
    nb = json.loads(path.read_text())
    trees = {}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            try:
                trees[i] = ast.parse("".join(cell["source"]))
            except SyntaxError:
                pass
    return nb, trees


def listing_calls(tree):
    """The show_source/show_fragment calls made as statements of a cell, in order."""
    return [node.value for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) in ("show_source", "show_fragment")]


def listings(path):
    """(cell number, the listing the cell's show_source/show_fragment call would display now, the
    stored markdown outputs) of each listing cell of a chapter whose functions the chapter imports
    from the package."""
    nb, trees = code_cells(path)
    names = imported_names(trees.values())
    for i, tree in trees.items():
        calls = listing_calls(tree)
        if not calls or calls[-1] is not getattr(tree.body[-1], "value", None):
            continue
        call = calls[-1]
        targets = [names.get(getattr(arg, "id", None)) for arg in
                   (call.args if call.func.id == "show_source" else call.args[:1])]
        if None in targets:  # a function the chapter defines itself
            continue
        if call.func.id == "show_source":
            text = listing_of(*targets)
        else:
            text = source_fragment(targets[0], *(ast.literal_eval(arg) for arg in call.args[1:]))
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


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_listing_call_is_its_cells_last_expression(path):
    """Jupyter displays only a cell's last expression: a show_source or show_fragment before it is
    computed and thrown away, and the reader never sees that listing (show_source takes several
    functions for one cell)."""
    _, trees = code_cells(path)
    for i, tree in trees.items():
        for call in listing_calls(tree):
            assert call is getattr(tree.body[-1], "value", None), (
                f"{path.name} cell {i}: {ast.unparse(call)} is not the cell's last expression, so it is never shown")
