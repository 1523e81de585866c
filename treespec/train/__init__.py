"""Training draft heads (``treespec train-eagle``)."""

from .trainer import Progress, TrainConfig, capture, train_eagle, validate

__all__ = ["TrainConfig", "train_eagle", "capture", "Progress", "validate"]
