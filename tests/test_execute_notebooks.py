"""scripts/execute_notebooks.py --stored-runs: only the cells that read a stored benchmark run are
re-run (each after the first code cell), and every other cell keeps the outputs it had."""
import json
import pathlib
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import execute_notebooks  # noqa: E402


def stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_stored_runs_rerenders_only_the_cells_that_read_a_benchmark_file(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "toy_bench.json").write_text(json.dumps({"ms": 1.25}))
    # the import cell prints: its stored (GPU) output must survive its re-run beside the benchmark cell
    cells = [nbformat.v4.new_code_cell("import json\nimport pathlib\nMARK = 'imports ran'\nprint('this machine')",
                                       outputs=[stream("the GPU machine\n")]),
             # a GPU cell: were it run here it would raise, and its stored output must stay
             nbformat.v4.new_code_cell("raise RuntimeError('a GPU cell must not run')",
                                       outputs=[stream("gpu output\n")]),
             nbformat.v4.new_code_cell('print(MARK, json.loads(pathlib.Path("data/toy_bench.json").read_text())["ms"])',
                                       outputs=[stream("stale 0.5\n")])]
    path = tmp_path / "toy.ipynb"
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": kernel}), path)
    assert execute_notebooks.main(["--stored-runs", str(path)]) == 0
    nb = nbformat.read(path, as_version=4)
    assert [o["text"] for o in nb.cells[2].outputs] == ["imports ran 1.25\n"]
    assert [o["text"] for o in nb.cells[1].outputs] == ["gpu output\n"]
    assert [o["text"] for o in nb.cells[0].outputs] == ["the GPU machine\n"]
