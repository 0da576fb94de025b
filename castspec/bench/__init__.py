"""Measurement shells: the side-by-side benchmark (runner), prompt sets (prompts), the load benchmark over HTTP
(serving), host overhead per step (overhead), fixed-tree tuning by replay (tune, replay), one step drawn
(explain) and the index of bench/ (index)."""

# requests each client sends per concurrency level of the load benchmark: with 2, every finished row is replaced at
# least once, so a level measures steady load rather than one wave draining (here, not in serving, so that the CLI's
# parser reads it without importing torch)
PER_CLIENT = 2
