"""Execute notebooks in place with nbclient (the GPU pipeline's step 2).

usage: python scripts/execute_notebooks.py [--fill-missing | --stored-runs] book/01_sequential_scan.ipynb [...]
Cells run from the book/ folder, as in Jupyter; no timing metadata is written, so a re-run
changes only outputs. The log names the files a notebook wrote in book/data (chapter 8 records its
run in models_training.json): they belong with the executed notebook. It goes by the files'
modification times, so a file another process wrote meanwhile is named too (a chapter executing
on a second GPU from the same tree: chapter 5 was once named for chapter 8's record).

--fill-missing runs every cell (later cells need the state of earlier ones) but writes back only
the outputs of the code cells that had none: the cells a chapter gained since its last GPU run.
The other cells keep their stored outputs. That is for a chapter that grew while the code its
earlier cells run did not change: their stored outputs are still those of a GPU run of the
current code, and the prose that quotes the timings a live benchmark cell printed stays true. The
strict nbval run that follows re-runs every cell against the stored outputs, old and new.

--stored-runs runs only the code cells that read a stored benchmark run (their source names a
``*_bench.json`` of book/data), each after the notebook's first code cell (its imports) and nothing
else, and writes back their outputs alone. Those cells print and plot the files
scripts/gpu_benchmarks.sh writes on a GPU and launch no kernel, so after a benchmark run their
outputs can be brought up to date on any machine; every other cell keeps its GPU outputs. A code
cell that comes right after such a cell (markdown between them aside) and reads a name the cell
before it defines, without defining it itself, runs with it: the primer's roofline figure is drawn
in the cell after the one that reads the runs, from that cell's points.
"""
import ast
import copy
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient


SLOW_CELL_S = 10  # cells that take longer are named in the log, to see where a notebook's time goes


def execute(path: pathlib.Path, fill_missing: bool = False) -> None:
    """Run every cell; the notebook is written back even when a cell fails (the outputs so far, the
    error in its cell), so a failed GPU run can be read. With ``fill_missing`` only the code cells
    that had no outputs get the new ones (module docstring)."""
    nb = nbformat.read(path, as_version=4)
    stored = {i: (cell.outputs, cell.get("execution_count")) for i, cell in enumerate(nb.cells)
              if cell.cell_type == "code" and cell.outputs}
    started = {}

    def on_start(cell, cell_index):
        started[cell_index] = time.time()

    def on_executed(cell, cell_index, execute_reply):
        seconds = time.time() - started.get(cell_index, time.time())
        if seconds > SLOW_CELL_S:
            print(f"  {path.name} cell {cell_index}: {seconds:.0f} s", flush=True)

    client = NotebookClient(nb, timeout=1800, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}},
                            on_cell_start=on_start, on_cell_executed=on_executed)
    data_before = data_files(path)
    try:
        client.execute()
    finally:
        written = sorted(name for name, stamp in data_files(path).items() if data_before.get(name) != stamp)
        if written:  # a chapter's record of its run (chapter 8's models_training.json): it goes with the notebook
            print(f"  {path.name} wrote {', '.join(written)} in data/: keep it with the notebook", flush=True)
        if fill_missing:
            filled = sum(1 for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and i not in stored)
            for i, (outputs, count) in stored.items():
                nb.cells[i].outputs, nb.cells[i].execution_count = outputs, count
            print(f"  {path.name}: outputs written to {filled} cells that had none; {len(stored)} kept", flush=True)
        nbformat.write(nb, path)


def data_files(path: pathlib.Path) -> dict:
    """{name: modification time} of the files in the data/ folder beside the notebook ``path``."""
    folder = path.parent / "data"
    return {f.name: f.stat().st_mtime_ns for f in folder.iterdir() if f.is_file()} if folder.is_dir() else {}


STORED_RUN = "_bench.json"  # in the source of a cell that reads a stored benchmark run


def defined_and_free(source: str) -> tuple[set, set]:
    """(the names a cell's code binds, the names it reads without binding them itself); none for a
    cell that is not plain Python (an IPython magic)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), set()
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return bound, read - bound


def stored_run_groups(nb) -> list[list[int]]:
    """The cells to re-render, in groups that run together: a cell that reads a stored run, then each
    following code cell that reads a name the group defines and does not define it itself."""
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    groups = []
    for position, i in enumerate(code[1:], start=1):
        if STORED_RUN not in nb.cells[i].source:
            continue
        group, defined = [i], defined_and_free(nb.cells[i].source)[0]
        for j in code[position + 1:]:
            bound, free = defined_and_free(nb.cells[j].source)
            if STORED_RUN in nb.cells[j].source or not free & defined:
                break
            group.append(j)
            defined |= bound
        groups.append(group)
    return groups


def render_stored_runs(path: pathlib.Path) -> None:
    """Re-run the cells of ``path`` that read a stored benchmark run, and the cells that draw on
    them, each group after the first code cell in a notebook of its own, and store their outputs
    (module docstring)."""
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
    for group in stored_run_groups(nb):
        # copies: running a cell replaces its outputs, and the import cell keeps its GPU run's; running
        # also rewrites the kernel's language_info, and the notebook keeps its GPU run's
        alone = nbformat.v4.new_notebook(cells=copy.deepcopy([nb.cells[first]] + [nb.cells[i] for i in group]),
                                         metadata=copy.deepcopy(nb.metadata))
        NotebookClient(alone, timeout=600, kernel_name="python3", record_timing=False, allow_errors=False,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        for i, cell in zip(group, alone.cells[1:]):
            nb.cells[i].outputs = cell.outputs
            print(f"  {path.name} cell {i}: outputs re-rendered from the stored run", flush=True)
    nbformat.write(nb, path)


def main(args) -> int:
    fill_missing, stored_runs = "--fill-missing" in args, "--stored-runs" in args
    paths = [a for a in args if a not in ("--fill-missing", "--stored-runs")]
    failed = []
    for name in paths:
        start = time.time()
        try:
            if stored_runs:
                render_stored_runs(pathlib.Path(name))
            else:
                execute(pathlib.Path(name), fill_missing)
            print(f"executed {name} in {time.time() - start:.0f} s", flush=True)
        except Exception as e:  # report every notebook, then fail
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
