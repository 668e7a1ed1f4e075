"""The trajectory of a finetune: checkpoints recorded by ``finetune(keep=...)`` or read from a
folder of Hugging Face / peft ``checkpoint-*`` folders, as diffs from one base, read lazily."""

from __future__ import annotations

import pytest
import torch

import extractive_lens as el
from extractive_lens.backend.lowrank import LowRankDeltas
from extractive_lens.trajectory import Between, Trajectory
from tests.conftest import make_pair
from tests.helpers import facts


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A three-epoch finetune of a tiny float64 model, its trajectory and each epoch's diff as
    ``finetune``'s callback saw it (formed independently of the trajectory's files)."""
    base, _ = make_pair("ln_gelu", torch.float64)
    data = facts(base)
    seen = {}
    folder = tmp_path_factory.mktemp("run") / "trajectory"
    cfg = el.FinetuneConfig(lr=1e-2, epochs=3, batch_size=4)
    diff = el.finetune(base, data, cfg, keep="epochs", trajectory=folder,
                       callback=lambda e, d: seen.__setitem__(e + 1, d))  # fmt: skip
    return base, data, diff, Trajectory.load(diff.metadata["trajectory"]), seen


def test_finetune_keep_epochs_records_every_epoch(recorded):
    base, _, diff, traj, seen = recorded
    assert len(traj) == 3 and traj.steps == [0, 2, 4, 6] and traj.epochs == [0, 1, 2, 3]
    assert [c.loss for c in traj.checkpoints] == pytest.approx(diff.metadata["losses"])
    for k in (1, 2, 3):
        got = traj.diff(k)
        assert isinstance(got.deltas, Between)  # read a tensor at a time from its file
        for name, want in seen[k].deltas.items():
            assert torch.equal(got.deltas[name], want), (k, name)
    for name, want in diff.deltas.items():
        assert torch.equal(traj.final.deltas[name], want)
        assert not traj.diff(0).deltas[name].any()


def test_steps_and_points_are_the_segments_of_the_broken_line(recorded):
    _, _, _, traj, seen = recorded
    for name in seen[1].deltas:
        steps = [traj.step(k).deltas[name] for k in (1, 2, 3)]
        torch.testing.assert_close(steps[1], seen[2].deltas[name] - seen[1].deltas[name])
        torch.testing.assert_close(sum(steps), seen[3].deltas[name], rtol=0, atol=1e-12)
        torch.testing.assert_close(
            traj.point(3, 0.25).deltas[name],
            0.75 * seen[2].deltas[name] + 0.25 * seen[3].deltas[name], rtol=0, atol=1e-12,
        )  # fmt: skip
        assert torch.equal(traj.point(1, 0.5).deltas[name], 0.5 * seen[1].deltas[name])


def test_keep_every_k_steps_labels_steps_and_epochs(tmp_path):
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)  # 8 prompts, batches of 3: steps per epoch 3, 6 steps in all
    cfg = el.FinetuneConfig(lr=1e-3, epochs=2, batch_size=3)
    diff = el.finetune(base, data, cfg, keep=4, trajectory=tmp_path / "t")
    traj = Trajectory.load(tmp_path / "t")
    assert traj.steps == [0, 4, 6]  # every 4 steps and the last
    assert traj.epochs == pytest.approx([0, 1 + 3 / 8, 2])
    for name, want in diff.deltas.items():
        assert torch.equal(traj.final.deltas[name], want)


def test_bad_arguments_say_what_to_pass(tmp_path):
    base, _ = make_pair("ln_gelu", torch.float32)
    data = facts(base)
    cfg = el.FinetuneConfig(lr=1e-3, epochs=1, batch_size=4)
    with pytest.raises(ValueError, match="keep="):
        el.finetune(base, data, cfg, keep=0, trajectory=tmp_path / "t0")
    with pytest.raises(ValueError, match="keep is None"):
        el.finetune(base, data, cfg, trajectory=tmp_path)
    with pytest.raises(FileNotFoundError, match="from_checkpoints"):
        Trajectory.load(tmp_path)
    with pytest.raises(ValueError, match="checkpoint-<step>"):
        Trajectory.from_checkpoints(base, tmp_path)


def test_keep_without_a_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """``keep`` writes a checkpoint the size of the weights per epoch: without ``trajectory=``
    finetune says to pass one, and neither trains nor leaves a temporary folder behind."""
    import tempfile

    base, _ = make_pair("ln_gelu", torch.float32)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a temporary folder would go
    before = [p.tolist() for p in base.parameters()]
    for keep in ("epochs", 2):
        with pytest.raises(ValueError, match=r"MiB each.*pass trajectory='a folder'"):
            el.finetune(base, facts(base), el.FinetuneConfig(epochs=1), keep=keep)
    assert list(tmp_path.iterdir()) == []
    assert [p.tolist() for p in base.parameters()] == before


def _trainer_folder(tmp_path, arch="llama"):
    """A base checkpoint and a Trainer-style output folder (checkpoint-2, checkpoint-10: steps
    sort by number, not as text) of that model moved twice."""
    from tests.lora_models import base_checkpoint, save_tokenizer

    hf = base_checkpoint(arch, tmp_path / "base")
    out = tmp_path / "out"
    torch.manual_seed(1)
    for step in (2, 10):
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.02 * torch.randn_like(p))
        hf.save_pretrained(out / f"checkpoint-{step}")
        save_tokenizer(out / f"checkpoint-{step}")
    (out / "checkpoint-2" / "trainer_state.json").write_text('{"epoch": 1.0}')
    (out / "checkpoint-10" / "trainer_state.json").write_text('{"epoch": 2.0}')
    return tmp_path / "base", out


def test_a_trainer_output_folder_loads_as_one_trajectory(tmp_path):
    from extractive_lens.backend.loading import load_checkpoint

    base_dir, out = _trainer_folder(tmp_path)
    base = load_checkpoint(base_dir)
    traj = Trajectory.from_checkpoints(base, out)
    close = dict(rtol=1e-4, atol=1e-6)  # the bridge (TransformerLens 4) loads in float32
    assert traj.steps == [0, 2, 10] and traj.epochs == [0, 1, 2]
    for k, step in ((1, 2), (2, 10)):
        want = el.WeightDiff.from_models(base, load_checkpoint(out / f"checkpoint-{step}"))
        got = traj.diff(k)
        for name, d in want.deltas.items():
            torch.testing.assert_close(got.deltas[name], d.to(got.deltas[name].dtype), **close)
    first = el.WeightDiff.from_models(base, load_checkpoint(out / "checkpoint-2"))
    second = el.WeightDiff.from_models(base, load_checkpoint(out / "checkpoint-10"))
    for name in first.deltas:
        want = second.deltas[name] - first.deltas[name]
        torch.testing.assert_close(traj.step(2).deltas[name], want, **close)


def test_peft_checkpoints_stay_factors(tmp_path):
    from tests.lora_models import adapter_checkpoints

    base = adapter_checkpoints(tmp_path)
    traj = Trajectory.from_checkpoints(base, tmp_path / "out", steps_per_epoch=1)
    step = traj.step(2)
    assert isinstance(step.deltas, LowRankDeltas)
    a = el.WeightDiff.from_peft(base, tmp_path / "out" / "checkpoint-1")
    b = el.WeightDiff.from_peft(base, tmp_path / "out" / "checkpoint-2")
    for name in b.deltas:
        torch.testing.assert_close(step.deltas[name], b.deltas[name] - a.deltas[name])
        torch.testing.assert_close(traj.point(2, 0.5).deltas[name],
                                   0.5 * (a.deltas[name] + b.deltas[name]))  # fmt: skip
