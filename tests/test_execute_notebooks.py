"""scripts/execute_notebooks.py --stored-runs: only the cells that read a stored benchmark run are
re-run (each after the first code cell), and every other cell keeps the outputs it had. An execution
names the files the notebook wrote in its data/ folder."""
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


def test_stored_runs_rerenders_the_cells_that_draw_on_a_stored_run_cell(tmp_path):
    """The primer draws its roofline in the cell after the one that reads the runs, from that cell's
    variables: the drawing must be re-rendered with it, and a later cell that binds the same name
    itself (a GPU cell) must keep its outputs."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "toy_bench.json").write_text(json.dumps({"ms": 1.25}))
    cells = [nbformat.v4.new_code_cell("import json\nimport pathlib"),
             nbformat.v4.new_code_cell('ms = json.loads(pathlib.Path("data/toy_bench.json").read_text())["ms"]\nprint(ms)',
                                       outputs=[stream("0.5\n")]),
             nbformat.v4.new_markdown_cell("The figure:"),
             nbformat.v4.new_code_cell("half = ms / 2\nprint('drawn', half)", outputs=[stream("drawn 0.25\n")]),
             nbformat.v4.new_code_cell("print('drawn again', half)", outputs=[stream("drawn again 0.25\n")]),
             nbformat.v4.new_code_cell("ms = 1 / 0\nprint(ms)", outputs=[stream("gpu output\n")])]
    path = tmp_path / "toy.ipynb"
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": kernel}), path)
    assert execute_notebooks.main(["--stored-runs", str(path)]) == 0
    nb = nbformat.read(path, as_version=4)
    assert [[o["text"] for o in nb.cells[i].outputs] for i in (1, 3, 4, 5)] == [
        ["1.25\n"], ["drawn 0.625\n"], ["drawn again 0.625\n"], ["gpu output\n"]]


def test_execution_names_the_data_files_a_notebook_wrote(tmp_path, capsys):
    """A chapter that records its run in data/ (chapter 8's models_training.json) must have that file
    kept with the notebook; a device run that copies back the notebook alone loses it, so the
    execution says which files were written, and says nothing when none was."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "old.json").write_text("{}")
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    writes = tmp_path / "writes.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        'import pathlib\npathlib.Path("data/record.json").write_text("{}")')], metadata={"kernelspec": kernel}), writes)
    quiet = tmp_path / "quiet.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")],
                                            metadata={"kernelspec": kernel}), quiet)
    assert execute_notebooks.main([str(writes)]) == 0
    assert "writes.ipynb wrote record.json in data/" in capsys.readouterr().out
    assert execute_notebooks.main([str(quiet)]) == 0
    assert " wrote " not in capsys.readouterr().out
