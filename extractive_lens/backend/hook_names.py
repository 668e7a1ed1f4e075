"""Which TransformerLens hook holds a component's output: the one table ``types`` reads.

``Component.hook_name`` (public: ``cache[c.hook_name]``) asks this module at call time, so the
vocabulary never spells a TransformerLens string. It imports nothing of the package, so the
question cannot close an import circle (``names.py``, the parameter names, imports ``types``
for ``Component``).

>>> hook_name(3, 1), hook_name(3)
('blocks.3.attn.hook_z', 'blocks.3.hook_mlp_out')
"""

from __future__ import annotations


def hook_name(layer: int, head: int | None = None) -> str:
    """The hook holding the output of head ``head`` of layer ``layer`` (its ``hook_z``, indexed
    ``[:, :, head]``: the head's write into the residual stream is that times ``W_O[head]``), or
    of the layer's MLP (``head=None``: its ``hook_mlp_out``)."""
    if head is None:
        return f"blocks.{layer}.hook_mlp_out"
    return f"blocks.{layer}.attn.hook_z"
