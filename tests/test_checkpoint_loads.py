"""``load_checkpoint(folder)`` reads a Hugging Face checkpoint's weights through the file layer
(``backend/weight_files.py``: ``hf_model``): a weight file truncated or rewritten in place by
another process while the model loads is refused in one sentence naming it, never a SIGBUS (a
map of a file cut short) and never a model holding a mix of two versions; both backends, one
weight file and a sharded set; ``load_pretrained`` of a folder too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from extractive_lens.backend.installed import has_hooked

transformers = pytest.importorskip("transformers")
ROOT = str(Path(__file__).resolve().parents[1])
BACKENDS = ["hooked", "bridge"] if has_hooked() else ["bridge"]  # TransformerLens 4: bridges


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama checkpoint saved as one file and as three shards (with its index)."""
    from tests import lora_models as LM

    root = tmp_path_factory.mktemp("checkpoint_loads")
    hf = LM.base_checkpoint("llama", root / "single").float()
    hf.save_pretrained(root / "sharded", max_shard_size="60KB")
    LM.save_tokenizer(root / "sharded")
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 1
    return {"single": root / "single", "sharded": root / "sharded"}


# One child process; each case (backend, entry point, layout, attack) in a forked grandchild,
# so that a SIGBUS ends that case only and is reported as a signal. The weight files are changed by another process (a
# shell's truncate, or a write in place as cp does) as transformers reads the first weight
# (``_materialize_copy``, in its loading threads): after every file is open, before most of
# them are read.
CHANGED_DURING_THE_LOAD = """
import os, shutil, subprocess, sys
import torch
torch.set_num_threads(1)
import transformers.core_model_loading as C
from extractive_lens import load_checkpoint, load_pretrained

root, cases = sys.argv[1], sys.argv[2:]
real = C._materialize_copy

def change(folder, attack):
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            path = os.path.join(folder, f)
            if attack in ("truncated", "checked"):
                subprocess.run(["truncate", "-s", "64", path], check=True)
            else:  # the same size, other bytes, written in place past the header
                size = os.path.getsize(path)
                with open(path, "r+b") as out:
                    out.seek(size // 2)
                    out.write(bytes(size - size // 2))

def run(backend, entry, layout, attack):
    folder = os.path.join(root, f"{backend}-{entry}-{layout}-{attack}")
    shutil.copytree(os.path.join(root, layout), folder)

    def change_then_read(tensor, device=None, dtype=None):
        # "checked": as the check before the load asks for its first tensor (on the meta
        # device: it reads none; transformers' own check read them all through its map)
        if ("meta" not in str(device) or attack == "checked") and not changed:
            changed.append(True)
            change(folder, attack)
        return real(tensor, device, dtype)

    changed = []
    C._materialize_copy = change_then_read
    try:
        {"load_checkpoint": load_checkpoint, "load_pretrained": load_pretrained}[entry](
            folder, backend=backend
        )
    except ValueError as e:
        print(case, "REFUSED", str(e).replace(chr(10), " "), flush=True)
        return
    except Exception as e:
        print(case, "ERROR", type(e).__name__, str(e)[:300].replace(chr(10), " "), flush=True)
        return
    print(case, "LOADED" if changed else "UNCHANGED", flush=True)

for case in cases:
    pid = os.fork()
    if pid == 0:
        try:
            run(*case.split(":"))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        print(case, "SIGNAL", os.WTERMSIG(status), flush=True)
"""

CASES = [f"{backend}:{case}" for backend in BACKENDS for case in
         [f"load_checkpoint:{layout}:{attack}" for layout in ("single", "sharded")
          for attack in ("truncated", "rewritten")]
         + ["load_pretrained:single:truncated", "load_checkpoint:single:checked"]]  # fmt: skip


@pytest.mark.skipif(
    shutil.which("truncate") is None or not hasattr(os, "fork"),
    reason="needs coreutils' truncate and fork",
)
def test_a_checkpoint_changed_while_it_loads_is_refused_by_name(folders, tmp_path):
    """Before, transformers memory-mapped the weight files: a file cut short while it loaded
    killed the process with SIGBUS (exit -7), and one rewritten in place gave a model holding
    the old bytes' weights and the new ones', silently."""
    for layout, folder in folders.items():
        shutil.copytree(folder, tmp_path / layout)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", CHANGED_DURING_THE_LOAD, str(tmp_path), *CASES],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    said = run.stdout + run.stderr[-2000:]
    assert run.returncode == 0, said
    got = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert sorted(got) == sorted(CASES), said
    for case, what in got.items():
        assert not what.startswith("SIGNAL"), f"{case}: died with {what}\n{said}"
        assert what.startswith("REFUSED"), f"{case}: {what}"
        folder = tmp_path / case.replace(":", "-")
        if case.endswith("checked"):  # cut before the load opened it: a damaged file
            assert f"{folder}/model.safetensors is not a valid safetensors file" in what, what
            continue
        assert f"{folder}/model" in what and ".safetensors changed on disk" in what, what
        assert "load the checkpoint again" in what, what


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_the_bridge_is_the_one_boot_transformers_makes_of_the_folder(folders, layout):
    """The bridge of a model whose weights were read through the file layer is the one
    TransformerLens boots from the folder itself: its Hugging Face config (eager attention,
    attention weights returned) and its logits bit for bit."""
    import torch

    from extractive_lens import load_checkpoint
    from extractive_lens.backend.installed import bridge_class

    path = folders[layout]
    ours = load_checkpoint(path, backend="bridge")
    theirs = bridge_class().boot_transformers(str(path), dtype=torch.float32, device="cpu")
    assert ours.original_model.config.to_dict() == theirs.original_model.config.to_dict()
    tokens = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        assert torch.equal(ours(tokens), theirs(tokens))


def test_a_checkpoint_without_safetensors_weights_is_refused(folders, tmp_path):
    """A ``pytorch_model.bin`` (a pickle transformers would ``torch.load``) is not read: the
    refusal names the folder and says to save safetensors."""
    import torch

    from extractive_lens import load_checkpoint

    path = shutil.copytree(folders["single"], tmp_path / "bin")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    (path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="read safetensors checkpoints") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value) and "save_pretrained" in str(e.value)
