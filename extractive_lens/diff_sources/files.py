"""A ``WeightDiff`` file: one ``.safetensors`` file (never pickle) holding Δ, the architecture
signature and the metadata; a low-rank diff (``from_peft``) keeps its factors (version 2).

``read`` is a source like the others (``WeightDiff.load``); ``write`` is ``WeightDiff.save``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from extractive_lens.backend import lowrank
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.diff_sources import Parts

FORMAT_VERSION = 2
LOW_RANK_VERSION = 2
"""Files of a low-rank diff (``from_peft``) hold its factors and are version 2; others are 1."""
_FORMAT = "extractive_lens.WeightDiff"


def write(
    deltas: Mapping[str, Tensor],
    signature: Mapping[str, Any],
    metadata: Mapping[str, Any],
    path: str | Path,
) -> Path:
    """Write Δ, its signature and metadata to a ``.safetensors`` file (never pickle), atomically: an
    interrupted save leaves the previous file whole (the next save removes the hidden temporary
    it left); an overwritten file keeps its mode. Δ is written one tensor at a time (a diff
    formed on demand is never held whole)."""
    from extractive_lens.files import replacing, save_safetensors

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; WeightDiff.save writes one .safetensors file.")
    tensors = None
    version = 1
    if isinstance(deltas, LowRankDeltas):  # the factors, not their product
        tensors, layout = lowrank.to_file(deltas)
        version = LOW_RANK_VERSION
    meta = {
        "format": _FORMAT,
        "format_version": str(version),
        "signature": json.dumps(dict(signature)),
        "metadata": json.dumps(dict(metadata), default=str),
    }
    with replacing(path) as tmp:  # the old file stays whole until the new one is complete
        if tensors is not None:
            meta["low_rank"] = json.dumps(layout)
        save_safetensors(deltas if tensors is None else tensors, tmp, metadata=meta)
    return path


FIX = (
    "pass a file written by WeightDiff.save() or `extractive-lens finetune --out` (save the "
    "diff again if it was damaged)."
)


def read(path: str | Path, *, device: str | torch.device = "cpu") -> Parts:
    """The parts of a diff ``write`` wrote: a source like the others (``WeightDiff.load``).

    Read through the file layer (``extractive_lens.files.SafetensorsFile``): each tensor is
    copied out of the file as it is read and moved to ``device`` before the next is read, so
    the loaded diff shares nothing with the file (truncating it or copying another diff over
    it later changes nothing loaded) and the host holds one tensor beyond what is kept."""
    from extractive_lens.files import SafetensorsFile

    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} is a directory: pass a .safetensors file written by WeightDiff.save() or "
            "`extractive-lens finetune --out`."
        )
    with SafetensorsFile(path, fix=FIX) as f:
        meta = f.metadata
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a WeightDiff file written by WeightDiff.save().")
        deltas: Mapping[str, Tensor] = {name: f.read_tensor(name).to(device) for name in f.entries}
    version = meta.get("format_version")
    if version is None or not version.isdigit() or int(version) > FORMAT_VERSION:
        raise ValueError(
            f"{path} has WeightDiff format version {version!r}; this extractive_lens reads versions "
            f"up to {FORMAT_VERSION}. Upgrade extractive_lens or re-save the diff."
        )
    try:
        signature = json.loads(meta["signature"])
        metadata = json.loads(meta.get("metadata", "{}"))
    except (KeyError, json.JSONDecodeError):
        raise ValueError(
            f"{path}: the architecture signature is missing or not JSON; the file is damaged."
        ) from None
    if not isinstance(signature, dict) or not isinstance(metadata, dict):
        raise ValueError(
            f"{path}: the signature and metadata must be JSON objects; the file is damaged."
        )
    if "low_rank" in meta:
        try:
            deltas = lowrank.from_file(deltas, json.loads(meta["low_rank"]))
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the low-rank factors are damaged ({e}).") from None
    return Parts(deltas, signature, metadata)
