"""The target's decode forward under `torch.compile`, still the stock `transformers` model (no model code copied).

A decode step's forward is ~200 small ops around the matrix multiplies (norms, rotary embeddings, residual adds,
the KV writes) issued one by one from Python; compiled, they are fused into a few kernels and the step's Python
runs once at trace time. Shapes are dynamic, not bucketed: the packed tokens, the trees' width, the slots and the
cache's columns change every step, and on a CPU (no CUDA graphs to capture) one graph with symbolic sizes serves
them all without padding; a size of one is still traced apart, so two graphs are compiled (one token in all, an
AR step of one row; and the rest). What Inductor cannot see into stays one opaque op each: the batched tree
attention (`castspec::attend`: the trees batched, prompt chunks each on its own) and oneDNN's linear over pre-packed
weights (`castspec::packed_linear`). Prompt chunks carried by a decode step run in the same graph: a prompt joining
a running batch would otherwise make every step it rides eager (5-14 ms slower a step on the 1.5B target,
bench/conversations/README.md). Forwards of prompt chunks alone (a first prompt, a batch starting) run eagerly
(`ragged.forward`)."""

from __future__ import annotations

import contextlib
import random
import time

import torch
from torch.fx.experimental import _config as fx_config

from castspec.decode.tree import DraftTree

_WARM_CONTEXT = 8  # entries each warm-up row holds before its tree


class _CompiledForward:
    """The model's forward compiled. Sizes that happen to be 0 or 1 when traced are not specialised on (a batch of
    one row would otherwise get a graph of its own), nor are sizes that happen to be equal given one symbol (a
    first version traced again when a 4-long tensor of the attention's bounds met a cache of 4 slots)."""

    def __init__(self, model) -> None:
        self._forward = torch.compile(model.forward, dynamic=True)

    def __call__(self, **kwargs):
        with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
            return self._forward(**kwargs)


def compile_target(model, log=None) -> float | None:
    """Compile the model's decode forward and trace both of its graphs now (the first request should not wait for
    them); returns the seconds it took, or None when this machine cannot compile (no C++ compiler for Inductor,
    say), after which the model stays eager and `log` says why in one line."""
    if is_compiled(model):
        return 0.0
    from castspec.decode.target import Target  # the target path itself does the warm-up forwards

    name = getattr(model.config, "_name_or_path", "model").rstrip("/").split("/")[-1]
    start = time.perf_counter()
    model.castspec_compiled = _CompiledForward(model)
    try:
        target = Target(model)
        rng = random.Random(0)
        vocab = min(model.config.vocab_size, 1000)
        for rows, nodes in ((2, 2), (1, 1)):  # the general graph, then the one-token one
            target.prefill([[rng.randrange(vocab) for _ in range(_WARM_CONTEXT)] for _ in range(rows)])
            target.verify([DraftTree.chain([rng.randrange(vocab) for _ in range(nodes)])] * rows)
        # a prompt carried by a decode step, in two chunks (the general graph again, reading chunks as data)
        joining = target.start_rows([[rng.randrange(vocab) for _ in range(2 * _WARM_CONTEXT)]])
        for _ in range(2):
            target.forward([DraftTree.chain([rng.randrange(vocab)])], joining, _WARM_CONTEXT)
        target.keep_rows([])
        target.drop_prefills(joining)
    except Exception as e:  # noqa: BLE001 - any failure of the compiler leaves the eager forward, said once
        del model.castspec_compiled
        if log is not None:
            log(f"{name}: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                "decoding with the eager forward")
        return None
    seconds = time.perf_counter() - start
    if log is not None:
        log(f"{name}: decode forward compiled in {seconds:.0f} s (once per process; --no-compile: eager)")
    return seconds


def is_compiled(model) -> bool:
    return getattr(model, "castspec_compiled", None) is not None


@contextlib.contextmanager
def eager(model):
    """The model's eager forward for the length of the block (an A/B of the two paths in one process)."""
    compiled = getattr(model, "castspec_compiled", None)
    model.castspec_compiled = None
    try:
        yield
    finally:
        model.castspec_compiled = compiled
