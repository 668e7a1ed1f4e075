"""The doctest namespace: the module docstrings' examples run on the bundled world model.

``pytest --doctest-modules extractive_lens`` gives every docstring these names: ``model`` /
``base`` (the world model), ``finetuned`` (a small seeded change of it), ``diff``, ``batch`` (four
first-hop implications), ``scores`` / ``linear`` (linear scores), ``exact`` (causal scores) and
``torch``. Built once per session, in about ten seconds on a laptop CPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest

TORCH_THREADS = 1
"""Torch threads for the whole run (tests and doctests). The models are tiny: a second thread
buys nothing, and on a loaded 2-core machine it made scoring 20-100x slower (threads spinning
against each other and the other jobs). ``EL_TORCH_THREADS=N`` overrides it."""


def pytest_configure(config: pytest.Config) -> None:
    import os

    import torch

    torch.set_num_threads(int(os.environ.get("EL_TORCH_THREADS", TORCH_THREADS)))


@pytest.fixture(scope="session")
def _doctest_objects():
    import torch

    from extractive_lens import WeightDiff, causal_scores, linear_scores
    from extractive_lens.world import first_hop, load_world_model

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    base = load_world_model()
    finetuned = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in finetuned.named_parameters():
            if ".mlp." in name or ".attn." in name:
                p.add_(1e-3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    diff = WeightDiff.from_models(base, finetuned)
    _, impls = first_hop().batches(base)
    batch = impls.subset(range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linear = linear_scores(base, diff, batch)
        exact = causal_scores(base, diff, batch)
    return dict(torch=torch, model=base, base=base, finetuned=finetuned, diff=diff, batch=batch,
                scores=linear, linear=linear, exact=exact)  # fmt: skip


@pytest.fixture(autouse=True)
def _add_doctest_names(request, doctest_namespace):
    if request.node.__class__.__name__ == "DoctestItem":
        doctest_namespace.update(request.getfixturevalue("_doctest_objects"))
