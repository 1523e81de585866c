"""Drafters: who proposes the tree. One interface (:class:`Drafter`), several sources."""

from .base import DraftSession, DraftStart, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "DraftSession", "DraftStart", "ModelDrafter", "NgramDrafter"]
