"""GPU check for SwapOptimizer: equivalence, tiers and overlap on a CUDA device, < 5 minutes.

    python bench/gpu_check.py [--dir /nvme/tmp] [--json gpu_check.json]

CI has no GPU; run this on a machine with one. Each check prints PASS/FAIL and a figure; the exit
status is non-zero when any check fails. Checks:
  1. bitwise, streamed: CUDA fp32 params, device tier on, host budget a quarter of the state
     (slices stream NVMe -> host -> device every step): params and state equal plain AdamW on
     the GPU (foreach, the CUDA default) and with fused=True.
  2. bitwise, device-resident: a device budget that holds the whole state: after the first step
     nothing is read from disk, the device tier reports what it holds and its hits.
  3. bitwise, device tier off: the step runs on fp32 host masters; equal to plain AdamW run on
     CPU copies fed the same gradients.
  4. mixed precision: bf16 CUDA params, fp32 masters swapped; equal to a hand-written
     fp32-master reference on the GPU.
  5. pinned host buffers: the engine's host buffers are page-locked.
  6. overlap: after backward the pipeline already holds reads of the step's first slices; the
     iteration with overlap="forward" (the step runs into the next forward) against
     overlap=None, on a scratch store (no speculation), both bitwise equal, with CUDA-event
     timings of forward, backward, step.
  7. device memory: peak allocated <= model + grads + activations + device budget + 10%;
     with what the device ledger counted at its peak, the peak with fused AdamW (no
     temporaries), and the bytes alive at the peak by the frame that allocated them (the
     caching allocator's trace), to tell what the ledger does not count.
  8. copy/step overlap: slices that the host tier holds stream through the device (slices
     read from the disk arrive after the step before them has ended: they wait for the disk,
     not the copy): each slice's host-to-device copy (side stream) and step (compute stream)
     timed with CUDA events on one timeline: the copies overlap the steps (seconds both ran,
     copies that ran during a step), and the result is bitwise equal to torch's CUDA AdamW.
  9. speculation (the default, overlap="auto"): slices step on the worker during backward,
     step() checks them; bitwise equal to overlap=None with clipping that never and that
     always triggers (nothing redone / slices redone on the CPU; on a GPU the worker's slices
     may queue behind the clipping's kernels and step with the clipped gradients), with
     CUDA-event seconds of backward under both (the hooks must not block it: compare the
     two); a durable store, so close() commits slices resident on the device.
 10. parameter streaming (offload_parameters=True, issue 30): bitwise equal to the same
     optimizer that does not stream, torch's clipping on; no parameter holds device memory
     between steps, and the training's peak device bytes drop by at least the parameters'
     (their gradients leave too).
 11. parameter copies overlap compute: streamed parameters reach the GPU on the upload stream
     while the module before still computes (4096-row batches: each layer's kernels take
     about a millisecond): from the second step on a module's copies are issued at the
     pre-hook of the module before, once its values are in host memory
     (``uploaded_ahead_bytes``); copies and each module's forward timed with CUDA events on
     one timeline (copies that ran during a forward), bitwise equal to the optimizer that does
     not stream.

 12. the standalone swap API on the device: a TierCache whose device tier is GPU memory, with
     more items than its budgets hold (fp32, bf16, and a view of a parameter that a step changed
     in place under no_grad, put with grad mode on): each comes back bitwise after its trips
     device -> host -> NVMe and back, edits made in place on the device under ``pinned`` reach
     the store, and the device tier's peak stays within its budget.

On --device cpu (a dry run) the same checks run their code paths on the CPU; timings are
wall clock and the overlap figures are not measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tierswap as ts
from tierswap.engine import CudaTransfers, ToDevice, allocate
from tierswap.optim import _assembly as assembly_module
from tierswap.optim.stream import _swap as stream_swap

RESULTS: dict[str, dict] = {}
DEVICE = "cuda"  # --device cpu runs the same code paths without a GPU (a dry run of the script)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def record(name: str, ok: bool, **figures: object) -> None:
    RESULTS[name] = {"ok": bool(ok), **figures}
    shown = ", ".join(f"{k}={v}" for k, v in figures.items())
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {shown}", flush=True)


def make_model(dtype: torch.dtype = torch.float32, width: int = 1024, depth: int = 6):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(DEVICE, dtype)


def batches(n: int, width: int = 1024, dtype: torch.dtype = torch.float32):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    return [torch.randn(64, width, device=DEVICE, generator=gen, dtype=dtype) for _ in range(n)]


def loss_of(model, x):
    return model(x).float().square().mean()


def min_budget(params, **kwargs) -> int:
    try:
        ts.SwapOptimizer(params, host_budget=1, **kwargs).close()
    except ts.errors.ConfigError as exc:
        return int(re.search(r"minimum is .*?\((\d+) bytes\)", str(exc)).group(1))
    raise RuntimeError("a 1-byte budget was accepted")


def stream_budget(model, **kwargs) -> int:
    """A quarter of the AdamW state: every slice streams from the disk each step."""
    state = 8 * sum(p.numel() for p in model.parameters())
    return max(state // 4, min_budget(model.parameters(), **kwargs))


def same(a, b) -> bool:
    return all(torch.equal(x, y.to(x.device)) for x, y in zip(a, b, strict=True))


def same_state(plain: dict, swap: dict) -> bool:
    for index, state in plain["state"].items():
        for key, value in state.items():
            theirs = swap["state"][index][key]  # (fused AdamW keeps "step" on the GPU)
            if torch.is_tensor(value) and not torch.equal(value.cpu(), theirs.cpu()):
                return False
    return plain["state"].keys() == swap["state"].keys()


def check_bitwise_device(folder: Path, steps: int, fused: bool) -> None:
    plain_model = make_model()
    swap_model = copy.deepcopy(plain_model)
    kwargs = {"lr": 1e-3, "weight_decay": 0.01, "fused": fused}
    plain = torch.optim.AdamW(plain_model.parameters(), **kwargs)
    budget = stream_budget(swap_model, device_budget=1 << 40, **kwargs)
    opt = ts.SwapOptimizer(
        swap_model.parameters(), torch.optim.AdamW, swap_dir=folder / f"dev-{fused}",
        host_budget=budget, device_budget=budget, durable=False, **kwargs,
    )  # fmt: skip
    with opt:
        for x in batches(steps):
            for model, o in ((plain_model, plain), (swap_model, opt)):
                o.zero_grad()
                loss_of(model, x).backward()
                o.step()
        sync()
        nvme = opt.tier_stats()["nvme"]
        ok = same(plain_model.parameters(), swap_model.parameters())
        ok = ok and same_state(plain.state_dict(), opt.state_dict())
        record(f"bitwise device tier (fused={fused})", ok and nvme["bytes_read"] > 0,
               steps=steps, nvme_bytes_read=nvme["bytes_read"], tier=opt.tier)  # fmt: skip


def check_device_resident(folder: Path, steps: int) -> None:
    plain_model = make_model()
    swap_model = copy.deepcopy(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    state = 8 * sum(p.numel() for p in swap_model.parameters())
    opt = ts.SwapOptimizer(
        swap_model.parameters(), torch.optim.AdamW, lr=1e-3, swap_dir=folder / "resident",
        host_budget=state // 4, device_budget=2 * state, durable=False, commit_every=0,
    )  # fmt: skip
    with opt:
        for index, x in enumerate(batches(steps)):
            for model, o in ((plain_model, plain), (swap_model, opt)):
                o.zero_grad()
                loss_of(model, x).backward()
                o.step()
            if index == 0:
                read_after_first = opt.tier_stats()["nvme"]["bytes_read"]
        sync()
        stats = opt.tier_stats()
        ok = same(plain_model.parameters(), swap_model.parameters())
        ok = ok and same_state(plain.state_dict(), opt.state_dict())
        device = stats["device"]
        held = set(opt.placement.values()) == {"device"} and device["used"] > 0
        no_reads = stats["nvme"]["bytes_read"] == read_after_first
        later_reads = stats["nvme"]["bytes_read"] - read_after_first
        record("bitwise, state resident in the device tier", ok and held and no_reads,
               device_used=device["used"], device_hits=device["hits"],
               nvme_bytes_read_after_first_step=later_reads)  # fmt: skip


def check_bitwise_host_step(folder: Path, steps: int) -> None:
    swap_model = make_model()
    cpu_params = [p.detach().cpu().clone().requires_grad_() for p in swap_model.parameters()]
    ref = torch.optim.AdamW(cpu_params, lr=1e-3)
    budget = stream_budget(swap_model, lr=1e-3)
    opt = ts.SwapOptimizer(
        swap_model.parameters(), torch.optim.AdamW, lr=1e-3, swap_dir=folder / "host",
        host_budget=budget, durable=False,
    )  # fmt: skip
    with opt:
        for x in batches(steps):
            opt.zero_grad()
            loss_of(swap_model, x).backward()
            for p, c in zip(swap_model.parameters(), cpu_params, strict=True):
                c.grad = p.grad.cpu()
            opt.step()
            ref.step()
        ok = same(cpu_params, swap_model.parameters())
        slots = [seg.slot for piece in opt.slices for seg in piece.segments]
        masters = all(slot.has_master for slot in slots) or DEVICE == "cpu"
        record("bitwise host step of CUDA params (device tier off)", ok and masters,
               tier=opt.tier, masters=masters)  # fmt: skip


def check_mixed_precision(folder: Path, steps: int) -> None:
    ref_model = make_model(torch.bfloat16)
    swap_model = copy.deepcopy(ref_model)
    masters = [p.detach().float().requires_grad_() for p in ref_model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-3)
    opt = ts.SwapOptimizer(swap_model.parameters(), torch.optim.AdamW, lr=1e-3,
                           swap_dir=folder / "bf16", host_budget="64MiB",
                           device_budget="32MiB", durable=False)  # fmt: skip
    with opt:
        for x in batches(steps, dtype=torch.bfloat16):
            opt.zero_grad()
            loss_of(swap_model, x).backward()
            for p in ref_model.parameters():
                p.grad = None
            loss_of(ref_model, x).backward()
            for p, m in zip(ref_model.parameters(), masters, strict=True):
                m.grad = p.grad.float()
            ref.step()
            with torch.no_grad():
                for p, m in zip(ref_model.parameters(), masters, strict=True):
                    p.copy_(m)
            opt.step()
        ok = same(ref_model.parameters(), swap_model.parameters())
        record("mixed precision bf16 with fp32 masters", ok, tier=opt.tier)


def check_pinned(folder: Path) -> None:
    """The engine's one allocator makes every host buffer (pipeline and cache) page-locked."""
    buffers = [allocate((n,), torch.float32) for n in (1, 1024, 1 << 20)]
    pinned = all(b.is_pinned() for b in buffers)
    record("pinned host buffers", pinned, buffers=len(buffers))


class _Phases:
    """Forward, backward and step seconds of one iteration, from CUDA events (wall clock on
    the CPU dry run)."""

    def __init__(self) -> None:
        self.marks: list[object] = []

    def mark(self) -> None:
        if DEVICE == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        sync()
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if DEVICE == "cuda":
            return [a.elapsed_time(b) / 1000 for a, b in pairs]  # type: ignore[attr-defined]
        return [b - a for a, b in pairs]  # type: ignore[operator]


def _iteration(model, opt, x) -> list[float]:
    """Seconds of forward, backward and ``opt.step()`` of one iteration."""
    phases = _Phases()
    opt.zero_grad()
    phases.mark()
    loss = loss_of(model, x)
    phases.mark()
    loss.backward()
    phases.mark()
    opt.step()
    phases.mark()
    return phases.seconds()


def check_overlap(folder: Path, steps: int) -> None:
    """Reads start in backward; overlap="forward" against overlap=None, both bitwise."""
    base = make_model(width=4096, depth=8)  # ~134M params: ~1 GiB of AdamW state
    state = 8 * sum(p.numel() for p in base.parameters())
    data = batches(steps + 1, width=4096)
    figures: dict[str, object] = {}
    finals = {}
    for mode in (None, "forward"):
        model = copy.deepcopy(base)
        opt = ts.SwapOptimizer(model.parameters(), swap_dir=folder / f"overlap-{mode}",
                               host_budget=state // 4, device_budget=state // 4,
                               durable=False, overlap=mode)  # fmt: skip
        with opt:
            _iteration(model, opt, data[0])
            opt.synchronize()
            opt.zero_grad()
            loss_of(model, data[1]).backward()
            figures[f"held_after_backward_{mode}"] = opt.tier_stats()["host"]["used"]
            opt.step()
            times = [_iteration(model, opt, x) for x in data[2:]]
            opt.synchronize()
            iteration = min(sum(t) for t in times)
            figures[f"iteration_s_{mode}"] = round(iteration, 4)
            figures[f"forward_backward_step_s_{mode}"] = [round(v, 4) for v in min(times, key=sum)]
            figures[f"stall_s_{mode}"] = round(opt.tier_stats()["stall_seconds"], 3)
            finals[mode] = [p.detach().clone() for p in model.parameters()]
    ok = same(finals[None], finals["forward"])
    ok = ok and figures["held_after_backward_None"] > 0
    record("overlap: reads start in backward; forward mode bitwise", ok, **figures)


def check_speculation(folder: Path, steps: int, width: int = 2048) -> None:
    """The default, overlap="auto": slices step on the worker during backward and step()
    checks them. Bitwise equal to overlap=None with clipping that never triggers (``max_norm``
    twice each step's gradient norm: nothing redone) and that always does (half of it: slices
    redone, then speculation pauses); CUDA-event seconds of backward with the hooks handing
    slices over, against overlap=None's (the figure to read: the hooks must not block)."""
    base = make_model(width=width, depth=8)  # 2048: ~34M params, ~270 MB of AdamW state
    state = 8 * sum(p.numel() for p in base.parameters())
    data = batches(steps + 2, width=width)
    figures: dict[str, object] = {}
    ok = True
    for clip in (2.0, 0.5):  # max_norm as a share of each step's gradient norm
        finals = {}
        for mode in (None, "auto"):
            model = copy.deepcopy(base)
            opt = ts.SwapOptimizer(model.parameters(), swap_dir=folder / f"spec-{mode}-{clip}",
                                   host_budget=state // 4, device_budget=state // 4,
                                   overlap=mode)  # fmt: skip
            backward = []
            with opt:
                for x in data:
                    opt.zero_grad()
                    loss = loss_of(model, x)
                    phases = _Phases()
                    phases.mark()
                    loss.backward()
                    phases.mark()
                    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip * norm.item())
                    opt.step()
                    backward += phases.seconds()
                opt.synchronize()
                schedule = opt.tier_stats()["schedule"]
            finals[mode] = [p.detach().clone() for p in model.parameters()]
            figures[f"backward_s_{mode}_clip{clip:g}"] = round(min(backward[1:]), 4)
            if mode == "auto":
                figures[f"speculated_clip{clip:g}"] = schedule["speculated"]
                figures[f"redone_clip{clip:g}"] = schedule["redone"]
                # On a GPU backward returns once its kernels are queued, and the worker's
                # slices often queue behind the clipping's: they step with the clipped
                # gradients, their stamps hold, nothing is redone. (A stamp is taken before
                # its slice steps, on the same stream: a step that read bytes its stamp did
                # not see is redone, as the stamp no longer holds.)
                redone_ok = (
                    schedule["redone"] == 0
                    if clip > 1
                    else schedule["redone"] > 0 or DEVICE == "cuda"
                )
                ok = ok and schedule["speculated"] > 0 and redone_ok
        figures[f"bitwise_clip{clip:g}"] = same(finals[None], finals["auto"])
        ok = ok and figures[f"bitwise_clip{clip:g}"]
    record("speculation (the default): bitwise with clipping; backward seconds", ok, **figures)


def _peak_of(model, opt, data, breakdown: dict | None = None) -> int:
    """Peak device bytes allocated over training steps after the first (``opt=None``: no step).

    The first step is left out: it creates the state, and torch's freshly made state of each
    slice lives until its write-behind ends. ``breakdown``: filled with what was allocated in
    those steps and alive at their peak, by where it was allocated (:func:`_live_at_peak`).
    """
    model.zero_grad(set_to_none=True)
    loss_of(model, data[0]).backward()
    if opt is not None:
        opt.step()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if breakdown is not None:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    try:
        for x in data[1:]:
            model.zero_grad(set_to_none=True)
            loss_of(model, x).backward()
            if opt is not None:
                opt.step()
        sync()
        if breakdown is not None:
            breakdown.update(_live_at_peak(torch.cuda.memory._snapshot()))
    finally:
        if breakdown is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
    return torch.cuda.max_memory_allocated()


def _live_at_peak(snapshot: dict) -> dict:
    """From the caching allocator's trace: the most bytes allocated at once since recording
    began, and those bytes by the frame that allocated them (the innermost in tierswap, else
    in torch's optimizers or autograd, else the innermost Python frame), largest first."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _allocated_at(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_frame: dict[str, int] = {}
    for size, frame in at_peak.values():
        by_frame[frame] = by_frame.get(frame, 0) + size
    top = sorted(by_frame.items(), key=lambda item: -item[1])[:8]
    return {"traced_peak": peak, "live_at_peak_by_frame": top}


def _allocated_at(frames: list) -> str:
    names = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames]
    for marks in (("tierswap",), ("torch/optim", "torch/autograd")):
        for frame, name in zip(frames, names, strict=True):
            if any(mark in frame["filename"] for mark in marks):
                return name
    return names[0] if names else "?"


def check_device_memory(folder: Path, steps: int) -> None:
    """With the optimizer, the peak may exceed forward + backward alone by the device budget.
    Figures beside: the device ledger's own peak (what the engine counted), the bytes above
    the parameters and gradients, and the same run with fused AdamW (torch's foreach AdamW
    makes a temporary of each slice's size as it steps, which the ledger does not count)."""
    model = make_model(width=2048, depth=8)
    data = batches(steps + 1, width=2048)
    params_and_grads = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    without = _peak_of(model, None, data)
    device_budget = max(64 << 20, min_budget(model.parameters(), device_budget=1 << 40))
    peaks, ledger, breakdown = {}, {}, {}
    for fused in (False, True):
        opt = ts.SwapOptimizer(model.parameters(), torch.optim.AdamW, fused=fused,
                               swap_dir=folder / f"mem-{fused}", host_budget=device_budget,
                               device_budget=device_budget, durable=False)  # fmt: skip
        with opt:
            try:
                peaks[fused] = _peak_of(model, opt, data, None if fused else breakdown)
            except Exception as exc:  # (the allocator's history is a private torch API)
                breakdown["error"] = f"{type(exc).__name__}: {exc}"
                peaks[fused] = _peak_of(model, opt, data)
            ledger[fused] = opt.tier_stats()["device"].get("peak")
    peak = peaks[False]
    limit = without + 1.1 * device_budget
    record("device memory <= model + grads + activations + device budget (+10%)",
           peak <= limit, peak=peak, forward_backward_peak=without,
           device_budget=device_budget, ledger_peak=ledger[False],
           above_params_and_grads=peak - params_and_grads, peak_fused=peaks[True],
           ledger_peak_fused=ledger[True], **breakdown)  # fmt: skip


def check_parameter_streaming(folder: Path, steps: int) -> None:
    """offload_parameters=True on the device: bitwise equal to the same optimizer that does not
    stream (both step fp32 masters on the host), clipping included; the parameters hold no
    device memory between steps, and the training peak drops by about the parameters and
    gradients (on the GPU, the peak device bytes; on the CPU dry run, not measured)."""
    plain_model = make_model(width=2048, depth=6)
    swap_model = copy.deepcopy(plain_model)
    data = batches(steps, width=2048)
    peaks = {}
    for name, model in (("plain", plain_model), ("stream", swap_model)):
        streamed = name == "stream"
        opt = ts.SwapOptimizer(
            model if streamed else model.parameters(), torch.optim.AdamW, lr=1e-3,
            swap_dir=folder / f"stream-{name}", host_budget="64MiB", durable=False,
            offload_parameters=streamed,
        )  # fmt: skip
        with opt:
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for x in data:
                loss_of(model, x).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
            sync()
            held = sum(p.untyped_storage().nbytes() for p in model.parameters())
            peaks[name] = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
            stats = opt.tier_stats().get("parameters", {})
    param_bytes = sum(p.numel() * 4 for p in plain_model.parameters())
    ok = same(plain_model.parameters(), swap_model.parameters()) and held == 0
    if DEVICE == "cuda":  # parameters and gradients (2 x param_bytes) leave, the largest stays
        ok = ok and peaks["stream"] <= peaks["plain"] - param_bytes
    record("parameter streaming: bitwise, no parameter memory between steps, lower peak",
           ok, steps=steps, peak_plain=peaks["plain"], peak_stream=peaks["stream"],
           param_bytes=param_bytes, streamed_peak_bytes=stats.get("peak_bytes"))  # fmt: skip


class _TimedTransfers(CudaTransfers):
    """CUDA's transfer layer with an event pair around each host-to-device copy on its upload
    stream, so that copies and steps can be laid on one GPU timeline."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.copies: list[tuple[object, object]] = []

    def to_device(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None = None,
        *,
        upload_memory: bool = False,
    ) -> ToDevice:
        upload, _ = self.streams
        if device_tensor is not None and not upload_memory:  # as the copy will: the begin
            upload.wait_stream(torch.cuda.current_stream())  # event marks the copy's start
        begin = upload.record_event(torch.cuda.Event(enable_timing=True))
        copy = super().to_device(host_tensor, device_tensor, upload_memory=upload_memory)
        self.copies.append((begin, upload.record_event(torch.cuda.Event(enable_timing=True))))
        return copy


def _timed_adamw(spans: list) -> type:
    """AdamW that records an event pair on the compute stream around each step it runs (once
    ``spans`` holds a start marker: the probes at construction are left out)."""

    class TimedAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            if DEVICE != "cuda" or not spans:
                return super().step(closure)
            begin = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
            loss = super().step(closure)
            end = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
            spans.append((begin, end))
            return loss

    return TimedAdamW


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Milliseconds covered by both sets of intervals."""
    return sum(
        max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in _merged(a) for y0, y1 in _merged(b)
    )


def _timeline(start, pairs) -> list[tuple[float, float]]:
    return [(start.elapsed_time(b), start.elapsed_time(e)) for b, e in pairs]


def _copy_step_figures(start, copies, steps) -> dict[str, object]:
    """Copy and step seconds on the GPU, the time both ran, and how many copies ran (in part)
    while a step ran."""
    copy_ms, step_ms = _timeline(start, copies), _timeline(start, steps)
    during = sum(1 for c in copy_ms if _overlap([c], step_ms) > 0)
    return {
        "copies": len(copy_ms),
        "steps": len(step_ms),
        "copy_s": round(sum(hi - lo for lo, hi in copy_ms) / 1000, 4),
        "step_s": round(sum(hi - lo for lo, hi in step_ms) / 1000, 4),
        "overlap_s": round(_overlap(copy_ms, step_ms) / 1000, 4),
        "copies_during_a_step": during,
    }


def check_copy_overlap(folder: Path, steps: int) -> None:
    """Slices held in host memory, streamed through the device: copies in on the side stream
    overlap the steps; bitwise with torch."""
    plain_model = make_model(width=2048, depth=8)  # ~34M params: ~270 MB of AdamW state
    swap_model = copy.deepcopy(plain_model)
    state = 8 * sum(p.numel() for p in plain_model.parameters())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    spans: list = []
    timed = _TimedTransfers(torch.device("cuda")) if DEVICE == "cuda" else None
    original = assembly_module.transfers_for
    if timed is not None:
        assembly_module.transfers_for = lambda device: timed
    try:
        opt = ts.SwapOptimizer(swap_model.parameters(), _timed_adamw(spans), lr=1e-3,
                               swap_dir=folder / "copy-overlap", host_budget=2 * state,
                               device_budget=state // 4, durable=False, commit_every=0)  # fmt: skip
    finally:
        assembly_module.transfers_for = original
    with opt:
        for index, x in enumerate(batches(steps, width=2048)):
            if index == 1 and DEVICE == "cuda":  # time the steps after the first (state made)
                sync()
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                spans.append((start, start))
                timed.copies.clear()
            for model, o in ((plain_model, plain), (swap_model, opt)):
                o.zero_grad()
                loss_of(model, x).backward()
                o.step()
        opt.synchronize()
        sync()
        ok = same(plain_model.parameters(), swap_model.parameters())
        ok = ok and same_state(plain.state_dict(), opt.state_dict())
        placed = set(opt.placement.values())
        on_device = sum(1 for tier in opt.placement.values() if tier == "device")
        through = len(opt.slices) - on_device  # copied in and out each step
        figures: dict[str, object] = {"slices": len(opt.slices), "through_device": through,
                                      "resident": sorted(placed)}  # fmt: skip
        if DEVICE == "cuda":
            figures.update(_copy_step_figures(spans[0][0], timed.copies, spans[1:]))
            ok = ok and figures["copies"] > 0 and figures["overlap_s"] > 0
        record("copy/step overlap, slices through the device bitwise", ok and through > 0,
               **figures)  # fmt: skip


def _module_spans(model: torch.nn.Module, spans: list) -> list:
    """Hook each module that owns parameters so that an event pair on the compute stream
    brackets its forward; called after the optimizer hooked the modules, so that the stream's
    hooks run first (the parameters' copies are issued, and waited for by the compute stream,
    before the first event: the span is the module's kernels alone). Returns the handles."""
    handles = []
    for module in model.modules():
        if DEVICE != "cuda" or not list(module.parameters(recurse=False)):
            continue

        def begin(*_: object) -> None:
            spans.append([torch.cuda.current_stream().record_event(
                torch.cuda.Event(enable_timing=True))])  # fmt: skip

        def end(*_: object) -> None:
            spans[-1].append(torch.cuda.current_stream().record_event(
                torch.cuda.Event(enable_timing=True)))  # fmt: skip

        handles += [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]
    return handles


def check_parameter_copy_overlap(folder: Path, steps: int) -> None:
    """Parameter streaming: each module's parameters are copied in on the upload stream while
    the module before it still computes (its kernels queued ahead of the host), bitwise equal
    to the same optimizer that does not stream; the copies and each module's forward are
    timed with CUDA events on one timeline (the last step's: the order of uses is known)."""
    plain_model = make_model(width=2048, depth=6)
    swap_model = copy.deepcopy(plain_model)
    data = [x.repeat(64, 1) for x in batches(steps, width=2048)]  # 4096 rows: ms-long layers
    timed = _TimedTransfers(torch.device("cuda")) if DEVICE == "cuda" else None
    original = stream_swap.transfers_for
    if timed is not None:
        stream_swap.transfers_for = lambda device: timed if device.type == "cuda" else original(
            device)  # fmt: skip
    spans: list = []
    handles: list = []
    opts: list = []
    try:
        for model, streamed in ((plain_model, False), (swap_model, True)):
            opts.append(ts.SwapOptimizer(
                model if streamed else model.parameters(), torch.optim.AdamW, lr=1e-3,
                swap_dir=folder / f"param-copies-{streamed}", host_budget="256MiB",
                durable=False, offload_parameters=streamed,
            ))  # fmt: skip
        handles = _module_spans(swap_model, spans)  # after the stream's hooks: compute only
        start = None
        for index, x in enumerate(data):
            if index == steps - 1 and timed is not None:
                sync()
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                spans.clear()
                timed.copies.clear()
            for model, opt in zip((plain_model, swap_model), opts, strict=True):
                loss_of(model, x).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        sync()
        ahead = opts[1].tier_stats()["parameters"]["uploaded_ahead_bytes"]
    finally:
        stream_swap.transfers_for = original
        for handle in handles:
            handle.remove()
        for opt in opts:
            opt.close()
    ok = same(plain_model.parameters(), swap_model.parameters()) and (ahead > 0 or DEVICE == "cpu")
    figures: dict[str, object] = {"steps": steps, "uploaded_ahead_bytes": ahead}
    if timed is not None and start is not None:
        forwards = [tuple(pair) for pair in spans if len(pair) == 2]
        found = _copy_step_figures(start, timed.copies, forwards)
        figures.update(copies=found["copies"], forwards=found["steps"], copy_s=found["copy_s"],
                       forward_s=found["step_s"], overlap_s=found["overlap_s"],
                       copies_during_a_forward=found["copies_during_a_step"])  # fmt: skip
        ok = ok and found["copies"] > 0 and found["copies_during_a_step"] > 0
    record("parameter streaming: copies on the upload stream overlap the module before",
           ok, **figures)  # fmt: skip


def check_cache_on_device(folder: Path) -> None:
    """TierCache over a store with its device tier on the GPU: items cycle through every tier
    and come back bitwise; in-place edits on the device reach the store."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    values = {f"w{i}": torch.randn(256, 256, device=DEVICE, generator=gen) for i in range(6)}
    values["bf16"] = torch.randn(128, 512, device=DEVICE, generator=gen).bfloat16()
    param = torch.nn.Parameter(torch.randn(256, 256, device=DEVICE, generator=gen))
    with torch.no_grad():
        view = param.view(-1)[: 256 * 128]
        param.mul_(0.5)  # a step: the view's base changed in place
    values["param_view"] = view
    expected = {key: value.detach().clone() for key, value in values.items()}
    with ts.SwapStore(folder / "cache") as store:
        with ts.TierCache(store, device_budget="640KiB", host_budget="1MiB", device=DEVICE,
                          policy="lru") as cache:  # fmt: skip
            for key, value in values.items():  # grad mode on, as in a training loop
                cache.put(key, value)
            ok = True
            for _ in range(2):
                for key in values:
                    ok = ok and torch.equal(cache.get(key, tier="device"), expected[key])
            with cache.pinned("w0", tier="device", dirty=True) as tensor:
                tensor.add_(1)
            expected["w0"] += 1
            for key in values:  # w0 leaves the device: its edit is written down
                cache.get(key, tier="host")
            cache.flush()
            stats = cache.stats().as_dict()
        store.commit()
        stored = {key: store.get(key) for key in values}
    ok = ok and all(torch.equal(stored[k], expected[k].cpu()) for k in values)
    device = stats["device"]
    ok = ok and 0 < device["peak"] <= device["budget"] and stats["nvme"]["bytes_read"] > 0
    record("TierCache with its device tier on the device: bitwise through every tier", ok,
           device_peak=device["peak"], device_budget=device["budget"],
           nvme_read=stats["nvme"]["bytes_read"], nvme_written=stats["nvme"]["bytes_written"],
           device_hits=device["hits"], device_misses=device["misses"])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="folder on the NVMe to swap to")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--device cpu dry-runs the script)")
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="tierswap-gpu-", dir=args.dir))
    started = time.perf_counter()
    checks = [
        lambda: check_bitwise_device(folder, args.steps, fused=False),
        lambda: check_bitwise_device(folder, args.steps, fused=True),
        lambda: check_device_resident(folder, args.steps),
        lambda: check_bitwise_host_step(folder, args.steps),
        lambda: check_mixed_precision(folder, args.steps),
        lambda: check_overlap(folder, args.steps),
        lambda: check_speculation(folder, args.steps),
        lambda: check_copy_overlap(folder, args.steps),
        lambda: check_parameter_streaming(folder, args.steps),
        lambda: check_parameter_copy_overlap(folder, args.steps),
        lambda: check_cache_on_device(folder),
    ]
    if DEVICE == "cuda":
        checks += [lambda: check_pinned(folder), lambda: check_device_memory(folder, args.steps)]
    for index, check in enumerate(checks):
        try:
            check()
        except Exception as exc:  # report and go on: one broken check must not hide the rest
            traceback.print_exc()
            record(f"check {index} raised", False, error=f"{type(exc).__name__}: {exc}")
    print(f"total {time.perf_counter() - started:.1f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2) + "\n")
    return 0 if all(r["ok"] for r in RESULTS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
