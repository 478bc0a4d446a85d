"""Lightning with a SwapOptimizer: checkpoints whose optimizer is a snapshot.

    python examples/lightning_loop.py --swap-dir pl-swap --steps 20 --save-every 5
    python examples/lightning_loop.py --swap-dir pl-swap2 --steps 20 --save-every 5 \\
        --resume pl-output/step=10.ckpt

Each ``step=N.ckpt`` has a snapshot folder ``step=N.ckpt.tierswap`` beside it (hard links to the
swap folder's commit) instead of the optimizer state; see docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

import tierswap as ts
from tierswap.integrations.lightning import TierswapCheckpoints


class Regressor(pl.LightningModule):
    """A small MLP; ``swap_dir=None`` trains it with plain AdamW."""

    def __init__(
        self,
        swap_dir: str | Path | None,
        host_budget: str = "64KiB",
        muon: bool = False,
        stream: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
        )
        self.swap_dir, self.host_budget, self.muon = swap_dir, host_budget, muon
        self.stream = stream  # the parameters and gradients stream too: the module is given

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.swap_dir is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        params: Any = self.named_parameters()
        if self.muon:  # Muon for the matrices, AdamW for the biases: one optimizer
            named = list(params)
            matrices = [(n, p) for n, p in named if p.dim() == 2]
            params = [
                {"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices],
                 "optimizer_class": torch.optim.Muon, "lr": 0.02},
                {"params": [p for n, p in named if p.dim() != 2],
                 "param_names": [n for n, p in named if p.dim() != 2]},
            ]  # fmt: skip
        return ts.SwapOptimizer(self if self.stream else params, torch.optim.AdamW, lr=1e-2,
                                swap_dir=self.swap_dir, host_budget=self.host_budget,
                                offload_parameters=self.stream)  # fmt: skip


def data(batches: int) -> torch.utils.data.DataLoader:
    """An epoch of ``batches`` fixed batches, in order."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batches * 8, 16, generator=gen), torch.randn(batches * 8, 4, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def train(
    swap_dir: str | Path | None,
    *,
    steps: int,
    output_dir: str | Path,
    save_every: int = 0,
    save_top_k: int = -1,
    resume: str | Path | None = None,
    muon: bool = False,
    stream: bool = False,
) -> Regressor:
    """Train for ``steps`` steps, checkpointing every ``save_every`` steps.

    An epoch is ``save_every`` steps, so every checkpoint falls at an epoch's end: Lightning
    resumes a plain (non-stateful) DataLoader exactly only there.
    """
    model = Regressor(swap_dir, host_budget="256KiB" if muon else "64KiB", muon=muon, stream=stream)
    callbacks: list[pl.Callback] = [TierswapCheckpoints()]  # the one line tierswap needs
    if save_every:
        every = ModelCheckpoint(
            dirpath=str(output_dir), filename="{step}", every_n_train_steps=save_every,
            save_top_k=save_top_k, monitor="step", mode="max",
        )  # fmt: skip
        callbacks.append(every)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(output_dir),
        enable_checkpointing=bool(save_every),
    )  # fmt: skip
    trainer.fit(model, data(save_every or steps), ckpt_path=str(resume) if resume else None)
    for opt in trainer.optimizers:
        if isinstance(opt, ts.SwapOptimizer):
            opt.close()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default="swap/lightning")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--save-top-k", type=int, default=2)
    parser.add_argument("--output-dir", default="swap/lightning-output")
    parser.add_argument("--resume", default=None, help="a checkpoint file to resume from")
    parser.add_argument("--stream", action="store_true", help="stream the parameters too")
    args = parser.parse_args()
    model = train(args.swap_dir, steps=args.steps, output_dir=args.output_dir,
                  save_every=args.save_every, save_top_k=args.save_top_k,
                  resume=args.resume, stream=args.stream)  # fmt: skip
    print({"param_sum": float(sum(p.detach().sum() for p in model.parameters()))})


if __name__ == "__main__":
    main()
