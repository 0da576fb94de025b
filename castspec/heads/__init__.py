"""EAGLE draft heads made here: the training recipe (config), training and widening (train), and the
target's own answers as training data (regenerate)."""
