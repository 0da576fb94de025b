"""Benchmark harness (Spec-Bench protocol): every method on the same prompts, same target, one run.

Per prompt: warm-up excluded, wall time of the whole generation; tokens/s = new tokens / wall time;
speed-up = mean tokens/s of a method / mean tokens/s of AR; tau = new tokens / target forwards."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from castspec.api import MODEL_FREE_MAX_DEPTH, Engine, calibrated_by_default, drafter_identity, make_policy
from castspec.costs.probe import MODEL_FREE, find_cost_table, online_cost_model
from castspec.costs.table import device_name, setup_key
from castspec.decode.sampling import SamplingParams
from castspec.drafters.base import Drafter
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHeadDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.drafters.suffix import SharedSuffixTrie, SuffixDrafter
from castspec.drafters.with_ngram import NgramAugmentedDrafter
from castspec.errors import CastspecError
from castspec.policies.base import Policy


@dataclass
class MethodSpec:
    label: str
    method: str  # ar | chain | eagle2 | hf-assisted | hf-prompt-lookup
    drafter: str | None = None  # one of ITEM_DRAFTERS
    options: dict = field(default_factory=dict)


HF_METHODS = ("hf-assisted", "hf-prompt-lookup")
METHOD_OPTIONS = {"ar": (), "chain": ("chain_length",), "eagle2": ("top_k", "depth", "total_tokens"),
                  "cast": ("auto", "calibrate", "payoff", "online", "cast_c1", "cast_c2", "cast_c3", "cast_r",
                           "cast_max_depth", "cast_top_k")}
ITEM_DRAFTERS = ("draft", "ngram", "suffix", "head", "draft+ngram", "head+ngram", "draft+suffix", "head+suffix")
# method-item options that configure the drafter, not the policy: the n-gram sizes wherever an n-gram index
# drafts; the suffix tree's depth and its shared tree's token budget (shared=N: every prompt reads and adds to
# one tree over the earlier prompts' outputs) wherever a suffix tree does
DRAFTER_OPTIONS = {d: ("max_n", "min_n") if d.endswith("ngram") else ("depth", "shared")
                   for d in ITEM_DRAFTERS if d.endswith(("ngram", "suffix"))}
# what a server runs besides its method (castspec serve's --prefix-cache-gb, --prefill-chunk, --prefill-slack):
# bench-serve only
SERVER_OPTIONS = ("prefix_cache_gb", "prefill_chunk", "prefill_slack", "prefill_at_once")


def _parse_item(item: str) -> MethodSpec:
    fields = item.split(":")
    method, drafter, options = fields[0], None, {}
    if method not in METHOD_OPTIONS and method not in HF_METHODS:
        raise CastspecError(f"method item {item!r}: unknown method {method!r}; choose from "
                            f"{', '.join([*METHOD_OPTIONS, *HF_METHODS])}")
    for extra in fields[1:]:
        if "=" not in extra:
            if extra not in ITEM_DRAFTERS or drafter is not None:
                raise CastspecError(f"method item {item!r}: {extra!r} is not a drafter "
                                    f"({', '.join(ITEM_DRAFTERS)}), or a second one")
            drafter = extra
            continue
        for pair in extra.split(","):
            key, _, value = pair.partition("=")
            allowed = METHOD_OPTIONS.get(method, ()) + DRAFTER_OPTIONS.get(drafter or "", ())
            if key not in allowed + SERVER_OPTIONS:
                raise CastspecError(f"method item {item!r}: {key!r} is not an option of {method}"
                                    f"{' with the ' + drafter + ' drafter' if drafter else ''} "
                                    f"(it has: {', '.join(allowed) or 'none'}); a served item also takes "
                                    f"{', '.join(SERVER_OPTIONS)}")
            try:
                options[key] = float(value) if "." in value else int(value)
            except ValueError as e:
                raise CastspecError(f"method item {item!r}: {key} needs a number, got {value!r}") from e
    if method in ("chain", "eagle2", "cast") and drafter is None:
        raise CastspecError(f"method item {item!r}: {method} needs a drafter, e.g. {method}:ngram or {method}:draft")
    spec = MethodSpec(item, method, drafter, options)
    if drafter is not None and drafter.endswith(("ngram", "suffix")):
        try:
            model_free_from_spec(spec)
        except CastspecError as e:
            raise CastspecError(f"method item {item!r}: {e}") from e
    return spec


def model_free_from_spec(spec: MethodSpec) -> Drafter:
    """The item's model-free drafter (n-gram or suffix tree) from its options."""
    options = drafter_options(spec)
    if spec.drafter.endswith("ngram"):
        return NgramDrafter(**options)
    shared = int(options.get("shared", 0))
    depth = int(options.get("depth", 16))
    return SuffixDrafter(depth, SharedSuffixTrie(shared, depth) if shared else None, share=bool(shared))


def parse_methods(text: str, server: bool = False) -> list[MethodSpec]:
    """'ar;chain:draft:chain_length=4;eagle2:ngram;hf-assisted' -> specs. Label = the item's text. Unknown
    methods, drafters and options are refused here, before any model loads. `server`: the items configure servers
    (bench-serve), which also take SERVER_OPTIONS ('cast:suffix:prefix_cache_gb=0')."""
    specs = [_parse_item(item) for item in filter(None, (part.strip() for part in text.split(";")))]
    for spec in specs:
        server_only = sorted(set(spec.options) & set(SERVER_OPTIONS))
        if server_only and not server:
            raise CastspecError(f"method item {spec.label!r}: {', '.join(server_only)} configure a server; "
                                "only castspec bench-serve takes them")
    return specs


def method_family(label: str) -> tuple[str, str | None]:
    """(method, drafter) of a method item's label as `parse_methods` reads it: 'chain:draft:chain_length=4' ->
    ('chain', 'draft'); 'ar' -> ('ar', None)."""
    spec = _parse_item(label)
    return spec.method, spec.drafter


def encode_prompts(engine: Engine, prompts: list[dict]) -> list[list[int]]:
    """Token ids of prompt-set rows: chat rows ("messages") through the chat template, plain rows ("prompt") as is."""
    return [engine.encode(messages=p["messages"]) if "messages" in p else engine.encode(prompt=p["prompt"])
            for p in prompts]


def drafter_options(spec: MethodSpec) -> dict:
    """The drafter's keyword arguments among a method item's options ('cast:ngram:min_n=1' -> {'min_n': 1})."""
    return {k: v for k, v in spec.options.items() if k in DRAFTER_OPTIONS.get(spec.drafter or "", ())}


def policy_options(spec: MethodSpec, costs=None) -> dict:
    """make_policy's keyword arguments for a method item: its options (the drafter's left out), CAST's short ones
    spelled out."""
    options = {k: v for k, v in spec.options.items() if k not in drafter_options(spec) and k not in SERVER_OPTIONS}
    if spec.method == "cast":
        options["cost_table"] = costs
        options["cast_auto"] = bool(options.pop("auto", 1))
        options["cast_calibrate"] = bool(options.pop("calibrate", int(calibrated_by_default(spec.drafter))))
        if spec.drafter in MODEL_FREE:
            options.setdefault("cast_max_depth", MODEL_FREE_MAX_DEPTH)
        options.pop("online", None)  # chooses the cost table, which the caller passed in
        if "payoff" in options:
            options["cast_payoff"] = bool(options.pop("payoff"))
    return options


class _HfBaseline:
    def __init__(self, model, tokenizer, method: str, draft_model) -> None:
        self.model, self.tokenizer, self.method, self.draft = model, tokenizer, method, draft_model

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None
                 ) -> tuple[list[int], int | None]:
        ids = torch.tensor([prompt_ids])
        extra = {"assistant_model": self.draft} if self.method == "hf-assisted" else {"prompt_lookup_num_tokens": 10}
        fields = {"do_sample": False}
        if sampling is not None and not sampling.greedy:
            fields = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                      "top_k": sampling.top_k}  # 0 = no cut, as here
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        config = transformers.GenerationConfig(max_new_tokens=max_new_tokens, **fields,
                                               eos_token_id=self.model.generation_config.eos_token_id,
                                               pad_token_id=self.tokenizer.pad_token_id)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
        return out[0, len(prompt_ids):].tolist(), None


def _runners(target_model, tokenizer, draft_model, specs: list[MethodSpec], head=None) -> dict:
    """One runner per method. `head`: (EagleHead, its source) for the methods whose drafter is 'head'."""
    runners = {}
    for spec in specs:
        if spec.method == "hf-assisted" and draft_model is None:
            raise CastspecError("hf-assisted needs a draft model (--draft)")
        if spec.method.startswith("hf-"):
            runners[spec.label] = _HfBaseline(target_model, tokenizer, spec.method, draft_model)
            continue
        runners[spec.label] = Engine(target_model, tokenizer, *method_parts(spec, target_model, draft_model, head))
    return runners


def method_parts(spec: MethodSpec, target_model, draft_model=None, head=None) -> tuple[Drafter | None, Policy | None]:
    """The drafter and policy of one of our method items (None, None for AR)."""
    model = (spec.drafter or "").removesuffix("+ngram").removesuffix("+suffix")  # the model drafter, if any
    given = {"draft": draft_model, "head": head}
    if spec.method != "ar" and model in given and given[model] is None:
        raise CastspecError(f"{spec.label} drafts with a {model}, and none was given (--{model} ...)")
    drafter = None
    if spec.method != "ar":
        if spec.drafter.startswith("head"):
            drafter = EagleHeadDrafter(head[0], target_model)
        elif spec.drafter.startswith("draft"):
            drafter = DraftModelDrafter(draft_model)
        if spec.drafter.endswith(("ngram", "suffix")):
            lookup = model_free_from_spec(spec)
            drafter = lookup if drafter is None else NgramAugmentedDrafter(drafter, lookup)
    costs = None
    if spec.method == "cast":
        # the model-free lookups cost microseconds: a merged drafter is priced by its model drafter's table
        drafter_id = drafter_identity(draft_model if spec.drafter.startswith("draft") else None,
                                      head[1] if spec.drafter.startswith("head") else None,
                                      "suffix" if spec.drafter == "suffix" else "ngram")
        costs = find_cost_table(setup_key(target_model), drafter_id)
        online = spec.options.get("online", 1)
        if online:  # 1: as `castspec generate` does; 2: from a probe, as on an empty $CASTSPEC_HOME
            costs = online_cost_model(target_model, drafter, drafter_id, seed=costs, fresh=online == 2)
    return drafter, make_policy(spec.method, **policy_options(spec, costs))


def run_benchmark(target_model, tokenizer, draft_model, specs: list[MethodSpec], prompts: list[dict],
                  max_new_tokens: int, warmup: int = 1, partial: Path | None = None,
                  sampling: SamplingParams | None = None, draft_sampling: str = "topk", head=None,
                  resume: bool = False, rounds: int = 1) -> dict:
    """Run every method on every prompt, `rounds` times (every other round with the methods in reverse order, so
    that a drift of the machine's speed within a prompt's methods falls on them alike; the summary takes each
    prompt and method's median over the rounds). With `partial`, each finished generation is appended there as a
    JSON line at once, so an interrupted run keeps what it measured; `resume` takes the prompts (of each round)
    that file holds complete (every method) and runs only the rest, so a long benchmark can span several sittings
    and a finished one can grow by prompts or rounds (each prompt's methods still run side by side). With
    `sampling`, every method samples with the same parameters and seed."""
    if rounds < 1:
        raise CastspecError(f"--rounds must be at least 1 (got {rounds})")
    runners = _runners(target_model, tokenizer, draft_model, specs, head)
    encoder = next(r for r in runners.values() if isinstance(r, Engine)) if runners else None
    encoded = encode_prompts(encoder, prompts)
    for runner in runners.values():  # warm-up: kernels, allocator, caches
        for ids in encoded[:warmup]:
            _run(runner, ids, min(16, max_new_tokens), sampling, draft_sampling)
    rows = _finished_prompts(partial, prompts, specs) if resume else []
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("".join(json.dumps(r) + "\n" for r in rows))  # drop any half-measured prompt
    done = {(r.get("round", 0), r["prompt_id"]) for r in rows}
    progress = tqdm(total=rounds * len(prompts) * len(specs), initial=len(rows), desc="benchmark", unit="gen")
    for round_index in range(rounds):
        order = list(runners.items()) if round_index % 2 == 0 else list(runners.items())[::-1]
        for prompt, ids in zip(prompts, encoded, strict=True):
            if (round_index, prompt["id"]) in done:
                continue
            # methods interleaved per prompt so that machine noise hits them alike
            for label, runner in order:
                where = f" round {round_index + 1}" if rounds > 1 else ""
                progress.set_postfix_str(f"{prompt['id']} {label}{where}")
                output, wall, extra = _run(runner, ids, max_new_tokens, sampling, draft_sampling)
                rows.append({"prompt_id": prompt["id"], "task": prompt.get("task", "custom"), "method": label,
                             "round": round_index, "new_tokens": len(output), "wall_s": wall,
                             "tokens_per_s": len(output) / wall, "output_ids": output, **extra})
                if partial is not None:
                    with open(partial, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
                progress.update()
    progress.close()
    meta = _meta(max_new_tokens, len(prompts))
    meta["rounds"] = max(r.get("round", 0) for r in rows) + 1 if rows else rounds
    if sampling is not None and not sampling.greedy:
        meta["sampling"] = {**dataclasses.asdict(sampling), "draft_sampling": draft_sampling}
    return {"meta": meta, "rows": rows, "summary": summarise(rows, compare_outputs="sampling" not in meta)}


class RunFiles:
    """A benchmark run's state on disk: NAME.partial.jsonl (one row per finished generation, written as it
    finishes), NAME.partial.settings.json (what the rows were measured with) and, once done, NAME.json."""

    def __init__(self, out_dir: Path, name: str) -> None:
        self.partial = out_dir / f"{name}.partial.jsonl"
        self.settings = out_dir / f"{name}.partial.settings.json"
        self.finished = out_dir / f"{name}.json"

    def start(self, settings: dict) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.partial.unlink(missing_ok=True)
        self.settings.write_text(json.dumps(settings))

    def resume(self, settings: dict) -> None:
        """Make the partial rows the state to continue from: an interrupted run's as they are, a finished run's
        rows copied back (so it grows). Refuses other settings than the earlier sittings'."""
        rows = None
        if self.settings.is_file():
            before = json.loads(self.settings.read_text())
        elif self.finished.is_file():
            data = json.loads(self.finished.read_text())
            before, rows = data.get("meta", {}).get("settings"), data["rows"]
            if before is None:
                raise CastspecError(f"{self.finished} predates --resume (it records no settings): run it afresh")
        else:
            raise CastspecError(f"nothing to resume under this --name: neither {self.settings} nor "
                                f"{self.finished} exists")
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            raise CastspecError("--resume with other settings than the interrupted run: " +
                                "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in changed.items()))
        if rows is not None:
            self.partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
            self.settings.write_text(json.dumps(before))

    def clear(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.settings.unlink(missing_ok=True)


def _finished_prompts(partial: Path | None, prompts: list[dict], specs: list[MethodSpec]) -> list[dict]:
    """Rows of a previous sitting for the prompts (of each round) it finished with every method, round by round."""
    if partial is None or not partial.is_file():
        raise CastspecError(f"nothing to resume: {partial} does not exist (run without --resume first)")
    rows, lines = [], partial.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise CastspecError(f"{partial} line {number} is corrupt") from None
            # the last line may have been cut by the interruption: that prompt is measured again
    wanted = {p["id"] for p in prompts}
    labels = [s.label for s in specs]
    by_group: dict[tuple[int, str], dict[str, dict]] = {}  # (round, prompt) -> method -> row
    for row in rows:
        if row.get("prompt_id") in wanted and row.get("method") in labels:
            by_group.setdefault((row.get("round", 0), row["prompt_id"]), {})[row["method"]] = row
    rounds = sorted({round_index for round_index, _ in by_group})
    return [row for k in rounds for p in prompts if len(by_group.get((k, p["id"]), {})) == len(labels)
            for row in by_group[k, p["id"]].values()]  # in the order they ran (odd rounds: reversed)


def _run(runner, ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
         draft_sampling: str = "topk") -> tuple[list[int], float, dict]:
    start = time.perf_counter()
    if isinstance(runner, Engine):
        options = {}
        if sampling is not None and not sampling.greedy:
            sampled_drafts = draft_sampling if isinstance(runner.drafter, DraftModelDrafter) else "topk"
            options = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                       "seed": sampling.seed, "draft_sampling": sampled_drafts}
        g = runner.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, **options)
        wall = time.perf_counter() - start
        extra = {"steps": len(g.steps), "mean_accepted": g.mean_accepted,
                 "mean_tree_size": statistics.fmean(s.tree_size for s in g.steps) if g.steps else 0.0,
                 "mean_depth": statistics.fmean(s.draft.depth for s in g.steps) if g.steps else 0.0,
                 "drafting_steps": sum(s.tree_size > 0 for s in g.steps),
                 "draft_s": sum(s.draft_s for s in g.steps), "verify_s": sum(s.verify_s for s in g.steps)}
        return g.output_ids, wall, extra
    output, _ = runner.generate(ids, max_new_tokens, sampling)
    return output, time.perf_counter() - start, {}


def summarise(rows: list[dict], compare_outputs: bool = True) -> list[dict]:
    """Per task (and 'all') and method: mean tokens/s, speed-up over AR, tau, tree size, depth, and (greedy
    runs only: sampled outputs differ by design) how many outputs equal AR's."""
    out = []
    rows = _median_over_rounds(rows)
    tasks = sorted({r["task"] for r in rows}) + ["all"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for task in tasks:
        chosen = [r for r in rows if task in ("all", r["task"])]
        ar = {r["prompt_id"]: r for r in chosen if r["method"] == "ar"}
        ar_tps = statistics.fmean(r["tokens_per_s"] for r in ar.values()) if ar else None
        for method in methods:
            mine = [r for r in chosen if r["method"] == method]
            tps = statistics.fmean(r["tokens_per_s"] for r in mine)
            row = {"task": task, "method": method, "prompts": len(mine), "tokens_per_s": round(tps, 3),
                   "speedup": round(tps / ar_tps, 3) if ar_tps else None}
            if "mean_accepted" in mine[0]:
                steps = sum(r["steps"] for r in mine)
                row["tau"] = round(sum(r["new_tokens"] - 1 for r in mine) / steps, 3) if steps else None
                row["mean_tree_size"] = round(statistics.fmean(r["mean_tree_size"] for r in mine), 2)
                row["mean_depth"] = round(statistics.fmean(r["mean_depth"] for r in mine), 2)
                if steps and all("drafting_steps" in r for r in mine):
                    row["drafted_share"] = round(sum(r["drafting_steps"] for r in mine) / steps, 3)
            if ar and compare_outputs:
                row["same_as_ar"] = sum(r["output_ids"] is not None
                                        and r["output_ids"] == ar[r["prompt_id"]]["output_ids"] for r in mine)
            out.append(row)
    return out


_ROUND_MEANS = ("new_tokens", "steps", "mean_accepted", "mean_tree_size", "mean_depth", "drafting_steps", "draft_s",
                "verify_s")


def _median_over_rounds(rows: list[dict]) -> list[dict]:
    """One row per prompt and method: with several rounds, its median tokens/s and wall time over them and the
    rounds' mean steps and tree sizes; its outputs are None (never the same as AR's) unless every round's agree."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["prompt_id"], row["method"]), []).append(row)
    if all(len(group) == 1 for group in groups.values()):
        return rows
    merged = []
    for group in groups.values():
        row = {**group[0], "rounds": len(group), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in group),
               "wall_s": statistics.median(r["wall_s"] for r in group)}
        for key in _ROUND_MEANS:
            if all(r.get(key) is not None for r in group):
                row[key] = statistics.fmean(r[key] for r in group)
        if any(r["output_ids"] != group[0]["output_ids"] for r in group):
            row["output_ids"] = None
        merged.append(row)
    return merged


def _meta(max_new_tokens: int, prompts: int) -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_name(torch.device("cpu")),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "max_new_tokens": max_new_tokens, "prompts": prompts}


def markdown_table(summary: list[dict]) -> str:
    lines = ["| task | method | tokens/s | speed-up | tau | verify size | depth | same as AR |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        cells = [r["task"], f"`{r['method']}`", f"{r['tokens_per_s']:.2f}",
                 f"{r['speedup']:.2f}x" if r.get("speedup") else "-", _fmt(r.get("tau")),
                 _fmt(r.get("mean_tree_size")), _fmt(r.get("mean_depth")),
                 f"{r['same_as_ar']}/{r['prompts']}" if "same_as_ar" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_speedups(summary: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in summary))
    methods = [m for m in dict.fromkeys(r["method"] for r in summary) if m != "ar"]
    many = len(methods) > 10  # the default 10-colour cycle would give two methods one colour
    fig, ax = plt.subplots(figsize=(min(16, max(7, 0.3 * len(methods) * len(tasks) + 2)), 5.0 if many else 4.2))
    width = 0.8 / max(1, len(methods))
    palette = plt.get_cmap("tab20").colors if many else [None] * len(methods)
    for i, method in enumerate(methods):
        values = [next((r["speedup"] or 0 for r in summary if r["task"] == t and r["method"] == method), 0)
                  for t in tasks]
        bars = ax.bar([k + i * width for k in range(len(tasks))], values, width, label=method,
                      color=palette[i % len(palette)])
        ax.bar_label(bars, fmt="%.2f", fontsize=5 if many else 7, rotation=90 if many else 0, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([k + width * (len(methods) - 1) / 2 for k in range(len(tasks))], tasks)
    ax.set_ylabel("speed-up over AR")
    ax.set_ylim(0, 1.3 * max([1.0] + [r["speedup"] or 0 for r in summary]))  # headroom: the legend sits on top
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncols=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def save_results(result: dict, out_dir: Path, name: str, command: str, title: str, throughput: bool = False) -> None:
    """JSON, markdown table and plot of a Spec-Bench run (or, `throughput`, of a batched throughput run)."""
    table, plot = (throughput_table, plot_throughput) if throughput else (markdown_table, plot_speedups)
    out_dir.mkdir(parents=True, exist_ok=True)
    result["meta"]["command"] = command
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{name}.md").write_text(f"# {title}\n\nCommand:\n\n```\n{command}\n```\n\n{_meta_line(result)}\n\n"
                                        f"{table(result['summary'])}\n\n![plot]({name}.png)\n")
    plot(result["summary"], out_dir / f"{name}.png", title)


def _meta_line(result: dict) -> str:
    m = result["meta"]
    return (f"{m['date']}, {m['machine']}, {m['threads']} threads, torch {m['torch']}, transformers "
            f"{m['transformers']}, {m['prompts']} prompts, max {m['max_new_tokens']} new tokens.")


# ---- several runs in one report -----------------------------------------------------------------------------------

def combine_runs(results: list[dict], names: list[str]) -> dict:
    """One report from runs that measured different methods on the same prompts, each with its own AR (a run's
    method list is fixed once it starts, so a method added later needs a run of its own). Only the prompts every run
    finished count; each method's speed-up is over the AR of its own run, measured beside it. The AR row shown is
    the first run's; every run's AR tokens/s on those prompts is kept in meta, to show how far sittings drifted."""
    if len(results) < 2:
        raise CastspecError("combining needs at least two runs")
    settings = [r["meta"].get("settings", {}) for r in results]
    for key in ("model", "dtype", "max_new_tokens", "temperature"):
        values = {json.dumps(s.get(key)) for s in settings}
        if len(values) > 1:
            raise CastspecError(f"the runs differ in {key} ({', '.join(sorted(values))}): their ratios do not compare")
    if any("sampling" in r["meta"] for r in results):
        raise CastspecError("combining reads greedy runs (sampled outputs are not compared with AR)")
    for name, result in zip(names, results, strict=True):
        if not any(row["method"] == "ar" for row in result["rows"]):
            raise CastspecError(f"{name} has no 'ar' rows: its methods have no AR to be compared with")
    common = set.intersection(*({row["prompt_id"] for row in r["rows"]} for r in results))
    if not common:
        raise CastspecError("the runs share no prompt")
    summary, ar_rates, seen = [], {}, set()
    for index, (name, result) in enumerate(zip(names, results, strict=True)):
        rows = [row for row in result["rows"] if row["prompt_id"] in common]
        for row in summarise(rows):
            if row["method"] == "ar":
                if row["task"] == "all":
                    ar_rates[name] = row["tokens_per_s"]
                if index > 0:
                    continue
            elif (row["method"], row["task"]) in seen:
                row = {**row, "method": f"{row['method']} ({name})"}
            seen.add((row["method"], row["task"]))
            summary.append({**row, "run": name})
    meta = {**results[0]["meta"], "prompts": len(common), "runs": names, "ar_tokens_per_s": ar_rates}
    meta.pop("command", None)
    return {"meta": meta, "summary": summary}


def wide_table(summary: list[dict]) -> str:
    """One row per method: speed-up over all prompts with tau, verify size and depth, then speed-up per task."""
    tasks = [t for t in dict.fromkeys(r["task"] for r in summary) if t != "all"]
    cell = {(r["method"], r["task"]): r for r in summary}
    lines = ["| method | all | tau | verify size | depth | " + " | ".join(tasks) + " |",
             "|---|" + "---|" * (4 + len(tasks))]
    for method in dict.fromkeys(r["method"] for r in summary):
        every = cell[(method, "all")]
        speedups = [cell.get((method, t), {}).get("speedup") for t in tasks]
        lines.append(f"| `{method}` | " + " | ".join(
            [_times(every.get("speedup")), _fmt(every.get("tau")), _fmt(every.get("mean_tree_size")),
             _fmt(every.get("mean_depth"))] + [_times(s) for s in speedups]) + " |")
    return "\n".join(lines)


def _times(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def save_combined(combined: dict, out_dir: Path, name: str, command: str, title: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    combined["meta"]["command"] = command
    (out_dir / f"{name}.json").write_text(json.dumps(combined, indent=1))
    m = combined["meta"]
    drift = ", ".join(f"{run}: {rate:.2f}" for run, rate in m["ar_tokens_per_s"].items())
    (out_dir / f"{name}.md").write_text(
        f"# {title}\n\nCommand:\n\n```\n{command}\n```\n\n{m['prompts']} prompts finished by every run; each "
        f"method's speed-up is over the AR of its own run (AR tokens/s per run: {drift}).\n\n"
        f"{wide_table(combined['summary'])}\n\n{markdown_table(combined['summary'])}\n\n![plot]({name}.png)\n")
    plot_speedups(combined["summary"], out_dir / f"{name}.png", title)


# ---- batched throughput ------------------------------------------------------------------------------------------

def run_throughput(target_model, tokenizer, draft_model, specs: list[MethodSpec], prompts: list[dict],
                   max_new_tokens: int, batch_sizes: list[int], partial: Path | None = None, head=None) -> dict:
    """For each batch size B, every method decodes the prompts in batches of B (methods interleaved per batch);
    throughput = all new tokens / all wall time; speed-up over batched AR at the same B."""
    if any(spec.method.startswith("hf-") for spec in specs):
        raise CastspecError("the HF baselines decode one prompt at a time: leave them out of a batched run")
    runners = _runners(target_model, tokenizer, draft_model, specs, head)
    engine = next(iter(runners.values()))
    encoded = encode_prompts(engine, prompts)
    for runner in runners.values():  # warm-up (one short prompt: on a CPU a batched prefill costs minutes)
        runner.generate_batch(prompt_ids=[min(encoded, key=len)], max_new_tokens=min(4, max_new_tokens))
    rows = []
    batches = [(b, encoded[i: i + b]) for b in batch_sizes for i in range(0, len(encoded), b)]
    progress = tqdm(total=len(batches) * len(runners), desc="throughput", unit="batch")
    for b, batch in batches:
        for label, runner in runners.items():
            progress.set_postfix_str(f"B={b} {label}")
            start = time.perf_counter()
            gens = runner.generate_batch(prompt_ids=batch, max_new_tokens=max_new_tokens)
            wall = time.perf_counter() - start
            steps = [s for g in gens for s in g.steps]
            longest = max(gens, key=lambda g: len(g.steps))  # it was in every batched step
            rows.append({"batch_size": b, "method": label, "rows": len(batch),
                         "new_tokens": sum(len(g.output_ids) for g in gens), "wall_s": wall,
                         "decode_s": sum(s.draft_s + s.verify_s for s in longest.steps),
                         "steps": max(len(g.steps) for g in gens),
                         "accepted": sum(len(g.output_ids) - 1 for g in gens), "row_steps": len(steps),
                         "mean_tree_size": statistics.fmean(s.tree_size for s in steps) if steps else 0.0,
                         "output_ids": [g.output_ids for g in gens]})
            if partial is not None:
                with open(partial, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            progress.update()
    progress.close()
    meta = _meta(max_new_tokens, len(prompts))
    meta["batch_sizes"] = batch_sizes
    return {"meta": meta, "rows": rows, "summary": summarise_throughput(rows)}


def summarise_throughput(rows: list[dict]) -> list[dict]:
    out = []
    for b in sorted({r["batch_size"] for r in rows}):
        at_b = [r for r in rows if r["batch_size"] == b]
        ar = [r for r in at_b if r["method"] == "ar"]
        ar_tps = sum(r["new_tokens"] for r in ar) / sum(r["wall_s"] for r in ar) if ar else None
        ar_decode = _decode_rate(ar) if ar else None
        ar_outputs = [o for r in ar for o in r["output_ids"]]
        for method in dict.fromkeys(r["method"] for r in at_b):
            mine = [r for r in at_b if r["method"] == method]
            tps = sum(r["new_tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
            decode = _decode_rate(mine)
            outputs = [o for r in mine for o in r["output_ids"]]
            row_steps = sum(r["row_steps"] for r in mine)
            out.append({"batch_size": b, "method": method, "tokens_per_s": round(tps, 3),
                        "speedup": round(tps / ar_tps, 3) if ar_tps else None,
                        "decode_tokens_per_s": round(decode, 3) if decode else None,
                        "decode_speedup": round(decode / ar_decode, 3) if decode and ar_decode else None,
                        "tau": round(sum(r["accepted"] for r in mine) / row_steps, 3) if row_steps else None,
                        "mean_tree_size": round(statistics.fmean(r["mean_tree_size"] for r in mine), 2),
                        "same_as_ar": sum(a == o for a, o in zip(ar_outputs, outputs, strict=False)),
                        "prompts": len(outputs)})
    return out


def _decode_rate(rows: list[dict]) -> float | None:
    """Tokens/s of the decode steps alone: the prefill (minutes for a batch on a CPU) and its first token left out."""
    decode_s = sum(r.get("decode_s", 0.0) for r in rows)
    return sum(r["new_tokens"] - r["rows"] for r in rows) / decode_s if decode_s > 0 else None


def throughput_table(summary: list[dict]) -> str:
    lines = ["| B | method | tokens/s | speed-up over batched AR | decode-only speed-up | tau | verify size | "
             "same as AR |", "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        decode = r.get("decode_speedup")
        lines.append(f"| {r['batch_size']} | `{r['method']}` | {r['tokens_per_s']:.2f} | "
                     f"{r['speedup']:.2f}x | {f'{decode:.2f}x' if decode else '-'} | {_fmt(r['tau'])} | "
                     f"{_fmt(r['mean_tree_size'])} | "
                     f"{r['same_as_ar']}/{r['prompts']} |")
    return "\n".join(lines)


def plot_throughput(summary: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in summary):
        mine = [r for r in summary if r["method"] == method]
        sizes = [r["batch_size"] for r in mine]
        left.plot(sizes, [r["speedup"] for r in mine], marker="o", label=method)
        right.plot(sizes, [r["tokens_per_s"] for r in mine], marker="o", label=method)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    for ax, label in ((left, "speed-up over batched AR"), (right, "total tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
