"""Settings of `castspec train-head` (a module of its own so that the CLI parser needs no torch)."""

from __future__ import annotations

from dataclasses import dataclass

LOSS_ON = ("responses", "all")
LAYER_INIT = ("random", "target")
ARCH = ("eagle", "eagle3")


@dataclass
class TrainConfig:
    conversations: int = 600
    max_length: int = 256
    epochs: int = 2
    batch_size: int = 4
    lr: float = 5e-4
    warmup: int = 20
    noise: float = 0.05  # std of the input-feature noise, relative to the features' RMS
    p_weight: float = 0.1
    save_every: int = 50
    validation: int = 24  # sequences held out
    seed: int = 0
    draft_vocab: int = 0  # draft among the N tokens most frequent in the data (0: the target's whole vocabulary)
    init: str = ""  # start from this head (its weights and draft vocabulary; EAGLE-3 with --arch eagle3)
    layer_init: str = "random"  # a fresh head's decoder layer: random, or a copy of the target's last layer
    unroll: int = 1  # passes per step: 1 is EAGLE's loss; k also trains on the head's own predictions k - 1 deep
    arch: str = "eagle"  # eagle: EAGLE-1/2 (last-layer feature, the target's lm_head); eagle3: fused features
    loss_on: str = "responses"  # which predictions count: of assistant tokens only (EAGLE's loss mask) or of all
