"""What the commands share: arguments checked before any work is done, and a model loaded by
the name a user types (``world``, a checkpoint directory or a hub name)."""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import typer

DTYPES = ("float32", "float64", "bfloat16", "float16")
SEED_MAX = 2**63 - 1  # torch's generators take a 64-bit seed


def check_seed(seed: int) -> None:
    """``--seed`` is one torch's generators take."""
    if not 0 <= seed <= SEED_MAX:
        raise typer.BadParameter(f"--seed takes a whole number from 0 to 2**63 - 1, got {seed}.")


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


def checkpoint_dir(name_or_dir: str) -> Path | None:
    """The local directory ``load_model`` reads for ``name_or_dir`` (``None``: a bundled world or
    a hub name)."""
    from extractive_lens.world.model import WORLDS

    if name_or_dir == "world" or name_or_dir.removeprefix("world-") in WORLDS:
        return None
    path = Path(name_or_dir).expanduser()
    return path if path.is_dir() else None


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
    if path.is_dir() or (path.suffix == ".gguf" and os.path.lexists(path)):
        try:
            return load_checkpoint(path, dtype=dt, device=device, backend=backend)
        except json.JSONDecodeError as e:  # a bare decoder message names no file: find it
            raise ValueError(_damaged_json(path, e)) from None
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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # TransformerLens appends its whole list of model names: cut there, not mid-list
        first = first.split(". Valid official model names")[0]
        first = first if len(first) <= 200 else first[:200] + "…"
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


def _damaged_json(folder: Path, error: json.JSONDecodeError) -> str:
    """Which JSON file of a checkpoint folder does not parse, in one sentence."""
    for file in sorted(folder.glob("*.json")):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            return (
                f"{file} is not valid JSON ({e}): the checkpoint in {folder} is damaged; "
                "restore the file or save the checkpoint again."
            )
    return f"{folder}: a JSON file of the checkpoint is not valid JSON ({error})."


def out_path(text: str | Path) -> Path:
    """``--out``'s value as a path (a typer ``parser``: it sees the text as typed, and the
    default as it is); an empty one, which ``Path`` would read as the current directory, is
    refused."""
    if isinstance(text, Path):
        return text
    if not text.strip():
        raise typer.BadParameter(
            "--out is empty, which would write into the current directory: name the folder or "
            "file to write (e.g. --out scores), or --out . for the current directory."
        )
    return Path(text)


def check_out_dir(out: Path) -> None:
    """``--out DIR`` must be (or become) a directory: said before any work is done."""
    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"--out {out} is a file; give a directory to write into.")
    _check_writable(out, out)  # the folder itself is written into, when it exists


def check_out_file(out: Path) -> None:
    """``--out FILE`` must be writable where it is: said before any work is done."""
    if out.is_dir():
        raise typer.BadParameter(
            f"--out {out} is a directory; give a file name, e.g. {out}/diff.safetensors."
        )
    _check_writable(out, out.absolute().parent)


def _check_writable(out: Path, folder: Path) -> None:
    """The nearest existing folder at or above ``folder`` is one we may write into."""
    parent = folder.absolute()
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


def refuse_overwriting(outputs: Iterable[Path], inputs: Iterable[tuple[str, Path | None]]) -> None:
    """No file a command writes may be one it reads: said before any work is done.

    ``outputs``: the files written; a name may be a pattern (``scores.*.safetensors``: the files
    a save writes or removes). ``inputs``: ``(option, path)`` pairs, the path a file the command
    reads or a directory whose files it reads (a checkpoint). Symlinks are followed on both
    sides, so ``--out`` naming a link to the data (or the data through a linked folder) is the
    data.
    """
    read: dict[Path, str] = {}
    for option, path in inputs:
        if path is None or not path.exists():
            continue
        if path.is_dir():
            for f in path.iterdir():
                if f.is_file():
                    read.setdefault(f.resolve(), f"{f} (a file of {option} {path})")
        else:
            read.setdefault(path.resolve(), f"{path} ({option})")
    for out in outputs:
        folder, target = out.parent.resolve(), out.resolve()
        for file, given in read.items():
            if file == target or (file.parent == folder and fnmatch.fnmatch(file.name, out.name)):
                raise typer.BadParameter(
                    f"--out {out} would overwrite {given}, an input of this command; "
                    "choose another --out."
                )
