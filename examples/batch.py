"""A batch of prompts of different lengths: each request accepts its own number of tokens
per step and finishes on its own; the output equals HF generate, request by request.

    python examples/batch.py
"""

import treespec
from treespec.models import load

model, tok = load("smollm2-135m-instruct")
draft = treespec.load_draft("smollm2-135m-instruct-eagle", model)
questions = [
    "What is 15 + 27?",
    "Tom has 3 boxes with 12 apples each. He gives away 10 apples. How many are left?",
    "Write the numbers from 1 to 10 separated by commas.",
]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                   return_dict=False)
           for q in questions]
out = treespec.generate(model, draft, "chain-2", prompts, max_new_tokens=64)
for q, seq, r in zip(questions, out.sequences, out.metrics.requests):
    print(f"Q: {q}\nA: {tok.decode(seq, skip_special_tokens=True)}\n"
          f"   ({r.num_generated} tokens, mean accepted length {r.mean_accepted_length:.2f})\n")
