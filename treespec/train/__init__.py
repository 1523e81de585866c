"""Training draft heads (``treespec train-eagle``).

Modules, each importing only those before it: ``data`` (JSONL in, tokenised conversations out)
-> ``records`` (the record format, feature hooks, teacher-forced and generated batches, progress)
-> ``shards`` (reading a capture folder) -> ``capture`` (sharded, resumable captures) -> ``trainer``
(``train_eagle``) -> ``pipeline`` (a head for one's own model in one call: the target writes its
prompts, answers them, a head is trained, validated and tuned, sized by ``budget`` to a time
budget). ``generated_prompts`` and ``magpie`` build training prompt sets.
"""

from .records import Progress
from .trainer import TrainConfig, capture, keep_freed_memory, train_eagle, validate

__all__ = ["TrainConfig", "train_eagle", "capture", "Progress", "validate", "keep_freed_memory"]
