"""Where ``tierstore bench train`` runs its strategies: a fresh process each, or this one.

CPU runs each strategy in a child interpreter of its own, one at a time,
then the live-memory pass in one more; CUDA (and ``--in-process``) runs
them all in this process (NOTE [ What bench train measures ] in
``tierstore/bench/train.py``). A child reports one JSON line per step and
its results on stdout, and saves its gradients where the parent compares
them with ``none``'s.

Example:
    >>> from tierstore.bench.train_runs import _read_events
    >>> class Count:
    ...     steps = 0
    ...     def advance(self, units): Count.steps += units
    >>> lines = ['{"event": "step", "name": "none"}', "noise",
    ...          '{"event": "result", "result": {"name": "none"}}']
    >>> _read_events(lines, Count()), Count.steps
    ({'name': 'none'}, 1)
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tierstore.bench.memory_limit import MemoryCgroup
from tierstore.bench.report import Progress
from tierstore.bench.train_measure import (
    StrategyResult,
    _Bench,
    _compare_grads,
    _grads_in_place,
    _named_grads,
    _Reporter,
)
from tierstore.bench.train_settings import TrainSettings, make_optimizer
from tierstore.bench.train_strategies import (
    _CheckpointTierstore,
    _make_strategy,
    _Strategy,
    _Tierstore,
)
from tierstore.errors import TierstoreError
from tierstore.models import GPT, build_model

__all__: list[str] = []


class _Events:
    """A child's progress: one JSON line per step on stdout, read by the parent."""

    def __init__(self, name: str) -> None:
        self._name = name

    def phase(self, description: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def advance(self, units: float) -> None:
        print(json.dumps({"event": "step", "name": self._name}), flush=True)


#: Steps per strategy in the live pass: a warm-up, then the measured one.
_LIVE_STEPS = 2

#: One strategy in a fresh process, on the default allocator.
_STRATEGY_CHILD = """
import sys
from tierstore.bench import train_runs
train_runs._strategy_child(sys.argv[1])
"""

#: Every strategy in one fresh process whose RSS follows live memory.
_LIVE_CHILD = """
import sys
from tierstore.bench import memory, train_runs
# Before the benchmark allocates: NOTE [ What bench train measures ].
live = memory.follow_live_memory()
train_runs._live_child(sys.argv[1], live)
"""

#: Linux prctl option: the signal a process gets when its parent ends.
_PR_SET_PDEATHSIG = 1


def _payload(
    settings: TrainSettings, names: list[str], budget: int, work: Path, **extra: Any
) -> dict[str, Any]:
    """What a child needs: the settings (writing under ``work``), the strategies, the budget."""
    return {
        "settings": asdict(replace(settings, directory=str(work))),
        "names": names,
        "budget": budget,
        "threads": torch.get_num_threads(),
        "parent": os.getpid(),
        **extra,
    }


def _run_child(
    script: str,
    payload: dict[str, Any],
    log: Path,
    progress: _Reporter,
    what: str,
    *,
    cgroup: MemoryCgroup | None = None,
) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter; advance per step event; return its result event.

    Its stderr goes to ``log`` (a file, so that a chatty child cannot block
    on a full pipe while the parent reads stdout). ``cgroup``: the child
    runs in it (NOTE [ Rows under a memory limit ]).

    Raises:
        TierstoreError: the child failed (its exit status and the end of its stderr).
    """
    returncode, result, tail = _spawn(script, payload, log, progress, cgroup)
    if returncode != 0 or result is None:
        raise TierstoreError(
            f"tierstore: bench train: {what} (a child process) failed with exit status "
            f"{returncode}: {tail}"
        )
    return result


def _spawn(
    script: str,
    payload: dict[str, Any],
    log: Path,
    progress: _Reporter,
    cgroup: MemoryCgroup | None,
) -> tuple[int, dict[str, Any] | None, str]:
    """A child's exit status, its result event (``None``: none came) and its stderr's end."""
    cmd = [sys.executable, "-c", script, json.dumps(payload)]
    enter = None if cgroup is None else cgroup.enter
    with log.open("w+", encoding="utf-8") as err:
        with subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            preexec_fn=enter,  # noqa: PLW1509  (joins the cgroup before it runs)
        ) as proc:
            assert proc.stdout is not None
            try:
                result = _read_events(proc.stdout, progress)
            except BaseException:
                proc.kill()  # not left running after the parent gives up on it
                raise
        err.seek(0)
        tail = err.read()[-2000:].strip()
    return proc.returncode, result, tail


def _read_events(lines: Iterator[str], progress: _Reporter) -> dict[str, Any] | None:
    result: dict[str, Any] | None = None
    for line in lines:
        if not line.startswith('{"event"'):
            continue  # anything else a library prints
        event = json.loads(line)
        if event["event"] == "step":
            progress.advance(1)
        elif event["event"] == "result":
            result = event["result"]
    return result


def _child_setup(payload_json: str) -> tuple[dict[str, Any], TrainSettings]:
    """A child's first steps: end with the parent, read the settings, match its threads."""
    payload = json.loads(payload_json)
    # SIGTERM to the parent removes the scratch directory and ends it with
    # os._exit (NOTE [ SIGTERM ] in tierstore/bench/scratch.py): no finally
    # runs there to stop a child, so the kernel does (Linux only).
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != payload["parent"]:
        sys.exit("tierstore: bench train: the parent process ended before this child started")
    fields = payload["settings"]
    fields["strategies"] = tuple(fields["strategies"])
    if fields.get("vary_seq") is not None:
        fields["vary_seq"] = tuple(fields["vary_seq"])
    torch.set_num_threads(payload["threads"])
    return payload, TrainSettings(**fields)


def _strategy_child(payload_json: str) -> None:
    """One strategy's steps in this fresh process; results to stdout, gradients to a file."""
    payload, settings = _child_setup(payload_json)
    (name,) = payload["names"]
    device = torch.device("cpu")
    model = build_model(settings, device)
    root = Path(settings.directory or ".")
    bench = _Bench(settings, model, device, root, payload["budget"], trim=False)
    result = StrategyResult(name)
    try:
        strategy = _make_strategy(
            name, settings=settings, model=model, root=root, budget=bench.budget, device=device
        )
        try:
            if isinstance(strategy, (_Tierstore, _CheckpointTierstore)):
                result.config = strategy.config.model_dump(mode="json")
            bench.timed(strategy, result, _Events(name))
        finally:
            strategy.close()
    finally:
        bench.close()
    save_file({k: v.contiguous() for k, v in _named_grads(model).items()}, payload["grads"])
    print(json.dumps({"event": "result", "result": asdict(result)}), flush=True)


def _live_child(payload_json: str, live: bool) -> None:
    """The live pass: a warm-up and one measured step per strategy, peaks to stdout."""
    payload, settings = _child_setup(payload_json)
    device = torch.device("cpu")
    model = build_model(settings, device)
    initial = copy.deepcopy(model.state_dict())
    bench = _Bench(settings, model, device, Path(settings.directory or "."), payload["budget"])
    out: dict[str, Any] = {
        "allocator": (
            "live memory (M_MMAP_THRESHOLD=1MiB, a fresh process)"
            if live
            else "live memory? (a fresh process, not glibc: RSS may keep freed memory)"
        )
    }
    try:
        for name in payload["names"]:
            model.load_state_dict(initial)
            _grads_in_place(model)
            opt = make_optimizer(settings, model.parameters())
            strategy = _make_strategy(
                name,
                settings=settings,
                model=model,
                root=bench.root,
                budget=bench.budget,
                device=device,
            )
            try:
                for step in range(_LIVE_STEPS):
                    took, peaks, _ = bench._step(strategy, opt, step, full_gc=True)
                    print(json.dumps({"event": "step", "name": name}), flush=True)
            finally:
                strategy.close()
            out[name] = {"step_s": took, "peak_bytes": peaks.above}
    finally:
        bench.close()
    print(json.dumps({"event": "result", "result": out}), flush=True)


def _new_result(strategy: _Strategy) -> StrategyResult:
    result = StrategyResult(strategy.name)
    if isinstance(strategy, (_Tierstore, _CheckpointTierstore)):
        result.config = strategy.config.model_dump(mode="json")
    return result


def _run_in_process(
    settings: TrainSettings,
    names: list[str],
    *,
    model: GPT,
    budget: int,
    work: Path,
    progress: Progress,
) -> list[StrategyResult]:
    """Every strategy in this process, one after another (CUDA; ``--in-process`` on CPU)."""
    device = next(model.parameters()).device
    initial = copy.deepcopy(model.state_dict())
    bench = _Bench(settings, model, device, work, budget)
    rows: list[StrategyResult] = []
    reference: dict[str, torch.Tensor] | None = None
    strategies: dict[str, _Strategy] = {}
    try:
        for name in names:
            strategies[name] = _make_strategy(
                name, settings=settings, model=model, root=work, budget=budget, device=device
            )
        for name, strategy in strategies.items():
            model.load_state_dict(initial)
            result = _new_result(strategy)
            bench.timed(strategy, result, progress)
            grads = _named_grads(model)
            if name == "none":
                reference = grads
            if reference is not None:
                _compare_grads(result, reference, grads)
            rows.append(result)
    finally:
        for strategy in strategies.values():
            strategy.close()
        bench.close()
    return rows


# NOTE [ Rows under a memory limit ]
# --memory-limit SIZE runs each row's fresh process in a memory cgroup of
# SIZE of its own (NOTE [ A cgroup per limited run ] in
# tierstore/bench/memory_limit.py), as a container's limit is: the whole
# process counts (interpreter, torch, model, optimizer state, page cache),
# and the kernel kills it when the step does not fit. A killed row stays in
# the report, marked killed, with its step time and peak RSS blank and the
# cgroup's peak (the limit) beside it: what a user learns is which ways of
# training fit, so a row that does not is a result. Where no cgroup can be
# made (not root, no writable memory controller) the command says why and
# runs nothing: figures without the limit would not answer the question.
# The gradient check needs a reference: none's gradients where none
# completes, else none run once more with no limit, for its gradients only
# (settings.grad_reference says which). The live pass runs every row in one
# process and is skipped under a limit.


def _run_isolated(
    settings: TrainSettings, names: list[str], *, budget: int, work: Path, progress: _Reporter
) -> list[StrategyResult]:
    """Each strategy in a fresh process of its own, one at a time (CPU).

    Under ``settings.memory_limit_bytes``, each in a memory cgroup of that
    size (NOTE [ Rows under a memory limit ]).
    """
    rows: list[StrategyResult] = []
    grads: dict[str, Path] = {}
    n = settings.warmup + settings.steps
    for name in names:
        grads[name] = work / f"grads-{name}.safetensors"
        payload = _payload(settings, [name], budget, work, grads=str(grads[name]))
        with progress.phase(f"{name}: {n} steps in a fresh process"):
            rows.append(_isolated_row(settings, name, payload, work, progress))
    if "none" in grads and not grads["none"].exists():  # killed: a reference with no limit
        payload = _payload(replace(settings, memory_limit_bytes=None), ["none"], budget, work)
        payload["grads"] = str(grads["none"])
        with progress.phase(f"none again with no memory limit, for its gradients: {n} steps"):
            _run_child(_STRATEGY_CHILD, payload, work / "reference.stderr", _Quiet(), "none")
    reference = load_file(grads["none"]) if "none" in grads else None
    for row in rows:
        path = grads[row.name]
        if reference is not None and not row.killed:
            _compare_grads(row, reference, load_file(path))
        path.unlink(missing_ok=True)
    for path in grads.values():  # none's, where it ran again with no limit
        path.unlink(missing_ok=True)
    return rows


class _Quiet:
    """A reporter that shows nothing (a run that is no row)."""

    def phase(self, description: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def advance(self, units: float) -> None:
        pass


def _isolated_row(
    settings: TrainSettings, name: str, payload: dict[str, Any], work: Path, progress: _Reporter
) -> StrategyResult:
    """One row's fresh process, in a memory cgroup under ``--memory-limit``: its result."""
    log, what = work / f"{name}.stderr", f"strategy {name}"
    if settings.memory_limit_bytes is None:
        return StrategyResult(**_run_child(_STRATEGY_CHILD, payload, log, progress, what))
    with MemoryCgroup(settings.memory_limit_bytes) as cgroup:
        returncode, doc, tail = _spawn(_STRATEGY_CHILD, payload, log, progress, cgroup)
        killed = cgroup.oom_killed(returncode)
        peak = cgroup.peak_bytes()
    if killed:
        return StrategyResult(name, killed=True, cgroup_peak_bytes=peak)
    if returncode != 0 or doc is None:
        raise TierstoreError(
            f"tierstore: bench train: {what} (a child process) failed with exit status "
            f"{returncode}: {tail}"
        )
    return StrategyResult(**{**doc, "cgroup_peak_bytes": peak})


def _live_pass(
    settings: TrainSettings,
    names: list[str],
    *,
    budget: int,
    work: Path,
    progress: _Reporter,
) -> dict[str, Any]:
    """The live pass (:func:`_live_child`): per strategy its peak and step time, and a label."""
    payload = _payload(settings, names, budget, work)
    with progress.phase(f"live memory pass: {_LIVE_STEPS} steps per strategy"):
        return _run_child(_LIVE_CHILD, payload, work / "live.stderr", progress, "the live pass")
