"""Where CAST's costs come from when an engine starts: a table profiled on this setup and saved under
$CASTSPEC_HOME/costs, what an earlier run learned and saved, or a probe of a few forwards of the target and the
drafter (seconds); the online model then refines whichever it starts from at every step."""

from __future__ import annotations

import sys
import time

from castspec.costs.online import OnlineCostTable, learned_path
from castspec.costs.profile import time_forward, time_head, time_ngram, time_target_forward
from castspec.costs.table import CostTable, setup_key
from castspec.drafters.base import Drafter
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHeadDrafter
from castspec.drafters.suffix import SuffixDrafter
from castspec.drafters.with_ngram import NgramAugmentedDrafter
from castspec.errors import CastspecError
from castspec.models import castspec_home

MODEL_FREE = ("ngram", "suffix")  # drafter identities that are not a model (priced by a lookup timer)


def find_cost_table(expect: dict, drafter: str) -> CostTable | None:
    """A table under $CASTSPEC_HOME/costs measured on exactly this setup and drafter, if there is one; of
    several, the one measured at the most batch sizes (so that batched decoding reads measured costs)."""
    found = []
    for path in sorted((castspec_home() / "costs").glob("*.json")):
        try:
            table = CostTable.load(path, expect=expect)
        except CastspecError:
            continue
        if table.meta.get("online"):  # a learned table is continued by the online model, not read as fixed
            continue
        if table.meta.get("draft", {}).get("model", table.meta.get("draft", {}).get("drafter")) == drafter:
            found.append(table)
    return max(found, key=lambda t: (len(t.target.batch_sizes), max(t.target.batch_sizes)), default=None)


def probe_timers(target_model, drafter: Drafter):
    """One-forward timers of the target and of the drafter as CAST prices it (a merged drafter by its model
    drafter: the n-gram lookups cost microseconds beside a forward)."""
    if isinstance(drafter, NgramAugmentedDrafter):
        drafter = drafter.primary
    lookup = "suffix" if isinstance(drafter, SuffixDrafter) else "ngram"

    def target(b: int, c: int, n: int) -> float:
        return time_target_forward(target_model, b, c, n, repeats=1, warmup=0)

    if isinstance(drafter, EagleHeadDrafter):  # first: a head drafter is a kind of draft-model drafter
        def draft(b: int, c: int, n: int) -> float:
            return time_head(drafter.head, target_model, b, c, n, repeats=1, warmup=0)
    elif isinstance(drafter, DraftModelDrafter):
        def draft(b: int, c: int, n: int) -> float:
            return time_forward(drafter.model, b, c, n, repeats=1, warmup=0)
    else:
        def draft(b: int, c: int, n: int) -> float:
            return time_ngram(n * b, c, repeats=1, drafter=lookup)
    return target, draft


def _progress_line(message: str) -> None:
    print(f"\r{message}", end="", file=sys.stderr, flush=True)


def online_cost_model(target_model, drafter: Drafter, drafter_id: str, seed: CostTable | None = None,
                      fresh: bool = False, log=None, chosen_seed: bool = False,
                      save: bool = True) -> OnlineCostTable:
    """CAST's cost model when it learns: continued from what an earlier run on this setup saved under
    $CASTSPEC_HOME/costs, else started from a profiled table (`seed`), else from a probe of a few forwards
    (seconds). `fresh`: from a probe whatever is saved, as on an empty $CASTSPEC_HOME (what it learns is saved
    as usual, over any earlier learned table of this setup). `chosen_seed`: the caller named `seed` itself, so
    it starts from it even where a learned table is saved; `save=False` keeps what it learns out of
    $CASTSPEC_HOME (a table forced from another setup must not become this setup's)."""
    progress = None if log else _progress_line  # a caller with its own log gets the summary line only
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    key = setup_key(target_model)
    model_free = drafter_id in MODEL_FREE or drafter_id.startswith("eagle-head:")
    meta = {"target": key, "draft": {"drafter": drafter_id, "model": drafter_id} if model_free else
            {"model": drafter_id}, "date": time.strftime("%Y-%m-%d %H:%M")}
    path = learned_path(castspec_home(), key, drafter_id)
    if not fresh and not chosen_seed and path.exists():
        try:
            table = OnlineCostTable.load_learned(path, meta)
            log(f"cost model: online, going on from {table.target_curve.observations} timed forwards saved in "
                f"{path}")
            return table
        except CastspecError as e:
            log(f"cost model: {e}; starting anew")
    table = OnlineCostTable(meta, path=path if save else None)
    if seed is not None and seed.draft is not None and not fresh:
        table.target_curve.seed_from(seed.target)
        table.draft_curve.seed_from(seed.draft)
        log("cost model: online, starting from the " + ("given table" if chosen_seed else
                                                        "profiled table for this setup")
            + ("" if save else " (what it learns is not saved)"))
        return table
    start = time.perf_counter()
    target_timer, draft_timer = probe_timers(target_model, drafter)
    report = table.probe(target_timer, draft_timer, progress=progress)
    if progress is not None:
        print(file=sys.stderr)
    ratio, seconds = report.get("draft_to_target"), time.perf_counter() - start
    table.meta["probe"] = {"seconds": round(seconds, 2), "draft_to_target": ratio}  # saved with what it learns
    found = "" if ratio is None else f", a draft step costs {ratio:.3g} target forwards"
    log(f"cost model: online, probed in {seconds:.1f} s{found} (no table for this setup yet); every step "
        "refines it")
    return table
