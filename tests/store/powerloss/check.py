"""Record a scenario under strace, then check every crash state the model builds from it.

A state passes when the folder, opened as a writer would open it after the power came back,

- holds exactly one committed generation, bit for bit, at least the last commit that had
  returned before the crash (a durable commit is never lost) and at most the last one begun;
- is intact for ``tierswap verify`` (every chunk checksum and the metadata);
- goes on: the next commit (or training step) lands and reads back exactly as in the run;
- keeps a snapshot that had been taken whole, and shows none half-made.

:func:`check_recoveries` adds a second power cut: during the recovery (the reopen that rolls a
journal forward) of states caught after a commit point.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.optim.models import batch_for_step, make_models, train_step
from tests.store.powerloss import model as crash_model
from tests.store.powerloss.child import CHUNK, OPTIM_KWARGS, edit, store_args, store_digest
from tests.store.powerloss.trace import Event, read_trace, run_traced
from tierswap.cli.verify import check as verify
from tierswap.optim import SwapOptimizer
from tierswap.store import SwapStore

ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass
class Recording:
    scenario: str
    base: Path
    trace: crash_model.Trace
    expected: dict[int, dict[str, str]]

    @property
    def commits(self) -> int:
        """How many commits the recorded run finished."""
        return _gens(tuple(text for text, _ in self.trace.markers), "commit-done")


@dataclasses.dataclass
class Report:
    states: int = 0
    crash_points: int = 0
    journal_states: int = 0  # states caught after a commit point, before its roll-forward ended
    failures: list[str] = dataclasses.field(default_factory=list)
    generations: set[int] = dataclasses.field(default_factory=set)

    def summary(self, name: str) -> str:
        return (
            f"{name}: {self.states} crash states at {self.crash_points} crash points "
            f"({self.journal_states} with a journal), {len(self.failures)} not recovered; "
            "generations recovered "
            f"{sorted(self.generations)}"
        )


def record(scenario: str, work: Path, *, commits: int, planted: bool = False) -> Recording:
    """Run ``scenario`` under strace in ``work`` (its folders go to ``work/base``)."""
    base = (work / "base").resolve()
    base.mkdir(parents=True)
    options = ["--commits", str(commits)] + (["--planted"] if planted else [])
    raw, events = _traced_child(scenario, base, options)
    trace = crash_model.build(events, base)
    expected = {int(g): d for g, d in raw["generations"].items()}
    return Recording(scenario, base, trace, expected)


def _traced_child(
    scenario: str, base: Path, options: list[str]
) -> tuple[dict[str, Any], list[Event]]:
    """Run the child on ``base`` under strace: (what it wrote to its output, its events)."""
    out, trace_file = base.parent / "out.json", base.parent / "trace.txt"
    cmd = [sys.executable, "-m", "tests.store.powerloss.child", scenario, str(base), str(out)]
    run_traced([*cmd, *options], trace_file, cwd=ROOT, capture_output=True, text=True)
    events = read_trace(trace_file, [base])
    trace_file.unlink()
    return json.loads(out.read_text()), events


def _gens(markers: tuple[str, ...], kind: str) -> int:
    return max((int(m.split("/")[1]) for m in markers if m.startswith(kind + "/")), default=0)


def check_all(rec: Recording, *, model: str = "ext4", randoms: int = 8, every: int = 1) -> Report:
    """Write each crash state over ``rec.base`` and check it (every ``every``-th distinct
    state: a quicker sample); failures are collected, not raised."""
    report, points = Report(), set()
    check = _check_optimizer(rec) if rec.scenario == "optimizer" else _check_store(rec)
    home = (
        rec.base / "run" if rec.scenario == "optimizer" else store_args(rec.scenario, rec.base)[1]
    )
    for i, state in enumerate(crash_model.states(rec.trace, model=model, randoms=randoms)):
        if i % every:
            continue
        _write(state.fs, rec.base)
        report.states += 1
        report.journal_states += (home / ".tierswap" / "journal.json").exists()
        points.add(state.point.position)
        try:
            report.generations.add(check(state.point.markers))
        except Exception as exc:  # one failed state does not hide the others
            report.failures.append(
                f"at {state.point}, {state.lost} lost: {type(exc).__name__}: {exc}"
            )
    report.crash_points = len(points)
    return report


def check_recoveries(
    rec: Recording, *, model: str = "ext4", journals: int = 4, randoms: int = 8
) -> Report:
    """A power cut during recovery: from ``journals`` crash states of ``rec`` caught after a
    commit point (spread over the run), trace the reopen that rolls the journal forward, and
    check every crash state of that trace as :func:`check_all` does, except that the
    generation must be the very one the uninterrupted recovery found. ``report.journal_states``
    counts the recoveries traced."""
    _paths, home, _io = store_args(rec.scenario, rec.base)
    journal = str((home / ".tierswap" / "journal.json").relative_to(rec.base))
    caught = [
        state.fs
        for state in crash_model.states(rec.trace, model=model, randoms=randoms)
        if any(path == journal for path, _ in state.fs.walk())
    ]
    picked = caught[:: max(1, len(caught) // journals)][:journals]
    report, check = Report(), _check_store(rec)
    for n, fs in enumerate(picked):
        _write(fs, rec.base)
        initial = crash_model.folder_events(rec.base)
        raw, events = _traced_child(rec.scenario, rec.base, ["--reopen"])
        gen, report.journal_states = raw["generation"], report.journal_states + 1
        trace = crash_model.build(events, rec.base, initial=initial)
        for state in crash_model.states(trace, model=model, randoms=randoms):
            _write(state.fs, rec.base)
            report.states += 1
            try:
                got = check((f"commit-done/{gen}", f"commit-start/{gen}"))
                report.generations.add(got)
            except Exception as exc:
                report.failures.append(
                    f"recovery {n} (to generation {gen}) at {state.point}, {state.lost} lost: "
                    f"{type(exc).__name__}: {exc}"
                )
        report.crash_points += len(crash_model.crash_points(trace))
    return report


def _write(fs: crash_model.CrashFs, base: Path) -> None:
    shutil.rmtree(base)
    base.mkdir()
    fs.write_to(base)


def _bounds(markers: tuple[str, ...]) -> tuple[int, int]:
    """(the last generation whose commit returned, the last one begun)."""
    return _gens(markers, "commit-done"), _gens(markers, "commit-start")


def _check_store(rec: Recording) -> Callable[[tuple[str, ...]], int]:
    paths, home, io = store_args(rec.scenario, rec.base)

    def check(markers: tuple[str, ...]) -> int:
        low, high = _bounds(markers)
        if (home / "zarr.json").exists():
            problems, _ = verify(home)
            assert not problems, f"verify before recovery: {problems}"
        with SwapStore(paths, chunk_bytes=CHUNK, io=io) as store:
            gen = store.generation
            assert low <= gen <= high, f"generation {gen}, expected {low}..{high}"
            assert store_digest(store) == rec.expected.get(gen, {}), (
                f"generation {gen}: values differ"
            )
            if gen + 1 in rec.expected:  # the run goes on from here exactly
                edit(store, gen + 1)
                store.commit({"gen": gen + 1})
        with SwapStore(home, mode="r") as store:
            assert store_digest(store) == rec.expected.get(gen + 1, rec.expected.get(gen, {}))
        _check_snapshot(rec, markers)
        return gen

    return check


def _check_snapshot(rec: Recording, markers: tuple[str, ...]) -> None:
    snap = rec.base / "snap3"
    if "snapshot-done/snap3/3" in markers:
        assert snap.is_dir(), "a snapshot that was taken is gone"
    if snap.exists():
        assert not verify(snap)[0], "snapshot damaged"
        with SwapStore(snap, mode="r") as store:
            digest = store_digest(store) if rec.scenario != "optimizer" else None
        if digest is not None:
            assert digest == rec.expected[3], "snapshot differs from generation 3"


def _check_optimizer(rec: Recording) -> Callable[[tuple[str, ...]], int]:
    steps = rec.commits
    ref_model, _ = make_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=OPTIM_KWARGS["lr"])
    history = [_copy(ref_model, ref)]
    for step in range(steps):
        train_step(ref_model, ref, batch_for_step(step))
        history.append(_copy(ref_model, ref))

    def check(markers: tuple[str, ...]) -> int:
        low, high = _bounds(markers)
        problems, _ = (
            verify(rec.base / "run") if (rec.base / "run" / "zarr.json").exists() else ([], 0)
        )
        assert not problems, f"verify before recovery: {problems}"
        _, model = make_models(seed=11)  # the resume overwrites these weights
        with SwapOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            swap_dir=rec.base / "run",
            resume=True,
            **OPTIM_KWARGS,
        ) as opt:
            done = opt.steps
            assert low <= done <= high, f"resumed at step {done}, expected {low}..{high}"
            if done == 0:  # nothing committed: the run starts again from the caller's weights
                assert not opt.state_dict()["state"], "state resumed from no commit"
                model.load_state_dict(make_models()[0].state_dict())
            _same(history[done], model, opt)
            if done + 1 < len(history):
                train_step(model, opt, batch_for_step(done))
                _same(history[done + 1], model, opt)
        _check_snapshot(rec, markers)
        return done

    return check


def _copy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    state = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in opt.state_dict()["state"].items()
    }
    return [p.detach().clone() for p in model.parameters()], state


def _same(
    expected: tuple[list[torch.Tensor], dict], model: torch.nn.Module, opt: torch.optim.Optimizer
) -> None:
    params, state = expected
    for i, (a, b) in enumerate(zip(params, model.parameters(), strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs"
    got = opt.state_dict()["state"]
    assert got.keys() == state.keys(), "optimizer state keys differ"
    for i, s in state.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(got[i][k])), (
                f"state {i}.{k} differs"
            )
