"""Benchmark: one training iteration with optimizer state in RAM, in tierswap, in ZeRO-Infinity.

    PYTHONPATH=. python bench/e2e.py --rounds 2 --deepspeed-python /work/dsvenv/bin/python

The model is 6 x (Linear(4096, 4096) + GELU) + Linear(4096, 1), 100.7M fp32 parameters; one
iteration is forward on ``randn(8, 4096)``, MSE loss against ``randn(8, 1)``, backward, optimizer
step and zero_grad, with AdamW (lr 1e-4, weight decay 0) and ``torch.manual_seed(0)``. Each
configuration runs in its own process (so its peak RSS is its own), all of them once per round,
rounds interleaved so that machine load hits them alike; the figure is the median of iterations
2..--iters over all rounds (iteration 1 creates the state).

  ram           torch.optim.AdamW, all state in RAM
  ram-fused     the same with fused=True, when a mode uses fused=True
  <mode>        tierswap.SwapOptimizer(..., host_budget="128MiB", **MODES[mode]), see MODES
                (and MODE_ENV, the environment some modes add)
  ds-default    DeepSpeed ZeRO-3, optimizer state offloaded to NVMe, buffer_count 4
  ds-pipelined  the same with pipeline_read / pipeline_write and buffer_count 12
  ds-param      ZeRO-3 with the parameters offloaded to NVMe as well (offload_param; the model
                built under zero.Init(remote_device="nvme"), as the issue sets it up):
                the peer of tierswap's "stream" modes, which give SwapOptimizer the model and
                offload_parameters=True (parameters and gradients in the swap folder too).
                ds-param runs when a stream mode does, the other two when another mode does

--model gpt2 --gpt2-layers L --gpt2-width D sizes the GPT-2 (heads of 64; 124M by default), as
the parameter-streaming comparison needs (about 1.3B: 24 layers of 2048). At that size
DeepSpeed's ds-param runs only with its parameters in RAM: TIERSWAP_DS_MAX_IN_CPU=2e9 (its
max_in_cpu, in elements) keeps them all there, as at 100M its default does; the tierswap mode
that keeps them in RAM too is stream-ram (device_budget: the parameters' bytes; --device-budget
gives it more, whose spare room, without a GPU, holds optimizer state). --compute adds the
'compute' run (forward and backward in RAM, no optimizer) to any model.

The I/O bound is the bytes tierswap's default mode reads and writes per iteration (its
``tier_stats()``) at fio's sequential O_DIRECT bandwidth on the same folder (tierswap's shared
fio engine, a write then a read after the page cache was dropped, once per round). Targets:
DeepSpeed's best / tierswap default >= 1.5, tierswap default / max(ram, I/O bound) <= 1.15.

--throttle READ,WRITE caps the swap folder's disk for every process and the fio trial (a cgroup
blkio throttle, bench/_throttle.py, root only), to measure the modes on a slower disk than this
machine's: a cloud volume or a SATA drive, where the disk rather than the CPU bounds the step.
--also-dir B (once per drive) puts the state of the ``-striped`` modes on ``swap_dir=[--dir,
B, ...]``; the other modes and DeepSpeed (one nvme_path) stay on --dir.

DeepSpeed runs under the interpreter --deepspeed-python names (default: this one) and is
skipped, with a note, when that interpreter cannot import it. Its child imports only torch and
deepspeed (bench/_e2e_child.py), so a separate venv works:

    python3 -m venv /work/dsvenv
    /work/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    apt-get install -y libaio-dev   # headers for DeepSpeed's async_io op

On a machine without a GPU it runs single-process on DeepSpeed's CPU accelerator:
``DS_ACCELERATOR=cpu``, ``RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
MASTER_PORT=<free port>`` and ``deepspeed.init_distributed(dist_backend="gloo")``. DeepSpeed
0.19.8 needed no other workaround there. Its first run JIT-compiles the ops it uses (async_io,
cpu_adam, pin_memory, deepspeed_shm_comm) into ~/.cache/torch_extensions: about 5 minutes on 2
cores, paid once by the first DeepSpeed configuration of the first round (the compile happens
in ``deepspeed.initialize``, before the timed iterations). In one of about 30 runs a DeepSpeed
child aborted with "terminate called without an active exception" (not reproduced since): a
failed process is reported as such and the other configurations go on; a result it printed
before failing is kept and flagged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _fio import fio_bandwidth  # noqa: E402
from _throttle import rates, throttled  # noqa: E402

from tierswap.cli import bench_folder  # noqa: E402
from tierswap.config import format_size, parse_size  # noqa: E402

CHILD = Path(__file__).resolve().with_name("_e2e_child.py")

#: Every parameter kept in RAM between uses, torch's fused AdamW: the base of the
#: ``stream-ram-*`` modes below. A device budget of ``"params"`` is the model's parameter
#: bytes (the child computes it): it keeps every parameter and holds no optimizer state,
#: unless --device-budget gives a larger one (then, without a GPU, what the parameters leave
#: of it holds resident slices).
STREAM_RAM_FUSED: dict[str, Any] = {
    "offload_parameters": True,
    "device_budget": "params",
    "fused": True,
}

#: tierswap modes: name -> keyword arguments added to SwapOptimizer(...). Add a line per mode.
MODES: dict[str, dict[str, Any]] = {
    # overlap="auto": speculation in backward, checked and finished by step()
    "default": {},
    # no overlap: reads start in backward, every slice steps in step() (the default until
    # 2026-12-03)
    "none": {"overlap": None},
    "every1": {"commit_every": 1},
    "backward": {"overlap": "backward"},
    "nocommit": {"commit_every": 0},
    "nocommit-backward": {"commit_every": 0, "overlap": "backward"},
    "forward": {"overlap": "forward"},
    "forward-commit10": {"overlap": "forward", "commit_every": 10},
    "forward-every1": {"overlap": "forward", "commit_every": 1},
    "bf16": {"state_precision": "bf16"},
    "8bit": {"state_precision": "8bit"},
    "forward-8bit": {"overlap": "forward", "state_precision": "8bit"},
    # torch's fused CPU AdamW kernel (bitwise equal to fused AdamW in memory, not to the
    # for-loop kernel of the other modes): the step's arithmetic costs a third
    "fused": {"fused": True},
    "bf16-fused": {"state_precision": "bf16", "fused": True},
    "8bit-fused": {"state_precision": "8bit", "fused": True},
    # the 8-bit codec on torch's ops instead of its C kernels (MODE_ENV), to compare them
    "8bit-ops": {"state_precision": "8bit"},
    "8bit-fused-ops": {"state_precision": "8bit", "fused": True},
    # the parameters and gradients streamed too (offload_parameters=True: the model is given,
    # each module's parameters are read before its forward and backward, gradients go to the
    # swap folder; --clip clips with torch.nn.utils.clip_grad_norm_, which works on them)
    "stream": {"offload_parameters": True},
    "stream-fused": {"offload_parameters": True, "fused": True},
    # ... with 256 MiB of parameters kept between uses (device_budget: Belady on their order)
    "stream-kept": {"offload_parameters": True, "device_budget": "256MiB"},
    # ... with room for every parameter between uses ("params": STREAM_RAM_FUSED), as
    # DeepSpeed's offload_param keeps them in RAM up to its max_in_cpu: only the state moves
    "stream-ram": {"offload_parameters": True, "device_budget": "params"},
    "stream-ram-fused": STREAM_RAM_FUSED,
    # ... stepping in backward unchecked (overlap="backward": no clipping, no GradScaler), so
    # the gradients never go to the swap folder, as DeepSpeed runs here (without clipping)
    "stream-ram-fused-backward": {**STREAM_RAM_FUSED, "overlap": "backward"},
    # ... what steps after backward (clipping, a GradScaler) runs on into the next forward
    "stream-ram-fused-forward": {**STREAM_RAM_FUSED, "overlap": "forward"},
    # ... committing every 10 steps (the masters the kept parameters hold wait for it)
    "stream-ram-fused-backward-every10": {
        **STREAM_RAM_FUSED,
        "overlap": "backward",
        "commit_every": 10,
    },
    # ... with bf16 moments (opt-in: changes results): half the moments' bytes
    "stream-ram-bf16-fused": {**STREAM_RAM_FUSED, "state_precision": "bf16"},
    "stream-ram-bf16-fused-backward": {
        **STREAM_RAM_FUSED,
        "state_precision": "bf16",
        "overlap": "backward",
    },
    # the state striped over several drives: swap_dir=[--dir, *--also-dir] (STRIPED)
    "striped": {},
    "fused-striped": {"fused": True},
    "8bit-fused-striped": {"state_precision": "8bit", "fused": True},
}
#: Modes whose swap_dir is --dir plus every --also-dir folder (one per drive); the others, and
#: DeepSpeed (one nvme_path), use --dir alone.
STRIPED = {"striped", "fused-striped", "8bit-fused-striped"}
#: Environment variables a mode's process gets on top of this one's.
MODE_ENV: dict[str, dict[str, str]] = {
    "8bit-ops": {"TIERSWAP_NATIVE": "0"},
    "8bit-fused-ops": {"TIERSWAP_NATIVE": "0"},
}
#: In-RAM baselines: name -> torch.optim.AdamW keyword arguments. ``ram-fused`` runs when a
#: mode uses ``fused=True``, so that each kernel has its own in-RAM figure.
RAM: dict[str, dict[str, Any]] = {
    "ram": {}, "ram-fused": {"fused": True}, "compute": {"no_step": True},
}  # fmt: skip
#: DeepSpeed configurations: name -> options of bench/_e2e_child.py's deepspeed_config.
DEEPSPEED: dict[str, dict[str, Any]] = {
    "ds-default": {"pipelined": False},
    "ds-pipelined": {"pipelined": True},
    # ZeRO-Infinity's parameter offload too (offload_param to NVMe, the model built under
    # zero.Init): the peer of the "stream" modes, run only when one of them is
    "ds-param": {"pipelined": False, "offload_param": True},
}
#: The DeepSpeed configuration that runs only beside a tierswap mode streaming parameters.
DS_PARAM = "ds-param"
TARGET_VS_DEEPSPEED = 1.5
TARGET_VS_BOUND = 1.15
#: --model gpulike (issue 29): the default's iteration against forward + backward alone, and its
#: backward against backward alone (the hooks must not block autograd).
TARGET_VS_COMPUTE = 1.10
TARGET_BACKWARD_VS_COMPUTE = 1.05


def _state_bytes(width: int, depth: int, model: str = "mlp", gpulike_layers: int = 12) -> int:
    """AdamW's exp_avg + exp_avg_sq of the model, fp32."""
    if model == "gpulike":
        return 2 * 4 * GPULIKE_LAYER_PARAMS * gpulike_layers
    params = depth * (width * width + width) + width + 1
    return 2 * 4 * params


def gpt2_params(layers: int, width: int) -> int:
    """GPT2LMHeadModel's parameters with 64 positions (the head is tied to the embedding):
    embeddings, per layer two LayerNorms, attention (3d + d projections) and MLP (4d), and the
    final LayerNorm."""
    return (GPT2_VOCAB + 64) * width + layers * (12 * width * width + 13 * width) + 2 * width


#: GPT-2's vocabulary.
GPT2_VOCAB = 50257
#: The GPU-like model's layer (bench/_e2e_child.py build_gpulike): a weight of 2048 x 4096.
GPULIKE_LAYER_PARAMS = 2048 * 4096


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _deepspeed_missing(python: str) -> str | None:
    """Why ``python`` cannot run DeepSpeed, or None when it imports."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    try:
        proc = subprocess.run(
            [python, "-c", "import deepspeed"],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return f"{python} cannot import deepspeed: {lines[-1] if lines else proc.returncode}"


def _swap_dirs(args: argparse.Namespace, config: str, swap_dir: Path) -> list[Path]:
    """The folders one configuration's run uses: ``swap_dir``, and one per --also-dir drive
    for the STRIPED modes."""
    extra = args.also_dir if config in STRIPED else []
    return [swap_dir, *(folder / swap_dir.name for folder in extra)]


def _child_command(args: argparse.Namespace, config: str, swap_dir: Path) -> tuple[list, dict]:
    """The command line and environment of one configuration's process."""
    env = dict(os.environ)
    common = ["--dir", str(swap_dir), "--iters", str(args.iters)]
    common += ["--width", str(args.width), "--depth", str(args.depth), "--model", args.model]
    common += ["--gpt2-layers", str(args.gpt2_layers), "--gpt2-width", str(args.gpt2_width)]
    common += ["--gpulike-layers", str(args.gpulike_layers)]
    if args.clip is not None:
        common += ["--clip", str(args.clip)]
    if config in RAM:
        options = ["--options", json.dumps(RAM[config])]
        return [sys.executable, str(CHILD), "--config", "ram", *options, *common], env
    if config in MODES:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(MODE_ENV.get(config, {}))
        mode = dict(MODES[config])
        if args.device_budget is not None and mode.get("device_budget") == "params":
            mode["device_budget"] = args.device_budget
        options = ["--options", json.dumps(mode), "--host-budget", str(args.host_budget)]
        for folder in _swap_dirs(args, config, swap_dir)[1:]:
            options += ["--also-dir", str(folder)]
        return [sys.executable, str(CHILD), "--config", "tierswap", *options, *common], env
    env.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    options = ["--options", json.dumps(DEEPSPEED[config])]
    return [args.deepspeed_python, str(CHILD), "--config", "deepspeed", *options, *common], env


def _stderr_tail(stderr: str, lines: int = 8) -> str:
    """The last lines of a child's stderr, without the warnings torch and DeepSpeed repeat."""
    noise = ("Warning", "return func(", "[WARNING]")
    kept = [line for line in stderr.strip().splitlines() if not any(n in line for n in noise)]
    return " | ".join(kept[-lines:])


def _spawn(args: argparse.Namespace, config: str, swap_dir: Path) -> dict[str, Any]:
    """Run one configuration in a fresh process; its JSON result, or the error it ended with.

    A process that printed its result and then failed (on exit, say) keeps its result, with the
    exit code and the end of its stderr.
    """
    cmd, env = _child_command(args, config, swap_dir)
    folders = _swap_dirs(args, config, swap_dir)
    for folder in folders:
        folder.mkdir(parents=True)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        return {"error": f"exit {proc.returncode}: {_stderr_tail(proc.stderr)}"}
    result = json.loads(lines[-1])
    if proc.returncode != 0:
        result.update(exit_code=proc.returncode, stderr_tail=_stderr_tail(proc.stderr))
    return result


def _configurations(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The configurations to run, and a note when DeepSpeed's are skipped."""
    fused = any(MODES[mode].get("fused") for mode in args.modes)
    compute = ["compute"] if args.model == "gpulike" or args.compute else []
    ram = [] if args.no_ram else ["ram", *(["ram-fused"] if fused else [])]
    configs = [*compute, *ram, *args.modes]
    if args.no_deepspeed:
        return configs, "DeepSpeed skipped (--no-deepspeed)"
    missing = _deepspeed_missing(args.deepspeed_python)
    if missing is not None:
        return configs, f"DeepSpeed skipped: {missing}"
    streams = [bool(MODES[mode].get("offload_parameters")) for mode in args.modes]
    peers = [c for c in DEEPSPEED if (c == DS_PARAM and any(streams)) or (
        c != DS_PARAM and not all(streams)
    )]  # fmt: skip
    return configs + peers, None


def measure(args: argparse.Namespace, folder: Path, configs: list[str]) -> dict[str, Any]:
    """All configurations once per round, interleaved, with a fio trial at the start of each."""
    runs: dict[str, list[dict]] = {config: [] for config in configs}
    fio: list[dict[str, float]] = []
    nbytes = (
        2 * 4 * gpt2_params(args.gpt2_layers, args.gpt2_width)
        if args.model == "gpt2"
        else _state_bytes(args.width, args.depth, args.model, args.gpulike_layers)
    )
    for round_ in range(args.rounds):
        bandwidth = fio_bandwidth(folder, nbytes)
        if bandwidth is not None:
            fio.append(bandwidth)
        for config in configs:
            start = time.perf_counter()
            result = _spawn(args, config, folder / f"{config}-r{round_}")
            runs[config].append(result)
            took = time.perf_counter() - start
            status = result.get("error") or f"{statistics.median(_timed(result, args)):.3f} s/iter"
            print(f"round {round_ + 1}/{args.rounds} {config:<18} {status} ({took:.0f} s)")
    return {"runs": runs, "fio": fio}


def _timed(result: dict[str, Any], args: argparse.Namespace) -> list[float]:
    """The iterations that count: 2..--iters (the first creates the optimizer state)."""
    return result.get("times", [])[1 : args.iters]


def _per_iteration(results: list[dict], key: str, args: argparse.Namespace) -> dict | None:
    """Median bytes read and written per counted iteration of a counter (``disk``, ...)."""
    rows = [row for r in results for row in r.get(key, [])[1 : args.iters]]
    if not rows:
        return None
    return {k: statistics.median(row[k] for row in rows) for k in ("read", "written")}


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: median and range of the counted iterations, peak RSS, bytes moved."""
    summary = {}
    for config, results in runs.items():
        ok = [r for r in results if "error" not in r]
        times = [t for r in ok for t in _timed(r, args)]
        if not times:
            summary[config] = {"error": results[-1].get("error", "no iterations")}
            continue
        summary[config] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "peak_rss": max(r["peak_rss"] for r in ok),
            "disk_per_iter": _per_iteration(ok, "disk", args),
            "swap_bytes_per_iter": _per_iteration(ok, "swap_bytes", args),
            "phases": _phase_medians(ok, args),
            "schedule": _schedules(ok),
            "parameters": _parameters(ok),
            "failed_rounds": len(results) - len(ok),
            "nonzero_exits": sum(1 for r in ok if r.get("exit_code")),
        }
    return summary


def _schedules(results: list[dict]) -> list[dict] | None:
    """What tierswap's schedule did in each round (``tier_stats()["schedule"]``)."""
    found = [r["tier_stats"]["schedule"] for r in results if "schedule" in r.get("tier_stats", {})]
    return found or None


def _parameters(results: list[dict]) -> dict[str, int] | None:
    """What streaming parameters did in the last round (``tier_stats()["parameters"]``)."""
    found = [
        r["tier_stats"]["parameters"] for r in results if "parameters" in r.get("tier_stats", {})
    ]
    return found[-1] if found else None


def _phase_medians(results: list[dict], args: argparse.Namespace) -> dict[str, float] | None:
    """Median seconds of forward, backward and step over the counted iterations."""
    phases = [r["phases"] for r in results if "phases" in r]
    if not phases:
        return None
    return {
        name: statistics.median(t for p in phases for t in p[name][1 : args.iters])
        for name in ("forward", "backward", "step")
    }


def io_bound(
    moved: dict[str, float] | None, fio: list[dict[str, float]], capped: bool = False
) -> float | None:
    """Seconds to read and write ``moved`` bytes at fio's median sequential bandwidth.

    One disk reads and writes one after the other (the sum); under ``--throttle`` each
    direction has its own cap on a faster disk, so they overlap (the larger of the two).
    """
    if moved is None or not fio:
        return None
    read_s = moved["read"] / statistics.median(f["read"] for f in fio)
    write_s = moved["written"] / statistics.median(f["write"] for f in fio)
    return max(read_s, write_s) if capped else read_s + write_s


def targets(summary: dict[str, dict], bound: float | None) -> dict[str, float | None]:
    """tierswap default against the best DeepSpeed configuration and against max(ram, bound)."""
    default = summary.get("default", {}).get("median_s")
    ram = summary.get("ram", {}).get("median_s")
    ds = [summary[c]["median_s"] for c in DEEPSPEED if "median_s" in summary.get(c, {})]
    best_ds = min(ds) if ds else None
    vs_ds = best_ds / default if default and best_ds else None
    floor = max(ram, bound or 0.0) if ram else None
    return {
        "best_deepspeed_s": best_ds,
        "default_speedup_vs_best_deepspeed": vs_ds,
        "default_vs_max_ram_io_bound": default / floor if default and floor else None,
    }


def hiding(summary: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """With a ``compute`` run (``--model gpulike``), per configuration: its iteration against
    compute alone, the step's *exposed* seconds (iteration - compute) and, for a tierswap mode,
    the fraction of the step it hides: 1 - exposed / exposed of ``none`` (``overlap=None``:
    every slice steps after backward, nothing hidden), when that mode ran."""
    compute = summary.get("compute", {}).get("median_s")
    if not compute:
        return {}
    none = summary.get("none", {}).get("median_s")
    whole = none - compute if none and none > compute else None
    out: dict[str, dict[str, float | None]] = {}
    for config, row in summary.items():
        if config == "compute" or "median_s" not in row:
            continue
        exposed = row["median_s"] - compute
        out[config] = {
            "vs_compute": row["median_s"] / compute,
            "exposed_s": exposed,
            "hidden": 1 - exposed / whole if whole and config in MODES else None,
        }
    return out


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _mb(moved: dict[str, float] | None) -> str:
    return "-" if moved is None else f"{moved['read'] / 1e6:.0f} / {moved['written'] / 1e6:.0f}"


def print_table(
    summary: dict[str, dict], best_ds: float | None, hidden: dict[str, dict] | None = None
) -> None:
    ram = summary.get("ram", {}).get("median_s")
    head = f"{'config':<18} {'s/iter (min-max)':<22} {'x ram':>7} {'x best DS':>9} "
    print(head + f"{'peak RSS':>11} {'disk MB/iter r / w':>19}")
    for config, row in summary.items():
        if "error" in row:
            print(f"{config:<18} FAILED: {row['error']}")
            continue
        spread = f"{row['median_s']:.3f} ({row['min_s']:.3f}-{row['max_s']:.3f})"
        print(
            f"{config:<18} {spread:<22} {_ratio(row['median_s'], ram):>7} "
            f"{_ratio(row['median_s'], best_ds):>9} {format_size(row['peak_rss']):>11} "
            f"{_mb(row['disk_per_iter']):>19}"
        )
        if row.get("phases"):
            ph = row["phases"]
            print(f"  forward {ph['forward']:.3f} s, backward {ph['backward']:.3f} s, "
                  f"step {ph['step']:.3f} s")  # fmt: skip
        hid = (hidden or {}).get(config)
        if hid:
            hides = hid["hidden"]
            share = "" if hides is None else f", hides {hides:.0%} of overlap=None's"
            print(f"  {hid['vs_compute']:.2f}x compute alone; the step exposes "
                  f"{hid['exposed_s']:.3f} s{share}")  # fmt: skip
        if row.get("parameters"):
            par = row["parameters"]
            print(f"  parameters: {par['streamed']} streamed, held at most "
                  f"{format_size(par['peak_bytes'])}; read {format_size(par['fetched_bytes'])}, "
                  f"gradients kept {format_size(par['kept_grad_bytes'])} over the run")  # fmt: skip
        for sched in row.get("schedule") or []:
            if sched.get("overlap") in ("auto", "forward"):
                print(
                    f"  schedule: {sched['mode']}; slices stepped in backward "
                    f"{sched['speculated']}, redone {sched['redone']}, after backward "
                    f"{sched['after_backward']}, paused steps {sched['paused_steps']}"
                )
        if row["failed_rounds"] or row["nonzero_exits"]:
            print(f"  ({row['failed_rounds']} round(s) failed, {row['nonzero_exits']} exited "
                  "non-zero after printing a result; see the JSON)")  # fmt: skip


def print_targets(report: dict[str, Any]) -> None:
    fio, bound, goals = report["fio"], report["io_bound_s"], report["targets"]
    if bound is not None:
        moved = report["summary"]["default"]["swap_bytes_per_iter"]  # the bound exists: it ran
        read = format_size(statistics.median(f["read"] for f in fio))
        write = format_size(statistics.median(f["write"] for f in fio))
        print(f"I/O bound {bound:.3f} s/iter: tierswap default moves {_mb(moved)} MB per iteration "
              f"(tier_stats); fio O_DIRECT read {read}/s, write {write}/s")  # fmt: skip
    vs_ds = goals["default_speedup_vs_best_deepspeed"]
    if vs_ds is not None:
        verdict = "PASS" if vs_ds >= TARGET_VS_DEEPSPEED else "FAIL"
        print(f"tierswap default vs best DeepSpeed: {vs_ds:.2f}x faster "
              f"(goal >= {TARGET_VS_DEEPSPEED}x) {verdict}")  # fmt: skip
    vs_bound = goals["default_vs_max_ram_io_bound"]
    if vs_bound is not None and bound is None:  # without fio the goal cannot be judged
        print(f"tierswap default / ram: {vs_bound:.2f}x (the I/O bound is not measured: fio is "
              "not installed; apt-get install fio)")  # fmt: skip
    elif vs_bound is not None:
        verdict = "PASS" if vs_bound <= TARGET_VS_BOUND else "FAIL"
        print(f"tierswap default / max(ram, I/O bound): {vs_bound:.2f}x "
              f"(goal <= {TARGET_VS_BOUND}x) {verdict}")  # fmt: skip
    summary, default = report["summary"], report["hiding"].get("default")
    if default is not None:
        verdict = "PASS" if default["vs_compute"] <= TARGET_VS_COMPUTE else "FAIL"
        print(f"tierswap default / compute alone: {default['vs_compute']:.2f}x "
              f"(goal <= {TARGET_VS_COMPUTE}x) {verdict}")  # fmt: skip
        phases = summary["default"].get("phases"), summary["compute"].get("phases")
        if all(phases):
            ratio = phases[0]["backward"] / phases[1]["backward"]
            verdict = "PASS" if ratio <= TARGET_BACKWARD_VS_COMPUTE else "FAIL"
            print(f"tierswap default's backward / backward alone: {ratio:.2f}x "
                  f"(goal <= {TARGET_BACKWARD_VS_COMPUTE}x) {verdict}")  # fmt: skip


def _machine() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return {
        "cpus": os.cpu_count(),
        "load_average_1_5_15_min": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def report_of(args: argparse.Namespace, measured: dict, note: str | None) -> dict[str, Any]:
    summary = summarize(args, measured["runs"])
    moved = summary.get("default", {}).get("swap_bytes_per_iter")
    bound = io_bound(moved, measured["fio"], capped=args.throttle is not None)
    return {
        "machine": _machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "modes": {m: MODES[m] for m in args.modes},
        "deepspeed": DEEPSPEED,
        "note": note,
        "fio": measured["fio"],
        "io_bound_s": bound,
        "summary": summary,
        "targets": targets(summary, bound),
        "hiding": hiding(summary),
        "runs": measured["runs"],
    }


def _modes(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=[mode for mode in MODES if mode not in STRIPED],
        help=f"comma-separated tierswap modes (default: all but {', '.join(sorted(STRIPED))}, "
        f"which need --also-dir; known: {', '.join(MODES)})",
    )
    p.add_argument(
        "--deepspeed-python",
        default=sys.executable,
        help="interpreter with torch + deepspeed (default: this one)",
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed runs")
    p.add_argument(
        "--no-ram", action="store_true",
        help="skip the in-RAM baselines (a model whose state does not fit in RAM)",
    )  # fmt: skip
    p.add_argument(
        "--compute", action="store_true",
        help="add the 'compute' run (forward and backward in RAM, no optimizer: parameters "
        "and gradients must fit) for any model; --model gpulike always has it",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration")
    p.add_argument("--iters", type=int, default=6, help="iterations per run; 2..iters count")
    p.add_argument("--host-budget", type=parse_size, default="128MiB")
    p.add_argument(
        "--device-budget", type=parse_size, default=None,
        help="device_budget of the stream-ram modes (default: their model's parameter bytes); "
        "without a GPU what the parameters leave of it holds optimizer state",
    )  # fmt: skip
    p.add_argument("--dir", type=Path, default=None, help="folder for swap files (default: tmp)")
    p.add_argument(
        "--also-dir", type=Path, action="append", default=[], metavar="DIR",
        help=f"a folder on another drive; the modes {', '.join(sorted(STRIPED))} stripe their "
        "state over --dir and these (swap_dir=[...]); --throttle caps its drive too",
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="default: bench/out/e2e-<time>.json")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration run")
    p.add_argument(
        "--throttle", type=rates, default=None, metavar="READ,WRITE",
        help="cap the swap folder's disk at READ and WRITE bytes/s for every configuration "
        "and the fio trial (e.g. 500MB,500MB; cgroup v1 blkio, needs root; bench/_throttle.py)",
    )  # fmt: skip
    p.add_argument(
        "--clip", type=float, default=None, metavar="MAX_NORM",
        help="torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) before every step "
        "(every configuration; DeepSpeed's as its gradient_clipping: MAX_NORM; the gpulike "
        "model's gradient norm is about 10)",
    )  # fmt: skip
    p.add_argument("--width", type=int, default=4096, help="layer width (smaller: smoke tests)")
    p.add_argument("--depth", type=int, default=6, help="hidden blocks")
    p.add_argument("--gpt2-layers", type=int, default=12, help="--model gpt2: layers")
    p.add_argument("--gpt2-width", type=int, default=768, help="--model gpt2: model width")
    p.add_argument(
        "--gpulike-layers", type=int, default=12,
        help="--model gpulike: layers of 8.4M params (12: 100.7M; 156: 1.31B)",
    )  # fmt: skip
    p.add_argument(
        "--model", choices=["mlp", "gpt2", "gpulike"], default="mlp",
        help="mlp: the synthetic model above; gpt2: GPT-2 124M (transformers, random init), "
        "batch 4 x 64 tokens; gpulike: 12 fp32 weights of 2048 x 4096 (--gpulike-layers) "
        "whose forward and backward wait 40 and 80 ms a layer off the CPU, as on a GPU (adds "
        "the 'compute' run: "
        "forward and backward alone)",
    )  # fmt: skip
    args = p.parse_args(argv)
    striped = STRIPED.intersection(args.modes)
    if striped and not args.also_dir:
        p.error(f"modes {sorted(striped)} need --also-dir (a folder on another drive)")
    if args.iters < 2 or args.rounds < 1:
        p.error(f"--iters {args.iters} / --rounds {args.rounds}: need iters >= 2, rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    configs, note = _configurations(args)
    if note:
        print(note)
    parent = args.dir or Path(tempfile.mkdtemp(prefix="tierswap-e2e-"))
    for folder in [parent, *args.also_dir]:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        with bench_folder(parent) as folder, contextlib.ExitStack() as stack:
            if args.throttle is not None:
                drives = [folder, *args.also_dir]
                stack.enter_context(throttled([(d, *args.throttle) for d in drives]))
                read, write = (format_size(b) for b in args.throttle)
                print(f"disks under {', '.join(map(str, drives))} throttled to read {read}/s, "
                      f"write {write}/s each")  # fmt: skip
            measured = measure(args, folder, configs)
    finally:
        if args.dir is None:
            shutil.rmtree(parent, ignore_errors=True)
    report = report_of(args, measured, note)
    print_table(report["summary"], report["targets"]["best_deepspeed_s"], report["hiding"])
    print_targets(report)
    path = args.json or ROOT / "bench" / "out" / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
