"""Hugging Face Trainer with a SwapOptimizer: a GPT-2 built from a config, no download.

    python examples/hf_trainer.py --swap-dir swap/hf-trainer --steps 20
    python examples/hf_trainer.py --swap-dir swap/hf-trainer --steps 20 --save-steps 5 \
        --save-total-limit 2
    python examples/hf_trainer.py --swap-dir swap/hf-trainer2 --steps 20 --save-steps 5 \
        --resume swap/hf-output/checkpoint-10

With ``--save-steps`` each checkpoint holds the optimizer as a snapshot
(``checkpoint-N/optimizer.tierswap``, hard links to the swap folder: no state in RAM, almost
nothing written) and a tiny ``optimizer.pt`` that references it; see docs/checkpoints.md.

Needs ``pip install tierswap[hf]`` (transformers and accelerate).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import tierswap as ts
from tierswap.integrations.hf import TierswapCallback


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences (language modelling on noise: enough to train)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.data = torch.randint(vocab, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def make_model(
    layers: int = 4, dim: int = 256, vocab: int = 4096, seq: int = 64
) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=dim, n_head=max(1, dim // 64), vocab_size=vocab, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def muon_groups(model: torch.nn.Module) -> list[dict]:
    """Muon for the 2-D weights inside the transformer blocks, AdamW for the rest."""
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if ".h." in n and p.dim() == 2]
    rest = [(n, p) for n, p in named if not (".h." in n and p.dim() == 2)]
    return [
        {"params": [p for _, p in hidden], "param_names": [n for n, _ in hidden],
         "optimizer_class": torch.optim.Muon, "lr": 0.02},
        {"params": [p for _, p in rest], "param_names": [n for n, _ in rest]},
    ]  # fmt: skip


def train(
    swap_dir: str | Path | None,
    *,
    steps: int,
    output_dir: str | Path,
    host_budget: str = "8MiB",
    model_kwargs: dict | None = None,
    save_steps: int = 0,
    save_total_limit: int | None = None,
    resume: str | Path | None = None,
    muon: bool = False,
    stream: bool = False,
) -> tuple[Trainer, GPT2LMHeadModel]:
    """Train with a SwapOptimizer, or with plain AdamW when ``swap_dir`` is ``None``.

    ``save_steps`` > 0 saves a checkpoint every that many steps (keeping ``save_total_limit``);
    ``resume`` is a checkpoint folder to resume from. ``muon`` steps the blocks' matrices with
    torch.optim.Muon and the rest with AdamW, in the one optimizer the Trainer takes. ``stream``
    streams the parameters and gradients too (``offload_parameters=True``: the model is named;
    the Trainer's clipping works on the gradients kept in the swap folder).
    """
    model = make_model(**(model_kwargs or {}))
    dataset = RandomTokens(64, model.config.n_positions, model.config.vocab_size)
    if swap_dir is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        params = muon_groups(model) if muon else model.named_parameters()
        opt = ts.SwapOptimizer(params, torch.optim.AdamW, lr=1e-3, swap_dir=swap_dir,
                               host_budget=host_budget, offload_parameters=stream,
                               model=model if stream else None)  # fmt: skip
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4,
        logging_steps=1, report_to=[], use_cpu=True, seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        save_total_limit=save_total_limit,
        disable_tqdm=True, lr_scheduler_type="linear", dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, optimizers=(opt, None),
        callbacks=[TierswapCallback()] if swap_dir is not None else [],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default="swap/hf-trainer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host-budget", default="8MiB")
    parser.add_argument("--output-dir", default="swap/hf-output")
    parser.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--muon", action="store_true", help="Muon for the blocks' matrices")
    parser.add_argument("--stream", action="store_true", help="stream the parameters too")
    args = parser.parse_args()
    trainer, _ = train(args.swap_dir, steps=args.steps, output_dir=args.output_dir,
                       host_budget=args.host_budget, save_steps=args.save_steps,
                       save_total_limit=args.save_total_limit, resume=args.resume,
                       muon=args.muon, stream=args.stream)  # fmt: skip
    last = trainer.state.log_history[-2]  # the last training-step entry (the final is a summary)
    print({k: v for k, v in last.items() if k.startswith(("loss", "tierswap/"))})
    ts_opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else None
    if isinstance(ts_opt, ts.SwapOptimizer):
        ts_opt.close()


if __name__ == "__main__":
    main()
