"""Where a decoding step's time goes: wall time per phase of the step, and the time spent inside the model forwards.

A `StepTimer` given to the `StepEngine` is told the phase boundaries of every decode step (`lap`); forward hooks on
the target and drafter modules add up the time inside their forwards. Everything that is neither is host work
(masks, pools, acceptance, the KV commit, stop checks): on a GPU, where a target forward takes 10-25 ms, it decides
whether a tree pays. Used by `castspec bench --overhead`; an engine without a timer pays nothing for it."""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

PHASES = ("plan", "draft", "verify", "accept", "outputs", "policy", "commit")


class StepTimer:
    def __init__(self, device: torch.device, modules: dict[str, list[nn.Module]]) -> None:
        """`modules`: forward kind ("target", "drafter") -> the modules whose forwards count as that kind. A
        module called while another timed one is running (the target's lm_head inside the target) is not
        counted twice."""
        self.device = device
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] | None = None
        self._last = 0.0
        self._running: tuple[nn.Module, float] | None = None  # the outermost timed module now running
        self._handles = []
        self._patched: list[tuple[object, str, object]] = []  # (owner, name, the instance attribute replaced)
        for kind, mods in modules.items():
            for module in mods:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave(kind)))

    def time_calls(self, owner, name: str, key: str, count: str | None = None) -> None:
        """Also count the time inside `owner.name(...)` calls as `key` (device work outside a module, such as a
        drafter's softmax and top-k over the vocabulary; a compiled forward, which module hooks do not see), and
        the calls as `count` when given; undone by `close`."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._current is None or self._running is not None:
                return original(*args, **kwargs)
            self._running = (timed, self._now())
            try:
                return original(*args, **kwargs)
            finally:
                started, self._running = self._running[1], None
                self._current[f"{key}_s"] = self._current.get(f"{key}_s", 0.0) + self._now() - started
                if count is not None:
                    self._current[count] = self._current.get(count, 0) + 1

        # an attribute of the instance itself (a compiled forward) is put back; a method shows its class's again
        own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, timed)
        self._patched.append((owner, name, original if own else None))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _enter(self, module, args) -> None:
        if self._current is not None and self._running is None:
            self._running = (module, self._now())

    def _leave(self, kind: str):
        def hook(module, args, output) -> None:
            if self._running is not None and self._running[0] is module and self._current is not None:
                started = self._running[1]
                self._running = None
                key = f"{kind}_forward_s"
                self._current[key] = self._current.get(key, 0.0) + self._now() - started
                self._current[f"{kind}_forwards"] = self._current.get(f"{kind}_forwards", 0) + 1
        return hook

    def begin(self) -> None:
        self._current = defaultdict(float)
        self._last = self._now()
        self._start = self._last

    def lap(self, phase: str) -> None:
        """The time since the previous boundary belongs to `phase`."""
        now = self._now()
        self._current[phase] += now - self._last
        self._last = now

    def end(self, batch_size: int, tree_nodes: int) -> None:
        step = dict(self._current)
        step["wall_s"] = self._now() - self._start
        step["batch_size"], step["tree_nodes"] = batch_size, tree_nodes
        self.steps.append(step)
        self._current = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        for owner, name, original in self._patched:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._handles, self._patched = [], []
