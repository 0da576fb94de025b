"""castspec: cost-aware speculative tree decoding for Hugging Face causal LMs.

The package's folders are its layers, lowest first:
    decode/    the draft tree as data, the target and its KV cache, verification, the stepping engine
    policies/  chain, EAGLE-2 and CAST: pure functions from drafter scores (and costs) to trees
    drafters/  draft model, EAGLE heads, n-gram and suffix-tree lookups, behind one interface
    costs/     the cost table, its measurement, the online model and its start-up probe
    api.py     Engine: load a target and a drafter, choose the method, generate
    heads/     training EAGLE heads and their data
    bench/, serve/, cli/   the shells: benchmarks, the OpenAI-compatible server, the command line
Names below are imported on first use, so that importing a lower layer does not load the shells.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Engine": "castspec.api",
    "Generation": "castspec.api",
    "CastspecError": "castspec.errors",
    "DraftTree": "castspec.decode.tree",
    "SamplingParams": "castspec.decode.sampling",
    "StepEngine": "castspec.decode.engine",
    "RequestParams": "castspec.decode.engine",
    "CostTable": "castspec.costs.table",
    "CastPolicy": "castspec.policies.cast",
    "ChainPolicy": "castspec.policies.base",
    "Eagle2Policy": "castspec.policies.base",
    "Drafter": "castspec.drafters.base",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'castspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
