"""What the commands share: arguments checked before any work is done, and a model loaded by
the name a user types (``world``, a checkpoint directory or a hub name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

DTYPES = ("float32", "float64", "bfloat16", "float16")


def check_dtype_device(dtype: str, device: str) -> None:
    """``--dtype`` is a torch float type and ``--device`` exists here."""
    import torch

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise typer.BadParameter(f"--device must be cpu, cuda or cuda:N, got {device!r}.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(
            f"--device {device}: no CUDA GPU is available here; use --device cpu."
        )


def load_model(
    name_or_dir: str, dtype: str = "float32", device: str = "cpu", backend: str = "auto"
) -> Any:
    """``world`` (the bundled default world model; ``world-v2`` / ``world-v3`` by name), a local
    checkpoint directory, or a hub name."""
    import torch

    from extractive_lens.model import load_checkpoint, load_pretrained

    check_dtype_device(dtype, device)
    if backend not in ("auto", "hooked", "bridge"):
        raise typer.BadParameter(f"--backend must be auto, hooked or bridge, got {backend!r}.")
    from extractive_lens.backend.installed import has_hooked, version

    if backend == "hooked" and not has_hooked():
        raise typer.BadParameter(
            f"--backend hooked needs TransformerLens 3.9 (this is {version()}, which has no "
            "HookedTransformer): use --backend auto or bridge, or pip install 'transformer-lens>=3.9,<4'."
        )
    dt = getattr(torch, dtype)
    from extractive_lens.world.model import WORLDS

    if name_or_dir == "world" or name_or_dir.removeprefix("world-") in WORLDS:
        from extractive_lens.world import load_world_model

        which = None if name_or_dir == "world" else name_or_dir.removeprefix("world-")
        return load_world_model(which, device=device, dtype=dt, backend=backend)
    if name_or_dir.startswith("world-") and not Path(name_or_dir).exists():
        raise typer.BadParameter(
            f"unknown bundled world {name_or_dir!r}: use world (the default, v3), world-v2 or world-v3."
        )
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return load_checkpoint(path, dtype=dt, device=device, backend=backend)
    if name_or_dir.startswith((".", "/", "~")) or (
        path.parent != Path(".") and path.parent.is_dir()
    ):
        raise FileNotFoundError(
            f"{name_or_dir}: no such checkpoint directory (and it looks like a local path, "
            "not a hub name). Check the path; a checkpoint directory holds config.json."
        )
    try:
        return load_pretrained(name_or_dir, dtype=dt, device=device, backend=backend)
    except (ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{name_or_dir!r} is neither 'world', a local checkpoint directory nor a model "
            f"TransformerLens can load from the hub ({first})."
        ) from None


def load_batch(model: Any, data: Path) -> Any:
    """``--data FILE`` as a batch for ``model``; a bad file is a usage error."""
    from extractive_lens import make_batch
    from extractive_lens.datasets import load_pairs

    try:
        return make_batch(model, load_pairs(data))
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None


def check_out_dir(out: Path) -> None:
    """``--out DIR`` must be (or become) a directory: said before any work is done."""
    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"--out {out} is a file; give a directory to write into.")
    _check_parent(out)


def check_out_file(out: Path) -> None:
    """``--out FILE`` must be writable where it is: said before any work is done."""
    if out.is_dir():
        raise typer.BadParameter(
            f"--out {out} is a directory; give a file name, e.g. {out}/diff.safetensors."
        )
    _check_parent(out)


def _check_parent(out: Path) -> None:
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise typer.BadParameter(f"--out {out}: {parent} is a file, not a directory.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"--out {out}: {parent} is not writable; choose another place.")


def int_list(text: str, option: str) -> list[int]:
    """``"0,3"`` -> ``[0, 3]``; anything else is a usage error naming ``option``."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"{option} takes integers like '0,3', got {text!r}") from None
