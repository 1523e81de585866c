"""Training an EAGLE-3 head for SmolLM2-135M-Instruct on GSM8K train, then using it.

A short run (a few minutes on 2 CPU cores) to show the API; the shipped head was trained
with the command in docs/training.md. The training prompts (GSM8K train) ship with treespec;
the run goes to a temporary folder, removed at the end (give a folder of your own as
``out_dir`` to keep the head).

    python examples/train_head.py
"""

import tempfile
from pathlib import Path

import treespec
from treespec.data import dataset_path
from treespec.models import load
from treespec.train import TrainConfig, train_eagle

model, tok = load("smollm2-135m-instruct")
data = dataset_path("gsm8k-train")  # or any JSONL with question/answer fields
with tempfile.TemporaryDirectory(prefix="treespec-example-head-") as run_dir:
    cfg = TrainConfig(data=str(data), out_dir=run_dir, max_examples=64, regenerate=True,
                      regenerate_count=16, regen_max_new_tokens=96, epochs=1, batch_size=8)
    train_eagle(model, tok, cfg, callback=lambda p: print(p.stage, p.done, "/", p.total, end="\r"))
    draft = treespec.load_draft(Path(run_dir) / "head", model)

ids = tok.apply_chat_template([{"role": "user", "content": "What is 6 times 7?"}], add_generation_prompt=True,
                              return_dict=False)
out = treespec.generate(model, draft, "cpu-tiny", ids, max_new_tokens=48)
print("\n" + tok.decode(out.sequences[0], skip_special_tokens=True))
print("mean accepted length", round(out.metrics.mean_accepted_length, 2))
