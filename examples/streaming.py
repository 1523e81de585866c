"""Streaming: print text as each step commits it (several tokens per step when the draft is
right). Sampling at temperature 0.7 with a seed is reproducible and lossless.

    python examples/streaming.py
"""

import sys

import treespec
from treespec.models import load
from treespec.text import TextStream

model, tok = load("smollm2-135m-instruct")
draft = treespec.load_draft("smollm2-135m-instruct-eagle", model)
ids = tok.apply_chat_template([{"role": "user", "content": "Give three tips for learning to cook."}],
                              add_generation_prompt=True)
# TextStream decodes all ids so far each step, so a character split across tokens is
# written once it is whole, never as a replacement-character half.
text = TextStream(tok, sys.stdout)
for step in treespec.stream(model, draft, "chain-2", ids, max_new_tokens=128, temperature=0.7, seed=0):
    text.push(step.tokens[0])
text.push([], final=True)
m = step.metrics
print(f"\n[{m.num_generated} tokens, {m.num_steps} steps, mean accepted length {m.mean_accepted_length:.2f}]")
