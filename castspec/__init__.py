"""castspec: cost-aware speculative tree decoding for Hugging Face causal LMs."""

from castspec.api import Engine, Generation
from castspec.errors import CastspecError
from castspec.tree import DraftTree

__all__ = ["CastspecError", "DraftTree", "Engine", "Generation"]
__version__ = "0.1.0"
