"""Execute the example notebooks in place, so that their outputs (figures as PNG too) are saved
with them: ``python scripts/execute_notebooks.py [examples/01_quickstart.ipynb ...]``.

CI re-runs every notebook (``make test`` runs nbmake) without writing them back; run this after
changing a notebook and commit the result.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(paths: list[str]) -> None:
    root = Path(__file__).resolve().parent.parent
    notebooks = [Path(p) for p in paths] or sorted((root / "examples").glob("*.ipynb"))
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(
            nb,
            timeout=900,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
        for cell in nb.cells:  # execution counts from 1, no per-run metadata noise in diffs
            cell.metadata.pop("execution", None)
        nbformat.write(nb, path)
        print(f"{path}: {time.perf_counter() - t0:.0f} s, {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main(sys.argv[1:])
