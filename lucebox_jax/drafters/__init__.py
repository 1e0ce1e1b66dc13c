"""Drafters for speculative decoding, by name (see base.py for the interface and the list): `eagle` (a trained draft
head), `layers:N`, `ngram`, `model:PATH`. Importing the package registers all of them."""

from .base import DraftError, Drafter, available, build, compute_bytes, register
from .eagle import EagleDrafter
from .layers import LayerSkipDrafter
from .model import ModelDrafter, draft_steps
from .ngram import NgramDrafter

__all__ = ["DraftError", "Drafter", "available", "build", "compute_bytes", "register", "EagleDrafter",
           "LayerSkipDrafter", "ModelDrafter", "NgramDrafter", "draft_steps"]
