"""A checkpoint's weights by TransformerLens name, read from its safetensors files on demand.

``WeightDiff.from_checkpoints`` forms each Δ tensor from two of these (or from a loaded base
model's parameters and one of these) when it is asked for, so neither model's weights need be
held in memory beyond the one layer being read:

- ``converted(dir, dtype)``: for a ``HookedTransformer`` (TransformerLens 3.9). The Hugging Face
  model is built on the meta device (no memory); to read layer ``l`` its tensors are loaded from
  the files into that skeleton and TransformerLens's own weight-conversion function runs on it
  (every other layer stays on the meta device and converts to nothing). One layer is held.
- ``bridge_views(model, dir)``: for a ``TransformerBridge``, whose TransformerLens parameters are
  views of the Hugging Face tensors it stores: the same view of the file's tensor.

Both read the files ``transformers`` would load, with plain reads that refuse a file changed on
disk since it was opened (``weight_files``). The Δ mapping over them is ``lazy.LazyDeltas``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from extractive_lens.backend.lazy import LazyDeltas as LazyDeltas
from extractive_lens.backend.names import layer_of
from extractive_lens.backend.weight_files import SafetensorsFiles

_LAYER = re.compile(r"\.(\d+)\.")


def _replace(
    module: nn.Module, by_id: Mapping[int, Tensor]
) -> list[tuple[dict[str, Any], str, Any]]:
    """Put ``by_id[id(p)]`` in place of every parameter ``p`` named there, every alias of a tied
    weight included; returns what to put back."""
    saved = []
    for m in module.modules():
        for leaf, t in m._parameters.items():
            if t is not None and id(t) in by_id:
                saved.append((m._parameters, leaf, t))
                m._parameters[leaf] = by_id[id(t)]  # type: ignore[assignment]
    return saved


def hf_layer(name: str) -> int | None:
    """The layer a Hugging Face parameter name belongs to (its first number), or ``None``."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


class Converted(Mapping[str, Tensor]):
    """A Hugging Face checkpoint's weights as ``HookedTransformer`` parameters (module docstring).
    Keys and shapes are known without reading a weight; a value reads its layer (cached: one)."""

    def __init__(self, path: str | Path, dtype: torch.dtype) -> None:
        import transformers

        from extractive_lens.backend.families import family_of, hf_config_to_tl
        from extractive_lens.backend.installed import quiet_transformer_lens, quiet_transformers
        from extractive_lens.backend.loading import refuse_remote_code

        self.path = Path(path)
        refuse_remote_code(self.path)
        with quiet_transformers():
            hf_config = transformers.AutoConfig.from_pretrained(
                self.path, local_files_only=True, trust_remote_code=False
            )
            self.cfg = hf_config_to_tl(hf_config, dtype=dtype)
            with torch.device("meta"):  # the skeleton: no memory
                self.hf = transformers.AutoModelForCausalLM.from_config(hf_config)
        self.hf.eval()
        self._convert = family_of(hf_config).weights
        self._quiet = quiet_transformer_lens
        self.files = SafetensorsFiles(self.path)
        self.dtype = dtype
        missing = [n for n, p in self.hf.named_parameters() if n not in self.files]
        if missing:
            raise ValueError(
                f"{self.path}: the safetensors files lack {len(missing)} tensors the config asks "
                f"for ({', '.join(missing[:3])}): the checkpoint is incomplete."
            )
        # every weight a zero-strided stand-in that takes no memory, until its layer is read
        fakes = {
            id(p): nn.Parameter(torch.zeros((), dtype=dtype).expand(p.shape), requires_grad=False)
            for p in self.hf.parameters()
        }
        _replace(self.hf, fakes)
        self._names = dict(self.hf.named_parameters())
        numbered = next((n for n in self._names if hf_layer(n) is not None), None)
        self._layers: nn.Module | None = None
        if numbered is not None:
            m = _LAYER.search(numbered)
            assert m is not None
            self._layers = self.hf.get_submodule(numbered[: m.start()])
        # the HookedTransformer's own parameter names (a bias a conversion leaves out is zero)
        from transformer_lens import HookedTransformer

        with self._quiet(), torch.device("meta"):
            skeleton = HookedTransformer(self.cfg, move_to_device=False)
        self.shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
        del skeleton
        self._cache: OrderedDict[int | None, dict[str, Tensor]] = OrderedDict()

    def _run(self, layer: int | None) -> dict[str, Tensor]:
        """Convert with the tensors of ``layer`` (``None``: those outside the blocks) read in,
        the conversion seeing that one block only (``n_layers`` 1, or 0 for ``None``)."""
        import copy

        real = {
            id(p): nn.Parameter(self.files.get(n).to(self.dtype), requires_grad=False)
            for n, p in self._names.items()
            if hf_layer(n) == layer
        }
        cfg = copy.copy(self.cfg)
        cfg.n_layers = 0 if layer is None else 1
        blocks = None if self._layers is None else dict(self._layers._modules)
        undo = _replace(self.hf, real)
        try:
            if self._layers is not None and blocks is not None:
                self._layers._modules = {} if layer is None else {"0": blocks[str(layer)]}
            with self._quiet(), torch.no_grad():
                out = self._convert(self.hf, cfg)
        finally:
            if self._layers is not None and blocks is not None:
                self._layers._modules = blocks
            for registry, leaf, t in undo:
                registry[leaf] = t
        if layer is None:
            return {n: t.to(self.dtype) for n, t in out.items() if layer_of(n) is None}
        prefix = "blocks.0."
        return {
            f"blocks.{layer}." + n[len(prefix) :]: t.to(self.dtype)
            for n, t in out.items()
            if n.startswith(prefix)
        }

    def _layer(self, layer: int | None) -> dict[str, Tensor]:
        found = self._cache.get(layer)
        if found is None:
            found = self._run(layer)
            self._cache[layer] = found
            while len(self._cache) > 1:
                self._cache.popitem(last=False)
        return found

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        got = self._layer(layer_of(name)).get(name)
        if got is None:  # a bias the conversion makes as zeros on the meta device
            return torch.zeros(self.shapes[name], dtype=self.dtype)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def signature(self) -> dict[str, Any]:
        """The checkpoint's ``signature``: its weights are as Hugging Face saved them."""
        from extractive_lens.backend import hooked

        sig = hooked.config_signature(self.cfg, self.cfg.original_architecture)
        return {**sig, "processed": False}


class BridgeViews(Mapping[str, Tensor]):
    """A checkpoint's weights as a ``TransformerBridge``'s TransformerLens parameters: each the
    same view (shape, strides, offset) of the file's tensor that the bridge's parameter is of the
    tensor it stores. Parameters the files do not hold (zero biases TransformerLens adds) read as
    the base model's own."""

    def __init__(self, model: Any, path: str | Path) -> None:
        import transformers

        from extractive_lens.backend import bridge
        from extractive_lens.backend.installed import quiet_transformers

        original = getattr(model, "original_model", None)
        if original is None:
            raise ValueError(
                "WeightDiff.from_checkpoints with a TransformerBridge base needs a bridge booted "
                "from a Hugging Face checkpoint (load_checkpoint(dir, backend='bridge')), whose "
                "parameters are views of the Hugging Face tensors the files hold; this one was "
                "built natively. Load the base from its folder, or pass the folder itself."
            )
        with quiet_transformers():
            self.hf_config = transformers.AutoConfig.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
        self.base_hf_config = original.config
        self.model, self.files = model, SafetensorsFiles(path)
        self.params = bridge.parameters(model)
        hf_names: dict[int, list[str]] = {}
        if original is not None:  # always, checked above
            for n, p in original.named_parameters(remove_duplicate=False):
                n = n.replace("._original_component", "").replace("_original_component.", "")
                hf_names.setdefault(p.untyped_storage().data_ptr(), []).append(n)
        self.source: dict[str, str | None] = {}
        for name, t in self.params.items():  # a tensor the files lack (a bias TransformerLens
            # adds; checkpoints are checked complete against their config) is the base's own
            candidates = hf_names.get(t.untyped_storage().data_ptr(), [])
            self.source[name] = next((n for n in candidates if n in self.files), None)

    def __getitem__(self, name: str) -> Tensor:
        t = self.params[name]
        src = self.source[name]
        if src is None:
            return t.detach()
        whole = self.files.get(src)
        storage_numel = t.untyped_storage().nbytes() // t.element_size()
        if whole.numel() != storage_numel:
            raise ValueError(f"{name}: the file's {src} has another shape than the model's.")
        flat = whole.reshape(-1)
        return flat.as_strided(t.size(), t.stride(), t.storage_offset())

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype ``self[name]`` has (the file's), without reading it."""
        src = self.source[name]
        if src is None:
            return self.params[name].dtype
        return self.files.where[src].entries[src][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)
