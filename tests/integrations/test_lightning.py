"""Lightning checkpoints with snapshots: rotation, and resume from an older one, bit-exact."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (.[lightning])")

import pytorch_lightning as pl
import torch

import tierswap as ts
from tests.integrations.helpers import load_example
from tests.optim.models import assert_same_params

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's own deprecation and tips


def _example():
    return load_example("lightning_loop.py")


@pytest.mark.usefixtures("no_gathering")
def test_checkpoints_keep_snapshots_and_resume_bit_exact(tmp_path) -> None:
    example = _example()
    plain = example.train(None, steps=8, output_dir=tmp_path / "plain", save_every=2)
    out = tmp_path / "out"
    full = example.train(tmp_path / "swap", steps=8, output_dir=out, save_every=2, save_top_k=2)
    assert_same_params(plain, full)
    assert sorted(p.name for p in out.iterdir()) == [
        "step=6.ckpt", "step=6.ckpt.tierswap", "step=8.ckpt", "step=8.ckpt.tierswap",
    ]  # fmt: skip
    assert (out / "step=6.ckpt").stat().st_size < 64 << 10  # weights and a reference only
    # resume from the older retained checkpoint after moving the pair elsewhere
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(out / "step=6.ckpt", moved / "step=6.ckpt")
    shutil.move(out / "step=6.ckpt.tierswap", moved / "step=6.ckpt.tierswap")
    shutil.rmtree(out)
    resumed = example.train(
        tmp_path / "swap2", steps=8, output_dir=tmp_path / "o2", save_every=2,
        resume=moved / "step=6.ckpt",
    )  # fmt: skip
    assert_same_params(plain, resumed)


@pytest.mark.usefixtures("no_gathering")
def test_streamed_parameters_train_checkpoint_and_resume_bit_exact(tmp_path) -> None:
    """``offload_parameters=True`` under Lightning: its checkpoints read the streamed values
    (``model.state_dict()``), and a resume loads them back (``model.load_state_dict()``)."""
    example = _example()
    plain = example.train(None, steps=6, output_dir=tmp_path / "plain", save_every=2)
    out = tmp_path / "out"
    full = example.train(tmp_path / "swap", steps=6, output_dir=out, save_every=2, stream=True)
    assert_same_params(plain, full)
    resumed = example.train(
        tmp_path / "swap2", steps=6, output_dir=tmp_path / "o2", save_every=2,
        resume=out / "step=4.ckpt", stream=True,
    )  # fmt: skip
    assert_same_params(plain, resumed)


def test_a_snapshot_saved_across_filesystems_is_copied_beside_the_file(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    from pathlib import Path

    import torch
    from pytorch_lightning.plugins.io import TorchCheckpointIO

    from tierswap.integrations.lightning import SnapshotCheckpointIO, snapshot_path
    from tierswap.optim import SwapOptimizer, snapshot_reference_path

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = SwapOptimizer(model.named_parameters(), swap_dir=tmp_path / "swap")
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    pending = tmp_path / "pending"
    reference = opt.snapshot_state_dict(pending)
    rename = Path.rename

    def cross_device(self: Path, target: Path) -> Path:
        if self == pending:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", cross_device)
    io = SnapshotCheckpointIO(TorchCheckpointIO())
    ckpt = tmp_path / "out" / "step=1.ckpt"
    io.save_checkpoint({"optimizer_states": [reference]}, ckpt)
    assert not pending.exists()
    assert snapshot_reference_path(reference) == snapshot_path(ckpt).absolute()
    loaded = io.load_checkpoint(ckpt)["optimizer_states"][0]
    assert snapshot_reference_path(loaded) == snapshot_path(ckpt).absolute()
    opt.load_state_dict(loaded)  # resumes from the copy
    assert opt.steps == 1
    opt.close()


@pytest.mark.usefixtures("no_gathering")
def test_muon_recipe_resumes_bit_exact(tmp_path) -> None:
    """Muon for the matrices and AdamW for the biases, in the one optimizer Lightning takes."""
    example = _example()
    run = {"steps": 6, "save_every": 2, "muon": True}
    full = example.train(tmp_path / "swap", output_dir=tmp_path / "out", **run)
    resumed = example.train(
        tmp_path / "swap2", output_dir=tmp_path / "o2", resume=tmp_path / "out" / "step=4.ckpt",
        **run,
    )  # fmt: skip
    assert_same_params(full, resumed)


def _clipped_by_value(example, swap_dir, output_dir, *, stream: bool):
    """Four steps of the example's model under ``gradient_clip_algorithm="value"``."""
    torch.manual_seed(0)
    model = example.Regressor(swap_dir, host_budget="64KiB", muon=False, stream=stream)
    trainer = pl.Trainer(
        max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(output_dir),
        gradient_clip_val=0.01, gradient_clip_algorithm="value",
    )  # fmt: skip
    trainer.fit(model, example.data(4))
    for opt in trainer.optimizers:
        if isinstance(opt, ts.SwapOptimizer):
            opt.close()
    return model


def test_streamed_parameters_clip_by_value_as_lightning_does(tmp_path) -> None:
    """Lightning's value clipping calls ``clip_grad_value_`` on gradients kept in the swap
    folder: recorded, applied as the step reads them, bitwise as in memory."""
    example = _example()
    plain = _clipped_by_value(example, None, tmp_path / "a", stream=False)
    streamed = _clipped_by_value(example, tmp_path / "swap", tmp_path / "b", stream=True)
    assert_same_params(plain, streamed)
