"""One module per score kind: its linearized score and its exact patch values.

A kind module provides (``downstream.py`` is the smallest example):

- ``needs(options) -> set[str]``: what the linear engine must compute for it per chunk
  (``"finetuned"``: a finetuned forward run; ``"finetuned_grad"``: with gradients;
  ``"upstream_grads"``: the resumed ``ŷ'`` pass) and ``capture(options)``: the attention hook
  values the base run must record beyond ``z``;
- ``linear(chunk: LinearChunk) -> [batch, layer, component, pos]``, and
  ``layer_linear(chunk, step: LayerStep, out)``: the same scores one layer at a time, added to
  ``out`` while the layer's values are at hand: in the large-model pass (``runs.layerwise``)
  its forward step (the finetuned rows' values of the layer); in either regime, ``ŷ'`` at one
  of the layer's boundaries as it arrives; ``linear`` then returns ``chunk.swept[kind]``, what
  those steps accumulated;
- ``patch_values(chunk: CausalChunk, layer) -> (Δ heads, Δ MLP)``: what the exact engine adds
  to the stream right after each component of ``layer`` (formed one layer at a time; what every
  layer shares, such as a finetuned run, is kept with ``chunk.cached(key, make)``);
- ``exact(effects) -> scores``: the exact score from the patch's effect on R,
  ``R(patched) - R(unpatched)``, in the contexts named by ``CONTEXTS`` (``"base"``: the base
  model; ``"finetuned_late"``: the layers after the patch finetuned).

A new kind is one module here plus one line in ``KINDS`` (and its name in ``types.ScoreKind``).
``protocols.py`` spells this interface (``Kind``) and what a kind may read of a chunk
(``LinearChunk``, ``CausalChunk``); mypy checks each module in ``KINDS`` and each engine's chunk
against them.
"""

from __future__ import annotations

from extractive_lens.scoring.kinds import downstream, informative, upstream
from extractive_lens.scoring.kinds.protocols import Kind

KINDS: dict[str, Kind] = {
    "informative": informative,
    "upstream": upstream,
    "downstream": downstream,
}
