"""Drafters, one per file behind the small interface in base.py: a draft model, an EAGLE-1/2/3 head, the n-gram
(prompt lookup) and suffix-tree lookups, and the merge of a model drafter with a lookup."""
