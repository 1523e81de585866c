"""What the target alone produces, by Hugging Face's own ``generate``: the reference a
speculative run must equal token for token."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt: list[int], n: int, **kw) -> list[int]:
    """The ``n`` tokens ``model.generate`` decodes greedily after ``prompt`` (token ids) alone,
    on the model's device; ``kw`` are further ``generate`` options."""
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def hf_greedy_text(model, tokenizer, prompt: str | list[int], n: int) -> str:
    """:func:`hf_greedy` as text, after a text prompt (encoded as is: no chat template) or token ids."""
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    return tokenizer.decode(hf_greedy(model, ids, n), skip_special_tokens=True)
