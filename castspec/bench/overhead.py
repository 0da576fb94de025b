"""Host overhead per decoding step, measured with models so cheap that everything but the forwards shows.

`castspec bench --overhead` makes random-weight models on the fly (no download): a target, a draft model (a noisy
copy of the target, so that drafts are partly accepted and paths of several tokens get committed) and a 1-layer
EAGLE head, then decodes random prompts with each method at each batch size under a `StepTimer`. Per step it
reports the wall time, the time inside target and drafter forwards, and the rest, the host's bookkeeping, split
by phase of the step. HF greedy and HF assisted generation run beside, timed the same way, as the outside
reference. Every method's output is checked against AR's (greedy, so they must be equal). The target's decode
forward is compiled as `castspec serve` compiles it (`decode.compiled`; `--no-compile`: eager), and its compiled
calls count as target forwards.

Sizes: "tiny" (2 layers, 64 wide, SmolLM2's 49152-token vocabulary: a forward costs ~2-3 ms on one CPU thread,
so the host work is most of a step, as it is beside a GPU forward) and "8b" (Llama-3-8B's geometry with a
1B-geometry draft, for the GPU check; random weights made on the device)."""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from castspec.bench.runner import MethodSpec, method_parts
from castspec.decode.compiled import is_compiled
from castspec.decode.engine import StepEngine, StopCondition
from castspec.decode.step_timer import PHASES, StepTimer
from castspec.decode.target import Target
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHead, EagleHeadDrafter, head_config
from castspec.drafters.with_ngram import NgramAugmentedDrafter
from castspec.errors import CastspecError

SIZES = {
    # name: (target geometry, draft geometry or None for a noisy copy of the target)
    "tiny": (dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2), None),
    "small": (dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2), None),
    "8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8),
           dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8)),
}
DEFAULT_METHODS = ("ar;chain:draft:chain_length=4;eagle2:draft:top_k=4,depth=4,total_tokens=16;eagle2:draft;"
                   "eagle2:head:top_k=4,depth=4,total_tokens=16;eagle2:head;cast:draft;cast:head;cast:ngram")
HF_REFERENCES = ("hf-greedy", "hf-assisted")


@dataclass
class RandomModels:
    target: LlamaForCausalLM
    draft: LlamaForCausalLM
    head: EagleHead
    size: str


def _llama(geometry: dict, device: torch.device, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**geometry, max_position_embeddings=8192, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype on its device: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.config._name_or_path = f"random-llama-{geometry['hidden_size']}x{geometry['num_hidden_layers']}-seed{seed}"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_models(size: str = "tiny", device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                  draft_noise: float = 0.3) -> RandomModels:
    """Random-weight models of one of `SIZES`. A draft without its own geometry is the target with Gaussian
    noise (`draft_noise` times each weight's spread) added: it agrees with the target often, not always."""
    if size not in SIZES:
        raise CastspecError(f"unknown overhead model size {size!r}; choose from {', '.join(SIZES)}")
    target_geometry, draft_geometry = SIZES[size]
    device = torch.device(device)
    target = _llama(target_geometry, device, dtype, seed)
    if draft_geometry is None:
        draft = copy.deepcopy(target)
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for param in draft.parameters():
                if param.dim() > 1:
                    noise = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
                    param.add_((noise * param.float().std() * draft_noise).to(dtype))
        draft.config._name_or_path = target.config._name_or_path + f"-noisy{draft_noise:g}"
    else:
        draft = _llama(draft_geometry, device, dtype, seed + 1)
    torch.manual_seed(seed + 2)
    with torch.device(device):
        head = EagleHead(head_config(target)).to(dtype).eval()
    return RandomModels(target, draft, head, size)


def _drafter_modules(drafter) -> list[torch.nn.Module]:
    """The modules whose forwards are the drafter's compute (a head's logits come from the target's lm_head)."""
    if isinstance(drafter, NgramAugmentedDrafter):
        drafter = drafter.primary
    if isinstance(drafter, EagleHeadDrafter):
        return [drafter.head, drafter.lm_head]
    if isinstance(drafter, DraftModelDrafter):
        return [drafter.model]
    return []


@contextlib.contextmanager
def _scratch_home():
    """CAST's cost model probes these throwaway models; what it learns must not land in the user's home."""
    before = os.environ.get("CASTSPEC_HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["CASTSPEC_HOME"] = home
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("CASTSPEC_HOME", None)
            else:
                os.environ["CASTSPEC_HOME"] = before


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random tokens, each repeating a random phrase with variations (so an n-gram drafter finds
    matches, as in real text that quotes itself)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        phrase = torch.randint(0, vocab, (12,), generator=generator).tolist()
        tokens: list[int] = []
        while len(tokens) < length:
            tokens += phrase if torch.rand((), generator=generator) < 0.5 else \
                torch.randint(0, vocab, (6,), generator=generator).tolist()
        prompts.append(tokens[:length])
    return prompts


def _summary(label: str, batch_size: int, steps: list[dict], tokens: int, same: bool | None) -> dict:
    """Means per decode step, in milliseconds; host = wall - forwards, and per phase the phase's share of it."""
    def mean(key: str) -> float:
        return 1000 * statistics.fmean(s.get(key, 0.0) for s in steps) if steps else 0.0

    wall, target_fwd, drafter_fwd = mean("wall_s"), mean("target_forward_s"), mean("drafter_forward_s")
    candidates = mean("candidates_s")
    phases = {phase: mean(phase) for phase in PHASES}
    host_phases = dict(phases)
    host_phases["draft"] = phases["draft"] - drafter_fwd - candidates  # both happen inside the draft phase
    host_phases["verify"] = phases["verify"] - target_fwd
    return {
        "method": label, "batch_size": batch_size, "steps": len(steps), "tokens": tokens,
        "tokens_per_step": tokens / len(steps) / batch_size if steps else 0.0,
        "tree_nodes": statistics.fmean(s["tree_nodes"] / s["batch_size"] for s in steps) if steps else 0.0,
        "target_forwards": statistics.fmean(s.get("target_forwards", 0) for s in steps) if steps else 0.0,
        "drafter_forwards": statistics.fmean(s.get("drafter_forwards", 0) for s in steps) if steps else 0.0,
        "wall_ms": wall, "target_forward_ms": target_fwd, "drafter_forward_ms": drafter_fwd,
        "candidates_ms": candidates, "host_ms": wall - target_fwd - drafter_fwd - candidates,
        "host_phase_ms": {k: round(v, 4) for k, v in host_phases.items()},
        "ms_per_token": 1000 * sum(s["wall_s"] for s in steps) / tokens if tokens else 0.0,
        "same_as_ar": same,
    }


def _decode_timed(engine: StepEngine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    for b, prompt in enumerate(prompts):
        engine.add_sequence(str(b), prompt, StopCondition(max_new_tokens, set(), [], None))
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            outputs[int(out.request_id)] = out.output_ids
    return outputs


def measure_method(models: RandomModels, spec: MethodSpec, batch_size: int, prompts: list[list[int]],
                   max_new_tokens: int) -> tuple[list[list[int]], list[dict]]:
    """Decode `prompts` in batches of `batch_size` (one warm-up batch first); returns outputs and timed steps."""
    head = (models.head, f"random-head-{models.size}")
    with _scratch_home():
        drafter, policy = method_parts(spec, models.target, models.draft, head)
    target = Target(models.target)
    device = target.device
    engine = StepEngine(target, drafter, policy, max_batch_size=batch_size)
    _decode_timed(engine, prompts[:batch_size], min(16, max_new_tokens))  # warm-up: allocator, kernels
    timer = StepTimer(device, {"target": [models.target], "drafter": _drafter_modules(drafter)})
    if is_compiled(models.target):  # the compiled forward is called as is, past the model's forward hooks
        timer.time_calls(models.target, "castspec_compiled", "target_forward", count="target_forwards")
    model_drafter = drafter.primary if isinstance(drafter, NgramAugmentedDrafter) else drafter
    if isinstance(model_drafter, DraftModelDrafter):  # softmax and top-k over the vocabulary: device work
        timer.time_calls(model_drafter, "_candidates", "candidates")
    engine.timer = timer
    outputs = []
    try:
        for start in range(0, len(prompts), batch_size):
            outputs += _decode_timed(engine, prompts[start: start + batch_size], max_new_tokens)
    finally:
        timer.close()
        engine.timer = None
    return outputs, timer.steps


def measure_hf(models: RandomModels, which: str, batch_size: int, prompts: list[list[int]], max_new_tokens: int
               ) -> tuple[list[list[int]], dict]:
    """HF `generate` greedy (or assisted by the draft model, batch 1 only), timed as a whole and per forward."""
    model = models.target
    device = next(model.parameters()).device
    timer = StepTimer(device, {"target": [model], "drafter": [models.draft]})
    extra = {"assistant_model": models.draft} if which == "hf-assisted" else {}
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    if which == "hf-assisted":  # a fixed 4-token draft, as our chain of 4 (HF's default schedule adapts)
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = 4, "constant"
        config.assistant_confidence_threshold = 0.0

    def run(batch: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
        return out[:, ids.shape[1]:].tolist()

    run(prompts[:batch_size])  # warm-up
    outputs, walls, totals = [], 0.0, {"target_forward_s": 0.0, "drafter_forward_s": 0.0, "target_forwards": 0}
    try:
        for start in range(0, len(prompts), batch_size):
            timer.begin()
            outputs += run(prompts[start: start + batch_size])
            timer.end(batch_size, 0)
            step = timer.steps[-1]
            walls += step["wall_s"]
            for key in totals:
                totals[key] += step.get(key, 0)
    finally:
        timer.close()
    tokens = sum(len(o) for o in outputs)
    forwards = max(1, totals["target_forwards"])
    wall_ms, target_ms, drafter_ms = 1000 * walls, 1000 * totals["target_forward_s"], 1000 * totals["drafter_forward_s"]
    return outputs, {
        "method": which, "batch_size": batch_size, "steps": forwards, "tokens": tokens,
        "tokens_per_step": tokens / forwards / batch_size, "tree_nodes": None,
        "target_forwards": 1.0, "drafter_forwards": None,
        "wall_ms": wall_ms / forwards, "target_forward_ms": target_ms / forwards,
        "drafter_forward_ms": drafter_ms / forwards, "candidates_ms": None,
        "host_ms": (wall_ms - target_ms - drafter_ms) / forwards,
        "host_phase_ms": None, "ms_per_token": wall_ms / tokens if tokens else 0.0, "same_as_ar": None,
    }


def run_overhead(models: RandomModels, specs: list[MethodSpec], batch_sizes: list[int], prompts: int = 4,
                 prompt_length: int = 64, max_new_tokens: int = 48, hf: bool = True, progress=print) -> dict:
    """Every method at every batch size on the same random prompts; AR first, since outputs are checked
    against it. A step of one of ours = one target verify (and the drafting before it); HF's = one target
    forward (its per-step numbers are per forward)."""
    if any(s.method in ("hf-assisted", "hf-prompt-lookup") for s in specs):
        raise CastspecError("the overhead measurement runs HF's references itself; leave hf-* out of --methods")
    vocab = models.target.config.vocab_size
    rows = []
    for batch_size in batch_sizes:
        batch_prompts = random_prompts(vocab, max(prompts, batch_size), prompt_length)
        reference = None
        ordered = sorted(specs, key=lambda s: s.method != "ar")
        for spec in ordered:
            start = time.perf_counter()
            outputs, steps = measure_method(models, spec, batch_size, batch_prompts, max_new_tokens)
            if spec.method == "ar":
                reference = outputs
            same = None if reference is None else outputs == reference
            row = _summary(spec.label, batch_size, steps, sum(len(o) for o in outputs), same)
            rows.append(row)
            progress(f"B={batch_size} {spec.label}: {row['wall_ms']:.2f} ms/step, host {row['host_ms']:.2f} ms, "
                     f"{row['tree_nodes']:.1f} nodes, {row['tokens_per_step']:.2f} tokens/step"
                     f"{'' if same is None else ', same as AR' if same else ', DIFFERS FROM AR'} "
                     f"({time.perf_counter() - start:.0f} s)")
        if hf:
            for which in HF_REFERENCES:
                if which == "hf-assisted" and batch_size > 1:
                    continue  # HF's assisted generation decodes one sequence at a time
                outputs, row = measure_hf(models, which, batch_size, batch_prompts, max_new_tokens)
                row["same_as_ar"] = None if reference is None else outputs == reference
                rows.append(row)
                progress(f"B={batch_size} {which}: {row['ms_per_token']:.2f} ms/token, {row['wall_ms']:.2f} ms per "
                         f"forward, host {row['host_ms']:.2f} ms")
    device = next(models.target.parameters()).device
    return {"meta": {"size": models.size, "device": str(device), "dtype": str(next(models.target.parameters()).dtype),
                     "threads": torch.get_num_threads(), "prompts": max(prompts, max(batch_sizes)),
                     "prompt_length": prompt_length, "max_new_tokens": max_new_tokens,
                     "compiled": is_compiled(models.target),
                     "date": time.strftime("%Y-%m-%d %H:%M")},
            "rows": rows}


def overhead_table(rows: list[dict]) -> str:
    lines = ["| method | B | nodes | tok/step | wall ms | target fwd | drafter fwd | top-k | host ms | "
             + " | ".join(PHASES) + " | = AR |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for r in rows:
        phases = r["host_phase_ms"] or {}
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {_num(r['tree_nodes'], 1)} | {r['tokens_per_step']:.2f} | "
            f"{r['wall_ms']:.2f} | {r['target_forward_ms']:.2f} | {_num(r['drafter_forward_ms'], 2)} | "
            f"{_num(r['candidates_ms'], 2)} | "
            f"**{r['host_ms']:.2f}** | " + " | ".join(_num(phases.get(p), 2) for p in PHASES)
            + f" | {'' if r['same_as_ar'] is None else 'yes' if r['same_as_ar'] else 'NO'} |")
    return "\n".join(lines)


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot_overhead(rows: list[dict], out: Path, title: str) -> None:
    """Stacked bars per method and batch size: forwards, then each host phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(6.5 * len(batch_sizes), 4.8), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, b in zip(axes[0], batch_sizes, strict=True):
        ours = [r for r in rows if r["batch_size"] == b]
        names = [r["method"] for r in ours]
        bottom = [0.0] * len(ours)
        parts = [("target forward", [r["target_forward_ms"] for r in ours]),
                 ("drafter forward", [r["drafter_forward_ms"] or 0.0 for r in ours]),
                 ("drafter top-k over the vocabulary", [r["candidates_ms"] or 0.0 for r in ours])]
        parts += [(f"host: {p}", [(r["host_phase_ms"] or {}).get(p, 0.0) for r in ours]) for p in PHASES]
        parts.append(("host, not split (HF)", [r["host_ms"] if r["host_phase_ms"] is None else 0.0 for r in ours]))
        for i, (label, values) in enumerate(parts):
            ax.barh(names, values, left=bottom, label=label, color=colors[i % len(colors)],
                    hatch="" if i < 3 else "//")
            bottom = [x + v for x, v in zip(bottom, values, strict=True)]
        ax.set_title(f"B = {b}")
        ax.set_xlabel("ms per step (HF: per forward)")
        ax.invert_yaxis()
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
