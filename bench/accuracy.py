"""Benchmark: what compact optimizer state does to the training loss of a small GPT.

    nice -n 10 python bench/accuracy.py [--steps 200] [--png docs/bench_accuracy.png]

A GPT-2 (transformers' ``GPT2LMHeadModel``, random init, 6 layers x 384, 10.8M parameters) learns
bytes of the Python documentation that ships with the interpreter (``pydoc_data.topics``, about
470 kB) for ``--steps`` steps of torch's AdamW (lr 5e-4, 10% warm-up then cosine, betas
(0.9, 0.95), weight decay 0.1, gradients clipped to norm 1), once per mode, from the same initial
weights and the same batches:

- (a) ``fp32``: fp32 model, fp32 moments: plain torch AdamW, the reference;
- (b) ``bf16``: moments stored as bf16 (round to nearest even) between steps;
- (c) ``8bit``: moments stored block-wise 8-bit (signed map for ``exp_avg``, unsigned for
  ``exp_avg_sq``; tensors under 4096 elements stay fp32);
- (c') ``8bit-emb32``: the same, but the two embedding tables keep fp32 moments, as
  bitsandbytes advises for 8-bit Adam (its ``StableEmbedding``/``override_config``);
- (d) ``master``: a bf16 copy of the model, fp32 masters (the step runs on the masters, the
  parameters are their round-to-nearest-even cast);
- (e) ``remainder``: the bf16 model again, with only the bf16 parameter and a 16-bit remainder
  kept between steps (the master is rebuilt exactly; the parameter is its round-half-up cast);
- ``bf16-sr`` (not run by default): bf16 moments with stochastic rounding;
- (f) ``muon``: torch's Muon on the hidden matrices (attention and MLP weights; lr
  ``--muon-lr``, weight decay 0.1), AdamW as above on the embeddings, biases and norms, fp32
  state; (g) ``muon-bf16`` and (h) ``muon-8bit``: the same with every moment (Muon's momentum
  and AdamW's moments) stored in bf16 or 8 bits, as ``SwapOptimizer`` stores them.

(b), (c) and (e) have the numerics the offloaded optimizer will have: after each torch AdamW
step on fp32 state, the moments are encoded with ``tierswap.optim.formats`` and decoded back
before the next step (decode, torch's kernel in fp32, encode); in (e) the masters are
overwritten with NaN between steps, so only parameter and remainder carry over. For (e) the
script counts how often the half-up parameter differs from torch's cast of the same master (a
tie: the master's low 16 bits exactly ``0x8000`` above an even bf16). Prints the final losses
(mean of the last 20 steps) and the bytes per parameter each mode reads and writes per step,
as markdown; draws the loss curves into ``--png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The formats' own module: the bench replays their numerics on plain torch AdamW, step for step
# against it, without a store (SwapOptimizer(state_precision=...) runs the same functions).
from tierswap.optim import formats  # noqa: E402

LAST = 20  # the final loss is the mean of this many last steps
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str
    model_dtype: torch.dtype = torch.float32
    precision: formats.StatePrecision = "fp32"
    master: formats.MasterFormat | None = None  # bf16 models only
    stochastic: bool = False
    fp32_embeddings: bool = False  # (c'): embedding tables keep fp32 moments
    optimizer: str = "adamw"  # "muon": Muon on the hidden matrices, AdamW on the rest


MODES = {
    m.name: m
    for m in (
        Mode("fp32", "(a) fp32 moments (torch AdamW)"),
        Mode("bf16", "(b) bf16 moments", precision="bf16"),
        Mode("8bit", "(c) 8-bit moments", precision="8bit"),
        Mode("8bit-emb32", "(c') 8-bit, embeddings fp32", precision="8bit", fp32_embeddings=True),
        Mode("master", "(d) bf16 model, fp32 masters", torch.bfloat16, master="fp32"),
        Mode("remainder", "(e) bf16 model, remainders", torch.bfloat16, master="remainder"),
        Mode("bf16-sr", "bf16 moments, stochastic rounding", precision="bf16", stochastic=True),
        Mode("muon", "(f) Muon + AdamW, fp32 state", optimizer="muon"),
        Mode("muon-bf16", "(g) Muon + AdamW, bf16 moments", precision="bf16", optimizer="muon"),
        Mode("muon-8bit", "(h) Muon + AdamW, 8-bit moments", precision="8bit", optimizer="muon"),
    )
}
DEFAULT_MODES = ["fp32", "bf16", "8bit", "8bit-emb32", "master", "remainder"]
MUON_MODES = ["muon", "muon-bf16", "muon-8bit"]


@dataclasses.dataclass
class Result:
    mode: Mode
    losses: list[float]
    seconds: float
    ties: int = 0  # (e): parameter elements whose half-up cast differed from torch's
    elements: int = 0  # (e): parameter elements split, over all steps

    @property
    def final(self) -> float:
        return sum(self.losses[-LAST:]) / len(self.losses[-LAST:])


class CompactMoments:
    """Stores each moment in ``precision`` after every step and decodes it for the next; the
    parameters in ``keep`` keep fp32 moments."""

    def __init__(
        self, opt: torch.optim.Optimizer, mode: Mode, seed: int, keep: set[int] | None = None
    ) -> None:
        self.opt, self.mode, self.keep = opt, mode, keep or set()
        self.generator = torch.Generator().manual_seed(seed)
        self.stored: dict[tuple[int, str], list[torch.Tensor]] = {}

    def round_trip(self) -> None:
        for group in self.opt.param_groups:
            for param in group["params"]:
                if id(param) in self.keep:
                    continue
                for name, value in self.opt.state[param].items():
                    if formats.is_moment(name) and torch.is_tensor(value) and value.dim() > 0:
                        self._round_trip(id(param), name, value.view(-1))

    def _round_trip(self, key: int, name: str, moment: torch.Tensor) -> None:
        fmt = formats.MomentFormat.for_state(
            name, moment.numel(), self.mode.precision, stochastic=self.mode.stochastic
        )
        stored = self.stored.get((key, name))
        if stored is None:
            arrays = fmt.arrays(name, moment.numel())
            stored = [torch.empty(a.numel, dtype=a.dtype) for a in arrays]
            self.stored[(key, name)] = stored
        fmt.encode(moment, stored, generator=self.generator)
        fmt.decode(stored, moment)


class Masters:
    """fp32 masters of a bf16 model: kept whole (``"fp32"``) or as remainders (``"remainder"``:
    the master buffers hold NaN between steps; parameter + remainder carry the state)."""

    def __init__(self, params: list[torch.Tensor], init: list[torch.Tensor], kind: str) -> None:
        self.params, self.kind = params, kind
        self.masters = [t.detach().clone().float() for t in init]
        self.remainders = [torch.empty_like(m, dtype=torch.int16) for m in self.masters]
        self.ties = self.elements = 0
        self._store()

    def before_step(self) -> None:
        with torch.no_grad():
            for param, master, rem in zip(self.params, self.masters, self.remainders, strict=True):
                if self.kind == "remainder":
                    formats.join(param, rem, out=master)
                assert param.grad is not None
                master.grad = param.grad.float()

    def after_step(self) -> None:
        for master in self.masters:
            master.grad = None
        self._store()

    def _store(self) -> None:
        with torch.no_grad():
            for param, master, rem in zip(self.params, self.masters, self.remainders, strict=True):
                if self.kind == "fp32":
                    param.copy_(master)
                    continue
                nearest_even = master.to(torch.bfloat16)
                formats.split(master, param, rem)
                self.ties += int((param.view(torch.int16) != nearest_even.view(torch.int16)).sum())
                self.elements += master.numel()
                master.fill_(math.nan)  # from here on only param + remainder hold the master


def corpus() -> torch.Tensor:
    """The Python documentation's topics as bytes: text that ships with every CPython."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def batches(data: torch.Tensor, args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
        out.append(torch.stack([data[s : s + args.seq] for s in starts.tolist()]))
    return out


def schedule(steps: int) -> Callable[[int], float]:
    """Linear warm-up over 10% of the steps, then cosine down to 10% of the peak."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=args.seq,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.width // 64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def train(
    mode: Mode, args: argparse.Namespace, init: dict[str, torch.Tensor], data: list
) -> Result:
    model = build_model(args)
    model.load_state_dict(init)
    model.to(mode.model_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = None
    if mode.master is not None:
        fp32_init = [init[name] for name, _ in model.named_parameters()]
        masters = Masters(params, fp32_init, mode.master)
    opts = optimizers(mode, model, masters.masters if masters else params, args)
    lrs = [torch.optim.lr_scheduler.LambdaLR(opt, schedule(args.steps)) for opt in opts]
    compacts = []
    if mode.precision != "fp32":
        embeddings = (m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding))
        keep = {id(p) for p in embeddings} if mode.fp32_embeddings else set()
        compacts = [CompactMoments(opt, mode, args.seed, keep) for opt in opts]
    losses, start = [], time.perf_counter()
    for step, tokens in enumerate(data):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if masters:
            masters.before_step()
        torch.nn.utils.clip_grad_norm_(masters.masters if masters else params, args.clip)
        for opt in opts:
            opt.step()
        for compact in compacts:
            compact.round_trip()
        if masters:
            masters.after_step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        for lr in lrs:
            lr.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == len(data) - 1:
            print(f"  {mode.name:>9} step {step:4d} loss {losses[-1]:.4f}", flush=True)
    result = Result(mode, losses, time.perf_counter() - start)
    if masters:
        result.ties, result.elements = masters.ties, masters.elements
    return result


def optimizers(
    mode: Mode, model: torch.nn.Module, targets: list[torch.Tensor], args: argparse.Namespace
) -> list[torch.optim.Optimizer]:
    """AdamW over ``targets`` (the parameters, or their masters); for a Muon mode, Muon over
    the hidden matrices (2-D weights other than the embedding tables) and AdamW over the rest."""
    adamw = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if mode.optimizer != "muon":
        return [torch.optim.AdamW(targets, **adamw)]
    tables = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
    }
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    hidden = [p.dim() == 2 and name not in tables for name, p in named]
    matrices = [t for t, h in zip(targets, hidden, strict=True) if h]
    rest = [t for t, h in zip(targets, hidden, strict=True) if not h]
    return [
        torch.optim.Muon(matrices, lr=args.muon_lr, weight_decay=0.1),
        torch.optim.AdamW(rest, **adamw),
    ]


# --- reports ----------------------------------------------------------------------------------


def loss_table(results: dict[str, Result]) -> str:
    ref = results.get("fp32")
    bf16_ref = results.get("master")
    muon_ref = results.get("muon")
    rows = [
        "| mode | final loss (mean of last 20) | vs (a) | vs (d) | vs (f) | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results.values():
        vs_a = _pct(r.final, ref.final) if ref and r.mode.name != "fp32" else "-"
        vs_d = _pct(r.final, bf16_ref.final) if bf16_ref and r.mode.name == "remainder" else "-"
        muon = r.mode.optimizer == "muon" and r.mode.name != "muon"
        vs_f = _pct(r.final, muon_ref.final) if muon_ref and muon else "-"
        rows.append(
            f"| {r.mode.label} | {r.final:.4f} | {vs_a} | {vs_d} | {vs_f} | {r.seconds:.0f} |"
        )
    return "\n".join(rows)


def _pct(value: float, ref: float) -> str:
    return f"{100 * (value - ref) / ref:+.2f}%"


def tie_report(results: dict[str, Result]) -> str:
    r = results.get("remainder")
    if r is None or not r.elements:
        return ""
    splits = len(r.losses) + 1  # the initial split of the fp32 init, then one per step
    lines = [
        f"(e) ties: {r.ties} of {r.elements} parameter elements split "
        f"({r.ties / r.elements:.2e}: {r.elements // splits} elements x {splits} splits, the "
        "initial one included); at a tie the parameter is one bf16 step further from zero "
        "than torch's cast"
    ]
    d = results.get("master")
    if d is not None:
        same = next(
            (i for i, (x, y) in enumerate(zip(r.losses, d.losses, strict=True)) if x != y), None
        )
        where = "never" if same is None else f"first at step {same}"
        lines.append(f"(e) and (d) losses differ: {where}")
    return "\n".join(lines)


def bytes_table(model: torch.nn.Module) -> str:
    """Bytes per parameter element one step reads and writes: moments, and the master of a bf16
    parameter (the parameter itself, moved either way, is left out). "Large" is a tensor of at
    least 4096 elements; "this model" weighs in the small tensors (fp32 moments under 8-bit)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    sizes = [(p.numel(), id(p) in embeddings) for p in model.parameters()]
    total = sum(n for n, _ in sizes)

    def moments(precision: formats.StatePrecision, fp32_embeddings: bool) -> tuple[float, float]:
        stored = 0
        for n, is_embedding in sizes:
            kind = "fp32" if fp32_embeddings and is_embedding else precision
            for name in MOMENTS:
                stored += sum(
                    a.numel * a.dtype.itemsize for a in formats.stored_arrays(name, n, kind)
                )
        return 2 * formats.bytes_per_element(precision), stored / total

    rows = [
        "| mode | moments read = written, B/param: large tensors | this model "
        "| master read = written | total read + written: large tensors | this model |",
        "|---|---|---|---|---|---|",
    ]
    cases = [
        ("(a) fp32 moments", "fp32", False, 0),
        ("(b) bf16 moments", "bf16", False, 0),
        ("(c) 8-bit moments", "8bit", False, 0),
        ("(c') 8-bit, embeddings fp32", "8bit", True, 0),
        ("(d) bf16 model, fp32 masters", "fp32", False, 4),
        ("(e) bf16 model, remainders", "fp32", False, 2),
        ("8-bit moments + remainders (not trained here)", "8bit", False, 2),
    ]
    for label, precision, fp32_embeddings, master in cases:
        large, actual = moments(precision, fp32_embeddings)  # type: ignore[arg-type]
        rows.append(
            f"| {label} | {large:.3g} | {actual:.3g} | {master or '-'} "
            f"| {2 * (large + master):.3g} | {2 * (actual + master):.3g} |"
        )
    return "\n".join(rows)


def plot(results: dict[str, Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ref = results.get("fp32") or results.get("muon")  # the fp32 run the others differ from
    colors = dict(zip(MODES, plt.get_cmap("tab10").colors, strict=False))
    for r in results.values():
        smooth = _moving_average(r.losses, 10)
        style = {"color": colors[r.mode.name], "linewidth": 1}
        top.plot(smooth, label=f"{r.mode.label}: {r.final:.4f}", **style)
        if ref is not None and r is not ref:
            diff = [a - b for a, b in zip(smooth, _moving_average(ref.losses, 10), strict=True)]
            bottom.plot(diff, label=r.mode.label, **style)
    top.set_ylabel("training loss (moving average of 10)")
    top.set_title(title, fontsize=9)
    top.legend(fontsize=8)
    bottom.axhline(0.0, color="black", linewidth=0.5)
    bottom.set_ylabel(f"minus {ref.mode.label.split(' ')[0]}" if ref else "")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _moving_average(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384, help="n_embd, a multiple of 64")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon modes' hidden matrices")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES),
        help=f"default: {' '.join(DEFAULT_MODES)}; also {' '.join(MUON_MODES)}",
    )  # fmt: skip
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "bench_accuracy.png")
    args = parser.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    model = build_model(args)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    nparams = sum(p.numel() for p in model.parameters())
    data = batches(corpus(), args)
    sizes = (
        f"GPT-2 {args.layers}x{args.width}, {nparams / 1e6:.1f}M parameters, byte tokens, "
        f"{args.batch}x{args.seq} tokens per step, {args.steps} steps, AdamW lr {args.lr:g}, "
        f"clip {args.clip:g}"
    )
    if any(MODES[name].optimizer == "muon" for name in args.modes):
        sizes += f", Muon lr {args.muon_lr:g} on the hidden matrices"
    print(sizes, f"| torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    results = {name: train(MODES[name], args, init, data) for name in args.modes}
    print()
    print(loss_table(results))
    print()
    print(tie_report(results))
    print()
    print(bytes_table(model))
    plot(results, args.png, sizes)
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
