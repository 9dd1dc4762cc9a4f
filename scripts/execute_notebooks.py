"""Execute notebooks in place with nbclient (the GPU pipeline's step 2).

usage: python scripts/execute_notebooks.py book/01_sequential_scan.ipynb [...]
Cells run from the book/ folder, as in Jupyter; no timing metadata is written, so a re-run
changes only outputs.
"""
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient


SLOW_CELL_S = 10  # cells that take longer are named in the log, to see where a notebook's time goes


def execute(path: pathlib.Path) -> None:
    """Run every cell; the notebook is written back even when a cell fails (the outputs so far, the
    error in its cell), so a failed GPU run can be read."""
    nb = nbformat.read(path, as_version=4)
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
    try:
        client.execute()
    finally:
        nbformat.write(nb, path)


def main(paths) -> int:
    failed = []
    for name in paths:
        start = time.time()
        try:
            execute(pathlib.Path(name))
            print(f"executed {name} in {time.time() - start:.0f} s", flush=True)
        except Exception as e:  # report every notebook, then fail
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
