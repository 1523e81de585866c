"""A small capture for the training tests: a dataset of short stories (one prompt too long to
keep), and a capture's settings sized for a tiny model."""

from __future__ import annotations

import json

from treespec.train.capture import CaptureConfig


def capture_data(tmp_path) -> str:
    """Ten questions and texts as ``d.jsonl`` under ``tmp_path`` (one too long for ``max_length=80``)."""
    lines = [json.dumps({"question": q, "answer": "He liked it a lot."}) for q in (
        "Tom had a ball.", "The sun was hot.", "Lily saw a dog.", "One day, a big dog ran.", "She saw a red ball.",
        "Once upon a time.", "Tom and Lily played.", "The dog ran to the park.")]
    lines.append(json.dumps({"text": "Once upon a time there was a little girl named Lily."}))
    lines.append(json.dumps({"question": "x" * 400, "answer": "too long"}))
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def capture_config(data, out, **kw) -> CaptureConfig:
    """A capture of ``data`` into ``out``: 10 new tokens, shards of 3, batches of 2, half sampled."""
    return CaptureConfig(data=data, out_dir=str(out), max_new_tokens=10, max_length=80, shard_size=3, batch_size=2,
                         sample_share=0.5, sample_temperature=0.9, seed=1, **kw)

