"""Executes every notebook in notebooks/ top to bottom with nbclient (a failing cell fails the test)."""

import glob
import os
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
TIMEOUT_S = 300  # per cell; each notebook takes well under a minute on 2 CPU cores


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    import ipykernel  # noqa: F401  (the test extra installs all four; a missing one is a failure, not a skip)
    import matplotlib  # noqa: F401
    import nbclient
    import nbformat

    # the kernel inherits this environment: make the repo importable even without `pip install -e .`
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    print(f"{os.path.basename(path)}: {elapsed:.1f} s")


def test_notebooks_exist():
    names = {os.path.basename(p) for p in NOTEBOOKS}
    assert {"01_generation_walkthrough.ipynb", "02_attention_anatomy.ipynb"} <= names, names
