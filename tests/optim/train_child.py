"""A training process for the kill-and-resume tests.

``python -m tests.optim.train_child DIR [muon|8bit|stream|auto]`` trains TinyNet with a
SwapOptimizer committing every step and prints ``committed <n>`` after each step until it is
killed. With ``auto``, it commits as ``commit_every="auto"`` does, its state resident in RAM
(each commit writes it all), and each forward waits a while off the CPU as on a GPU
(:data:`GPU_LIKE_WAIT`), so that the commits end behind their steps. With ``stream``, the
optimizer streams the model's parameters and gradients too (``offload_parameters=True``).
With ``muon``, the matrices step with torch.optim.Muon and the rest with AdamW, in one
SwapOptimizer (:func:`muon_groups`). With ``8bit``, a net of two 8192-element weights
(:func:`compact_net`) keeps 8-bit moments at a budget that streams them, its scales held in
host memory.

``python -m tests.optim.train_child --serve`` is a fork server for many kill trials: a fork
costs milliseconds where a new interpreter importing torch costs a second or two. It imports
torch and tierswap once, computes nothing and starts no thread (run it with
``OPENBLAS_NUM_THREADS=1``: numpy's BLAS would start one at import), so a fork copies one
thread in a quiet state. On stdin it reads, one line at a time:

- ``resume DIR``: forks a child that resumes the run in DIR and trains until killed
  (:func:`resume_and_train`), and prints ``forked <pid>``;
- ``reap``: waits for that child (the caller has killed it) and prints ``reaped <pid> <code>``,
  the code as :func:`os.waitstatus_to_exitcode` gives it (``-9`` after SIGKILL). Until then a
  dead child stays a zombie, so its pid cannot name another process.

The children write to the server's stdout and stderr: ``resumed <n>``, ``committed <n>`` per
step, or ``failed`` (the traceback on stderr) when they stop on their own.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback

import torch

from tests.optim.models import batch_for_step, make_models, train_step
from tierswap.optim import SwapOptimizer

# commit_every=1: a kill at any step finds the commit of the step before it
CHILD_KWARGS = {"host_budget": 8192, "commit_every": 1, "lr": 1e-2, "weight_decay": 0.05}
CHILD_LR_DECAY = 0.9
MUON_LR = 0.02
MUON_KWARGS = {**CHILD_KWARGS, "host_budget": 64 << 10}  # whole matrices and their temporaries
#: 8-bit moments streamed (160 KiB of working set), the scales (16 KiB) held beside them
COMPACT_KWARGS = {**CHILD_KWARGS, "host_budget": 128 << 10, "state_precision": "8bit"}
#: Parameters and gradients in the swap folder too: a slice holds a gradient page more
STREAM_KWARGS = {**CHILD_KWARGS, "host_budget": 20480, "offload_parameters": True}
#: The default commits of the state resident in RAM (behind their steps, with GPU_LIKE_WAIT)
AUTO_KWARGS = {**CHILD_KWARGS, "host_budget": None, "commit_every": "auto"}


#: Seconds the ``auto`` recipe's forward waits off the CPU, as when a GPU computes: the
#: process then keeps its cores mostly idle between steps, so commits end behind the steps
GPU_LIKE_WAIT = 0.05


def compact_net() -> torch.nn.Module:
    """Weights of 8192 elements (8-bit moments) and biases (fp32 moments) over 8 features."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 8))


def muon_groups(model: torch.nn.Module) -> list[dict[str, object]]:
    """Muon for the 2-D weights, the default class (AdamW) for the rest."""
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.dim() == 2]
    rest = [(n, p) for n, p in named if p.dim() != 2]
    return [
        {"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices],
         "optimizer_class": torch.optim.Muon, "lr": MUON_LR},
        {"params": [p for _, p in rest], "param_names": [n for n, _ in rest]},
    ]  # fmt: skip


def main(swap_dir: str, recipe: str = "adamw") -> None:
    _, model = make_models()
    if recipe == "muon":
        opt = SwapOptimizer(muon_groups(model), torch.optim.AdamW, swap_dir=swap_dir, **MUON_KWARGS)
    elif recipe == "auto":
        opt = SwapOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, **AUTO_KWARGS)
    elif recipe == "stream":
        opt = SwapOptimizer(model, torch.optim.AdamW, swap_dir=swap_dir, **STREAM_KWARGS)
    elif recipe == "8bit":
        model = compact_net()
        opt = SwapOptimizer(
            model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, **COMPACT_KWARGS
        )
    else:
        opt = SwapOptimizer(
            model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, **CHILD_KWARGS
        )
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=CHILD_LR_DECAY)
    step = 0
    while True:
        if recipe == "auto":
            time.sleep(GPU_LIKE_WAIT)
        train_step(model, opt, batch_for_step(step))
        sched.step()
        step += 1
        print(f"committed {opt.steps}", flush=True)


def resume_and_train(swap_dir: str, server: int) -> None:
    """Resume the AdamW run in ``swap_dir`` (constant lr) and train until killed, or until the
    process ``server`` that forked this one is gone."""
    _, model = make_models(seed=11)  # the resume overwrites these weights
    opt = SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=swap_dir, resume=True, **CHILD_KWARGS
    )
    print(f"resumed {opt.steps}", flush=True)
    while os.getppid() == server:
        train_step(model, opt, batch_for_step(opt.steps))
        print(f"committed {opt.steps}", flush=True)


def _forked(swap_dir: str, server: int) -> None:
    """The body of a forked child: never returns into the server's loop."""
    try:
        resume_and_train(swap_dir, server)
    except BaseException:
        traceback.print_exc()
        print("failed", flush=True)
    finally:
        sys.stderr.flush()
        os._exit(1)


def serve() -> None:
    # the first torch optimizer imports torch._dynamo (1-2 s): once here, not in each child
    importlib.import_module("torch._dynamo")
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1:
        raise RuntimeError(f"the fork server has {len(tasks)} threads; set OPENBLAS_NUM_THREADS=1")
    child = 0
    for line in sys.stdin:
        command, *args = line.split()
        if command == "resume" and not child:
            sys.stdout.flush()
            child = os.fork()
            if child == 0:
                _forked(args[0], os.getppid())
            print(f"forked {child}", flush=True)
        elif command == "reap" and child:
            _, status = os.waitpid(child, 0)
            print(f"reaped {child} {os.waitstatus_to_exitcode(status)}", flush=True)
            child = 0
        else:
            raise RuntimeError(f"unexpected {line!r} (child {child})")
    if child:  # the caller is gone: so is the child
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(*sys.argv[1:])
