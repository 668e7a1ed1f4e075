"""Progress bars: shown in terminals and notebooks, never in logs; a widget only with ipywidgets."""

from __future__ import annotations

import io
import sys
import warnings

import pytest

from extractive_lens import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_only_where_it_redraws(monkeypatch):
    items = [1, 2, 3]
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file
    assert progress.bar(items, desc="x") is items
    assert progress.bar(items, desc="x", enabled=False) is items
    forced = progress.bar(items, desc="x", enabled=True)
    assert forced is not items and list(forced) == items
    monkeypatch.setattr(sys, "stderr", _Terminal())
    shown = progress.bar(items, desc="scoring")
    assert shown is not items and list(shown) == items
    assert "scoring" in sys.stderr.getvalue()
    assert progress.bar([1], desc="one step") == [1]  # a single step gets no bar


def test_notebook_without_ipywidgets_uses_a_text_bar(monkeypatch):
    from tqdm.std import tqdm as text_bar

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tqdm.auto would warn "IProgress not found"
        shown = progress.bar(range(3), desc="finetune")
        assert type(shown) is text_bar
        assert list(shown) == [0, 1, 2]


@pytest.mark.slow
def test_a_notebook_without_ipywidgets_shows_no_tqdm_warning():
    """In a real Jupyter kernel with ipywidgets blocked: no "IProgress not found" warning (the
    dependencies import tqdm.auto), and finetuning shows a text bar with its loss."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import sys\n"
            "sys.modules['ipywidgets'] = None\n"
            "import extractive_lens as el\n"
            "m = el.load_world_model()\n"
            "facts = el.world.first_hop().batches(m)[0]\n"
            "d = el.finetune(m, facts, el.FinetuneConfig(epochs=2))"
        )
    ]
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    err = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("name") == "stderr")
    assert "TqdmWarning" not in err and "IProgress" not in err, err
    assert "finetune" in err and "loss=" in err
