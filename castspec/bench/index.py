"""bench/README.md, generated from the runs' own JSON files: one section per study folder, one line per run with
its date, machine, headline figure and files, and the command that produced it (`castspec bench-index`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPERSEDED = "superseded.json"  # {"study/run-name": "why, and by what"}: runs kept for the record, marked


@dataclass
class Run:
    study: str
    name: str
    date: str = "?"
    machine: str = "?"
    command: str | None = None
    headline: str = "-"
    files: list[str] = field(default_factory=list)
    superseded: str | None = None


def _first(data: dict, *paths: str):
    """The first value found along dotted key paths (runs of different kinds keep their settings in different
    places)."""
    for path in paths:
        value = data
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value not in (None, ""):
            return value
    return None


def _speedup_rows(data: dict) -> list[dict]:
    rows = data.get("summary") if isinstance(data.get("summary"), list) else data.get("rows")
    if not isinstance(rows, list):
        return []
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("speedup", r.get("speedup_vs_ar")), float)]
    overall = [r for r in rows if r.get("task") == "all"]
    return overall or rows


def _where(row: dict) -> str:
    for key, label in (("batch_size", "B={}"), ("level", "{} at once"), ("rate", "{}/s")):
        if key in row and (key != "level" or row.get("kind") == "concurrency"):
            return " " + label.format(row[key])
    return ""


def _best(label: str, rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r.get("speedup", r.get("speedup_vs_ar")))
    speedup = best.get("speedup", best.get("speedup_vs_ar"))
    tau = f", tau {best['tau']:.2f}" if isinstance(best.get("tau"), float) else ""
    return f"{label} {best['method']}{_where(best)}: {speedup:.2f}x over AR{tau}"


def headline(data: dict) -> str:
    """The one figure a reader scans for: the fastest method against AR in that run, or the kind's own measure."""
    rows = [r for r in _speedup_rows(data) if not str(r.get("method", "")).startswith("ar")]
    ours = [r for r in rows if not str(r.get("method", "")).startswith("hf-")]
    if rows:
        said = [_best("best", ours or rows)]
        if ours and len(ours) < len(rows):
            said.append(_best("best peer", [r for r in rows if r not in ours]))
        return "; ".join(said) + f" ({len(rows)} rows)"
    if data.get("format") and isinstance(data.get("target"), dict):  # a cost table
        grid = data["target"]
        try:
            first, last = grid["seconds"][0][0][0], grid["seconds"][0][0][-1]
            return (f"cost table: target {1000 * first:.1f} ms for 1 token at B={grid['batch_sizes'][0]}, "
                    f"{last / first:.2f}x that for {grid['tokens'][-1]} tokens")
        except (KeyError, IndexError, TypeError, ZeroDivisionError):
            return "cost table"
    joins = [r for r in data.get("rows", []) if isinstance(r, dict) and isinstance(r.get("p99_ratio"), float)]
    if joins:  # bench/scripts/chunked_prefill_itl.py
        return "ITL p99 while a long prompt joins / steady p99: " + ", ".join(
            f"{r['server']} {r['p99_ratio']:.2f}x" for r in joins)
    memory = data.get("summary")
    if isinstance(memory, dict) and "rss_warm_max_mib" in memory:  # bench/scripts/prefix_cache_memory.py
        return (f"{memory['turns']} turns: RSS {memory['rss_warm_min_mib']:.0f}-{memory['rss_warm_max_mib']:.0f} "
                f"MiB after warm-up, prefix cache at most {memory['cache_max_mib']:.0f} of "
                f"{memory['cache_bound_mib']:.0f} MiB, {memory['evictions']:.0f} evictions")
    servers = data.get("servers")
    if isinstance(servers, dict) and servers:  # the peer scripts: throughput per server and level
        cells = []
        for name, server in servers.items():
            levels = server.get("levels", {}) if isinstance(server, dict) else {}
            values = [v.get("throughput_tok_s", v.get("output_throughput", v.get("tok_s"))) for v in levels.values()
                      if isinstance(v, dict)]
            if values and all(isinstance(v, float) for v in values):
                cells.append(f"{name} " + "/".join(f"{v:.2f}" for v in values))
        if cells:
            return "tok/s at " + "/".join(f"c={c}" for c in next(iter(servers.values())).get("levels", {})) + ": " \
                + ", ".join(cells)
    engines = data.get("engines")
    if isinstance(engines, dict) and engines:  # bench/scripts/grammar_engines.py
        return "grammar mask median: " + ", ".join(
            f"{name} {e.get('mask_us_median', float('nan')):.0f} us ({e.get('installed_mib', '?')} MiB)"
            for name, e in engines.items())
    pairs = data.get("summary") if isinstance(data.get("summary"), list) else []
    pairs = [r for r in pairs if isinstance(r, dict) and all(isinstance(r.get(k), dict) and "host_ms" in r[k]
                                                              for k in ("before", "after"))]
    if pairs:  # bench/scripts/overhead_ab.py: the widest tree at the smallest batch, before -> after
        row = min(pairs, key=lambda r: (r.get("batch_size", 0), -r["after"].get("nodes", 0)))
        return (f"host ms per step before -> after: {row['method']} B={row.get('batch_size')} "
                f"{row['before']['host_ms']:.2f} -> {row['after']['host_ms']:.2f}")
    host = [r["host_ms"] for r in data.get("rows", []) if isinstance(r, dict) and "host_ms" in r]
    if host:
        return f"host time per step {min(host):.2f}-{max(host):.2f} ms over {len(host)} methods"
    replayed = [r for r in data.get("replayed") or [] if isinstance(r, dict) and "predicted_speedup" in r]
    if replayed:
        best = max(replayed, key=lambda r: r["predicted_speedup"])
        return f"best of {len(replayed)} by replay: {best['method']} {best['predicted_speedup']:.2f}x predicted"
    variants = {k: v for k, v in data.items() if isinstance(v, dict) and "predicted_speedup" in v}
    if variants:
        name, best = max(variants.items(), key=lambda kv: kv[1]["predicted_speedup"])
        return f"best of {len(variants)} by replay: {name} {best['predicted_speedup']:.2f}x predicted"
    report = data.get("report")
    if isinstance(report, dict) and isinstance(report.get("during"), dict):
        return ("under load: median verify-cost prediction error "
                f"{report['during'].get('median_prediction_error', float('nan')):.0%}, tree size "
                f"{report['before'].get('mean_tree_size', float('nan')):.2f} -> "
                f"{report['during'].get('mean_tree_size', float('nan')):.2f}")
    errors = _first(data, "summary.target.learned.all"), _first(data, "summary.target.profiled.all")
    if all(isinstance(e, float) for e in errors):
        return f"median target-cost error: learned {errors[0]:.0%}, profiled {errors[1]:.0%}"
    recipes = data.get("results")
    if isinstance(recipes, list) and recipes and isinstance(recipes[0], dict) and "recipe" in recipes[0]:
        best = max(recipes, key=lambda r: r.get("validation", {}).get("top1", 0))
        return f"best of {len(recipes)} recipes: {best['recipe']} (validation top-1 {best['validation']['top1']:.3f})"
    epochs = data.get("validation_after_epoch_1")
    if isinstance(epochs, list) and epochs and "top1" in epochs[-1]:
        return f"head trained {data.get('steps', '?')} steps: validation top-1 {epochs[-1]['top1']:.3f} after epoch 1"
    validation = data.get("validation")
    if isinstance(validation, dict) and "top1" in validation:
        return f"head trained {data.get('steps', '?')} steps: validation top-1 {validation['top1']:.3f}"
    results = data.get("results")
    if isinstance(results, list) and results and isinstance(results[0], dict) and "agree_1" in results[0]:
        return "agreement with the target: " + ", ".join(f"{r['agree_1']:.3f}" for r in results)
    return "-"


def describe(path: Path, bench: Path) -> Run:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        data = {}
    rel = path.relative_to(bench)
    study = rel.parts[0] if len(rel.parts) > 1 else "(not filed in a study)"
    siblings = sorted(p.name for p in path.parent.glob(path.stem + ".*") if p.suffix in (".json", ".md", ".png"))
    machine = _first(data, "meta.machine", "machine", "report.machine", "meta.target.device", "meta.device")
    return Run(study, str(rel.with_suffix("")), str(_first(data, "meta.date", "date", "report.date") or "?"),
               str(machine or "?"), _first(data, "meta.command", "command", "report.command"), headline(data),
               siblings)


def collect(bench: Path) -> list[Run]:
    marks = json.loads((bench / SUPERSEDED).read_text()) if (bench / SUPERSEDED).exists() else {}
    runs = []
    for path in sorted(bench.rglob("*.json")):
        if path.name == SUPERSEDED or path.name.endswith(".partial.json") or "scripts" in path.parts:
            continue
        run = describe(path, bench)
        run.superseded = marks.get(run.name)
        runs.append(run)
    unknown = set(marks) - {r.name for r in runs}
    if unknown:
        raise ValueError(f"{bench / SUPERSEDED} names runs that are not there: {', '.join(sorted(unknown))}")
    return runs


def render(runs: list[Run], bench: Path) -> str:
    studies: dict[str, list[Run]] = {}
    for run in runs:
        studies.setdefault(run.study, []).append(run)
    out = ["# Benchmarks: the index", "",
           "Generated by `castspec bench-index` from the JSON files below; do not edit by hand (a test checks it",
           "is current). Each run's JSON, markdown table and plot sit together in its study's folder; speed-ups",
           "are ratios measured side by side in one run on the machine named. The narrative of every run, in the",
           "order they were made: [HISTORY.md](HISTORY.md). Runs marked *superseded* are kept for the record",
           f"({SUPERSEDED}).",
           "", "| study | runs | latest | notes |", "|---|---|---|---|"]
    for study, members in studies.items():
        notes = f"[README]({study}/README.md)" if (bench / study / "README.md").exists() else ""
        out.append(f"| [{study}](#{study.strip('()').replace(' ', '-')}) | {len(members)} | "
                   f"{max((r.date for r in members if r.date != '?'), default='?')} | {notes} |")
    for study, members in studies.items():
        out += ["", f"## {study}", ""]
        for run in sorted(members, key=lambda r: r.date, reverse=True):
            folder = str(Path(run.name).parent)
            links = " ".join(f"[{Path(f).suffix[1:]}]({folder}/{f})" for f in run.files)
            mark = f" *superseded: {run.superseded}*" if run.superseded else ""
            out.append(f"- **{Path(run.name).name}** ({run.date}, {run.machine}): {run.headline}. {links}{mark}")
            if run.command:
                out.append(f"  `{run.command}`")
    return "\n".join(out) + "\n"


def write_index(bench: Path = Path("bench")) -> Path:
    target = bench / "README.md"
    target.write_text(render(collect(bench), bench))
    return target
