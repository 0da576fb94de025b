"""Measurement shells: the side-by-side benchmark (runner), prompt sets (prompts), the load benchmark over HTTP
(serving), host overhead per step (overhead), fixed-tree tuning by replay (tune, replay), one step drawn
(explain) and the index of bench/ (index)."""
