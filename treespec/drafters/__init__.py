"""Drafters: who proposes the tree. One interface (:class:`Drafter`), several sources."""

from .base import DraftSession, DraftStart, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .eagle import Eagle3Drafter, EagleDrafter, load_draft
from .eagle_head import EagleHead
from .hybrid import HybridDrafter
from .recording import RecordingDrafter

__all__ = ["Drafter", "DraftSession", "DraftStart", "ModelDrafter", "NgramDrafter", "NoDrafter", "EagleDrafter", "Eagle3Drafter", "EagleHead", "HybridDrafter", "RecordingDrafter", "load_draft"]
