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


def execute(path: pathlib.Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=1800, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
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
