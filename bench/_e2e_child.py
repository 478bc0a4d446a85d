"""One configuration of ``bench/e2e.py``, in this process: time training iterations, print JSON.

    python bench/_e2e_child.py --config ram|tierswap|deepspeed [--options JSON] --dir DIR

This file imports only torch (and ``_peak``, standard library only) at the top, so the DeepSpeed
configurations can run under another interpreter (a venv with torch + deepspeed and without
tierswap); ``tierswap`` and ``deepspeed`` are imported only by the configuration that needs
them. The last line printed is one JSON object: the per-iteration times, peak RSS, the
process's disk bytes per iteration (``/proc/self/io``) and, for tierswap, its tier statistics.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _peak import peak_rss

BATCH = 8
LR = 1e-4
GPT2_BATCH, GPT2_TOKENS = 4, 64


def build_model(width: int, depth: int) -> torch.nn.Sequential:
    """``depth`` x (Linear(width, width) + GELU), then Linear(width, 1): 100.7M params at 4096."""
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def build_gpt2(layers: int = 12, width: int = 768) -> torch.nn.Module:
    """GPT-2 (transformers' GPT2LMHeadModel; 124M at the default 12 layers of dim 768, heads
    of 64), random init: no download, a config and random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(width // 64, 1), n_positions=GPT2_TOKENS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


#: The GPU-like model: layers of one fp32 weight each (12 unless --gpulike-layers), whose
#: forward and backward take this long off the CPU (a wait that releases the GIL, as a thread
#: waits for a GPU's kernels).
GPULIKE_LAYERS, GPULIKE_SHAPE = 12, (2048, 4096)
GPULIKE_FORWARD_S, GPULIKE_BACKWARD_S = 0.040, 0.080


class _OffCPU(torch.autograd.Function):
    """A layer computed elsewhere: forward and backward wait (GIL released) and hand the
    weight a fixed gradient, copied as a device-to-host copy lands."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> Any:
        time.sleep(GPULIKE_FORWARD_S)
        ctx.grad = grad
        return x.clone()

    @staticmethod
    def backward(ctx: Any, out_grad: torch.Tensor) -> Any:
        time.sleep(GPULIKE_BACKWARD_S)
        return out_grad, ctx.grad.clone(), None


class OffCPULayer(torch.nn.Module):
    """One fp32 weight computed off the CPU; ``fixed_grad`` is the gradient its backward
    hands it (one tensor shared by every layer, so that a model of many layers holds one)."""

    def __init__(self, fixed_grad: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(GPULIKE_SHAPE) * 0.02)
        self.register_buffer("fixed_grad", fixed_grad, persistent=False)

    def forward(self, x: torch.Tensor) -> Any:
        return _OffCPU.apply(x, self.weight, self.fixed_grad)


def build_gpulike(layers: int = GPULIKE_LAYERS) -> torch.nn.Sequential:
    """``layers`` layers of a 2048 x 4096 fp32 weight (8.4M params each: 100.7M at 12, 1.31B
    at 156), each spending its forward and backward time off the CPU, as a model computed on a
    GPU does."""
    fixed_grad = torch.randn(GPULIKE_SHAPE) * 1e-3
    return torch.nn.Sequential(*(OffCPULayer(fixed_grad) for _ in range(layers)))


class Workload:
    """The model of ``--model`` and the loss of one iteration on its fixed batch."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.clip: float | None = getattr(args, "clip", None)
        self.gpt2 = args.model == "gpt2"
        if args.model == "gpulike":
            self.model = build_gpulike(args.gpulike_layers)
        else:
            self.model = (
                build_gpt2(args.gpt2_layers, args.gpt2_width)
                if self.gpt2
                else build_model(args.width, args.depth)
            )
        if self.gpt2:
            gen = torch.Generator().manual_seed(1)
            vocab = self.model.config.vocab_size
            self.tokens = torch.randint(vocab, (GPT2_BATCH, GPT2_TOKENS), generator=gen)
        elif args.model == "gpulike":
            self.x, self.y = torch.randn(BATCH, 16), torch.randn(BATCH, 16)
        else:
            self.x, self.y = torch.randn(BATCH, args.width), torch.randn(BATCH, 1)

    def loss(self, model: Callable[..., Any]) -> torch.Tensor:
        if self.gpt2:
            return model(input_ids=self.tokens, labels=self.tokens).loss
        return torch.nn.functional.mse_loss(model(self.x), self.y)


def _disk_bytes() -> dict[str, int]:
    """Bytes this process made the block layer read and write (O_DIRECT included)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    fields = dict(line.split(": ") for line in text.splitlines())
    return {"read": int(fields["read_bytes"]), "written": int(fields["write_bytes"])}


Counters = Callable[[], dict[str, int]]
DISK: dict[str, Counters] = {"disk": _disk_bytes} if Path("/proc/self/io").exists() else {}


def _time_iterations(
    iterate: Callable[[], None], iters: int, counters: dict[str, Counters]
) -> dict[str, list]:
    """Run ``iterate`` ``iters`` times: each one's wall time and the growth of each counter.

    The counters are read outside the timed part.
    """
    result: dict[str, list] = {"times": [], **{name: [] for name in counters}}
    for _ in range(iters):
        before = {name: read() for name, read in counters.items()}
        start = time.perf_counter()
        iterate()
        result["times"].append(time.perf_counter() - start)
        for name, read in counters.items():
            after = read()
            result[name].append({k: after[k] - before[name][k] for k in after})
    return result


def _phased(
    phases: dict[str, list[float]],
    forward: Callable[[], Any],
    backward: Callable[[Any], None],
    step: Callable[[], None],
) -> Callable[[], None]:
    """One iteration, ``forward()`` (the loss), ``backward(loss)`` and ``step()``, each phase
    timed into ``phases``."""

    def iterate() -> None:
        start = time.perf_counter()
        loss = forward()
        forwarded = time.perf_counter()
        backward(loss)
        backwarded = time.perf_counter()
        step()
        end = time.perf_counter()
        phases["forward"].append(forwarded - start)
        phases["backward"].append(backwarded - forwarded)
        phases["step"].append(end - backwarded)

    return iterate


def _torch_loop(
    work: Workload, opt: torch.optim.Optimizer | None, phases: dict[str, list[float]]
) -> Callable:
    """One iteration, each phase timed into ``phases`` (forward includes any wait for the
    previous step's updates; step is what ``opt.step()`` takes before it returns; without an
    optimizer, forward and backward alone)."""

    def step() -> None:
        if opt is not None:
            if work.clip is not None:  # part of the step phase (streamed gradients too)
                torch.nn.utils.clip_grad_norm_(work.model.parameters(), work.clip)
            opt.step()
            opt.zero_grad()
        else:
            work.model.zero_grad()

    return _phased(phases, lambda: work.loss(work.model), lambda loss: loss.backward(), step)


def _phases() -> dict[str, list[float]]:
    return {"forward": [], "backward": [], "step": []}


def run_ram(args: argparse.Namespace) -> dict[str, Any]:
    """torch.optim.AdamW with all state in RAM (``--options``: its keyword arguments; with
    ``"no_step": true``, no optimizer at all: forward and backward alone)."""
    work = Workload(args)
    options = json.loads(args.options)
    opt = (
        None
        if options.pop("no_step", False)
        else torch.optim.AdamW(work.model.parameters(), lr=LR, weight_decay=0, **options)
    )
    phases = _phases()
    result = _time_iterations(_torch_loop(work, opt, phases), args.iters, DISK)
    return {**result, "phases": phases}


def _nvme_counter(opt: torch.optim.Optimizer) -> Counters | None:
    """Bytes the optimizer's NVMe tier read and wrote, when its ``tier_stats()`` says."""
    stats_of = getattr(opt, "tier_stats", None)
    nvme = stats_of().get("nvme") if stats_of is not None else None
    if not isinstance(nvme, dict) or not {"bytes_read", "bytes_written"} <= nvme.keys():
        return None

    def read() -> dict[str, int]:
        nvme = stats_of()["nvme"]
        return {"read": nvme["bytes_read"], "written": nvme["bytes_written"]}

    return read


def run_tierswap(args: argparse.Namespace) -> dict[str, Any]:
    """tierswap.SwapOptimizer around torch.optim.AdamW, with the mode's keyword arguments."""
    import tierswap

    work = Workload(args)
    options = json.loads(args.options)
    streamed = options.get("offload_parameters", False)  # the model itself: its hooks stream
    if options.get("device_budget") == "params":  # every parameter kept, no state beside them
        options["device_budget"] = sum(
            p.numel() * p.element_size() for p in work.model.parameters()
        )
    opt = tierswap.SwapOptimizer(
        work.model if streamed else work.model.parameters(), torch.optim.AdamW, lr=LR,
        weight_decay=0, swap_dir=[args.dir, *args.also_dir] if args.also_dir else args.dir,
        host_budget=args.host_budget, **options,
    )  # fmt: skip
    counters = dict(DISK)
    nvme = _nvme_counter(opt)
    if nvme is not None:
        counters["swap_bytes"] = nvme
    phases = _phases()
    try:
        result = _time_iterations(_torch_loop(work, opt, phases), args.iters, counters)
        if hasattr(opt, "tier_stats"):
            result["tier_stats"] = opt.tier_stats()
    finally:
        opt.close()
    return {**result, "phases": phases}


#: ``offload_param``'s swap buffers (one parameter each): 5 runs GPT-2 4 x 1024 with
#: ``max_in_cpu`` at its default; at 24 x 2048, 5 ran out ("Not enough buffers") and 16
#: (6.6 GB pinned) outgrew 24 GiB of RAM. ``TIERSWAP_DS_BUFFERS`` overrides it.
BUFFERS = int(os.environ.get("TIERSWAP_DS_BUFFERS", "5"))
#: ``offload_param``'s ``max_in_cpu``: parameter elements DeepSpeed keeps in RAM (its default,
#: 1e9, unless ``TIERSWAP_DS_MAX_IN_CPU`` says otherwise: above the model's size, as at 1.3B,
#: no parameter goes to NVMe and the swap-buffer failure above cannot happen).
MAX_IN_CPU = float(os.environ.get("TIERSWAP_DS_MAX_IN_CPU", "1e9"))


def deepspeed_config(
    args: argparse.Namespace, pipelined: bool, offload_param: bool = False
) -> dict[str, Any]:
    """ZeRO-3 with the optimizer state offloaded to NVMe (ZeRO-Infinity), as the issue sets it;
    with ``offload_param``, the parameters too (ZeRO-Infinity's parameter offload: parameters
    of 1 MiB or more live on NVMe, ``buffer_size`` elements per swap buffer must hold the
    largest)."""
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4_000_000,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": args.dir,
                "pin_memory": True,
                "buffer_count": 12 if pipelined else 4,
                "pipeline_read": pipelined,
                "pipeline_write": pipelined,
            },
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
    }
    if args.clip is not None:  # as tierswap's runs clip with clip_grad_norm_
        config["gradient_clipping"] = args.clip
    if offload_param:
        # A swap buffer holds one parameter: the parameters live at once (and read ahead) must
        # not outnumber them ("Not enough buffers" in the first forward with the defaults).
        config["zero_optimization"].update(
            stage3_max_live_parameters=60_000_000, stage3_prefetch_bucket_size=20_000_000
        )
        config["zero_optimization"]["offload_param"] = {
            "device": "nvme",
            "nvme_path": args.dir,
            "pin_memory": True,
            "buffer_count": BUFFERS,
            "buffer_size": 50304 * args.gpt2_width,  # the largest parameter: the embedding
            "max_in_cpu": MAX_IN_CPU,
        }  # with max_in_cpu 0, 0.19.8's first forward runs out of buffers (its swapped-in
        # parameters are never let go: DeepSpeed issue 3062)
    return config


def run_deepspeed(args: argparse.Namespace) -> dict[str, Any]:
    """A single-process DeepSpeed engine on the CPU accelerator (the parent sets the env)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    options = json.loads(args.options)
    offload_param = options.get("offload_param", False)
    config = deepspeed_config(args, options.get("pipelined", False), offload_param)
    if args.model == "gpt2":
        config["train_micro_batch_size_per_gpu"] = GPT2_BATCH
    if offload_param:  # partitioned to NVMe as it is built (built whole and partitioned by
        # deepspeed.initialize instead, its parameters came out bf16 on the CPU accelerator).
        # Under zero.Init transformers skips its weight init (torch's defaults stay): the
        # values differ from tierswap's run, the work per iteration does not.
        import torch._dynamo  # noqa: F401  (imported under zero.Init, which patches
        import transformers  # noqa: F401  Tensor.__new__, dynamo's polyfills refuse to load)

        with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=config):
            work = Workload(args)
    else:
        work = Workload(args)
    engine, _opt, _, _ = deepspeed.initialize(
        model=work.model, model_parameters=work.model.parameters(), config=config
    )

    phases = _phases()
    # the step clips by the global norm when --clip sets gradient_clipping
    iterate = _phased(phases, lambda: work.loss(engine), engine.backward, engine.step)
    try:
        result = _time_iterations(iterate, args.iters, DISK)
    finally:
        engine.destroy()
    return {**result, "phases": phases, "deepspeed": deepspeed.__version__}


RUNNERS = {"ram": run_ram, "tierswap": run_tierswap, "deepspeed": run_deepspeed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(RUNNERS), required=True)
    p.add_argument("--options", default="{}", help="JSON: SwapOptimizer kwargs / DeepSpeed mode")
    p.add_argument("--dir", required=True, help="swap folder of this run")
    p.add_argument(
        "--also-dir", action="append", default=[], help="tierswap: more folders (other drives)"
    )
    p.add_argument("--host-budget", type=int, default=128 << 20, help="bytes")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--model", choices=["mlp", "gpt2", "gpulike"], default="mlp")
    p.add_argument("--gpt2-layers", type=int, default=12)
    p.add_argument("--gpulike-layers", type=int, default=GPULIKE_LAYERS)
    p.add_argument("--gpt2-width", type=int, default=768)
    p.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ before each step")
    args = p.parse_args()
    faulthandler.enable()  # a crash inside a native op (DeepSpeed's aio threads) shows where
    result = RUNNERS[args.config](args)
    result["peak_rss"] = peak_rss()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
