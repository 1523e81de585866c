"""Training records: what the capture writes and the trainer reads, and the two ways of making them.

A **record** is one conversation, as :func:`record` builds it::

    {"tokens":     int64 [T]        prompt + answer ids,
     "features":   float16 [T-1, F] the target's features at every position but the last,
     "labels":     int64 [T]        labels[i]: the target's token after position i; -100 in the
                                    prompt and at the last position (nothing to predict there),
     "prompt_len": int}

``F`` is the hidden size times the number of feature ids (:func:`feature_ids`): the states
entering layers low/mid/high (EAGLE-3's fusion), the final post-norm state (id -1, EAGLE-1/2),
or both side by side. The sharded capture adds ``"sampled"``, ``"index"`` and ``"source"``.

Two ways to make them, both on a batch of conversations:

- :func:`teacher_forced_records`: given tokens, one forward of the target with hooks on the
  feature layers; labels are the target's greedy tokens, or the tokens themselves when they are
  the target's own answers being replayed.
- :func:`generated_records`: the target writes the answers through treespec's engine, with the
  features recorded on the way.

Layering: ``data`` -> ``records`` -> ``shards`` -> ``capture`` -> ``trainer``; this module imports
none of the last three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters.base import DraftSession, DraftStart, Drafter
from ..drafters.eagle import eagle3_feature_layers

__all__ = ["Progress", "feature_ids", "record", "teacher_forced_records", "generated_records", "FeatureHooks"]


@dataclass
class Progress:
    """What the capture and the trainer report to their caller (the CLI draws a progress bar
    from it): ``stage`` ("regenerate", "capture" or "train"), ``done`` of ``total`` units, and
    stage-specific ``info`` (``"tok/s"``, ``"loss"``, ...)."""

    stage: str
    done: int
    total: int
    info: dict


def feature_ids(model, features: str) -> tuple[int, ...]:
    """Which states a capture records: ``"eagle3"`` (the inputs of layers low/mid/high),
    ``"eagle1"`` (-1: the final post-norm state) or ``"both"`` (EAGLE-3's, then -1)."""
    e3 = tuple(eagle3_feature_layers(model.config.num_hidden_layers))
    return {"eagle3": e3, "eagle1": (-1,), "both": e3 + (-1,)}[features]


def record(tokens, feats: torch.Tensor, labels: torch.Tensor, prompt_len: int) -> dict:
    """One record (see the module docstring), features in fp16 and everything on the CPU."""
    return {"tokens": torch.tensor(tokens, dtype=torch.int64), "features": feats.to(torch.float16).cpu(),
            "labels": labels.cpu(), "prompt_len": prompt_len}


class FeatureHooks:
    """Collect the states entering given decoder layers (or, for id -1, leaving the final norm)."""

    def __init__(self, model, ids):
        self.ids, self.store, self.handles = ids, {i: [] for i in ids}, []
        dec = model.get_decoder()
        for i in dict.fromkeys(ids):  # one hook per layer: a small model may repeat one (2, 2, 2)
            if i == -1:
                self.handles.append(dec.norm.register_forward_hook(
                    lambda m, a, o, i=i: self.store[i].append(o.detach())))
            else:
                self.handles.append(dec.layers[i].register_forward_pre_hook(
                    lambda m, a, kw, i=i: self.store[i].append((a[0] if a else kw["hidden_states"]).detach()),
                    with_kwargs=True))

    def take(self) -> torch.Tensor:
        """``[B, T, F]`` with calls concatenated along time."""
        out = torch.cat([torch.cat(self.store[i], 1) for i in self.ids], -1)
        for i in self.store:
            self.store[i].clear()
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, T] int64, attention mask [B, T] int64)``, each row right-aligned (as decoding
    lays out a batch of prompts)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.int64)
    att = torch.zeros(len(seqs), T, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s)
        att[i, T - len(s):] = 1
    return ids, att


def positions(att: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token (left padding), as
    decoding numbers them: ``[B, T]`` from the mask ``[B, T]``."""
    return (att.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def teacher_forced_records(model, batch: list[tuple[list[int], int]], fids, pad: int, *,
                           labels: str = "greedy") -> list[dict]:
    """The records of ``batch`` (``(token ids, prompt length)`` each) from one forward of
    ``model`` on the left-padded batch, on the model's device.

    ``labels="greedy"``: the target's greedy token after each answer position (its logits are
    computed); a plain-text record (prompt length 0) is labelled everywhere. ``labels="tokens"``:
    the answer's own tokens, for answers the target wrote itself (only the decoder runs: its
    states, the final norm's included, are all that is needed).
    """
    if labels not in ("greedy", "tokens"):
        raise ValueError(f"labels must be 'greedy' or 'tokens', got {labels!r}")
    ids, att = left_pad([toks for toks, _ in batch], pad)
    dev = next(model.parameters()).device
    inputs = dict(input_ids=ids.to(dev), attention_mask=att.to(dev), position_ids=positions(att).to(dev),
                  use_cache=False)
    hooks = FeatureHooks(model, fids)
    try:
        if labels == "greedy":
            pred = model(**inputs).logits.argmax(-1)
        else:
            model.get_decoder()(**inputs)
        feats = hooks.take()
    finally:
        hooks.close()
    out = []
    for j, (toks, plen) in enumerate(batch):
        off = ids.shape[1] - len(toks)
        if labels == "greedy":
            lab = pred[j, off:].clone()
            lab[: max(plen - 1, 0)] = -100  # train on the reply (or on all of a plain text)
            lab[-1] = -100
        else:
            lab = torch.full((len(toks),), -100, dtype=torch.int64)
            lab[plen - 1: len(toks) - 1] = torch.tensor(toks[plen:])
        out.append(record(toks, feats[j, off: off + len(toks) - 1], lab, plen))
    return out


class _Recorder(Drafter):
    """Wraps a drafter and keeps the target features the engine hands it: prompt
    features at start, the accepted path's at each commit. Together they are the features
    of every position but the last, exactly what training needs."""

    def __init__(self, inner: Drafter, feature_ids):
        self.inner, self.feature_layers, self.sessions = inner, tuple(feature_ids), []

    def start(self, model, ctx: DraftStart):
        inner = self.inner.start(model, ctx)
        feats = [[f.to(torch.float16).cpu()] for f in ctx.features]
        rec = self

        class Session(DraftSession):
            def propose(self, requests, roots, max_depth):
                return inner.propose(requests, roots, max_depth)

            def commit(self, requests, tokens, features):
                for r, f in zip(requests, features):
                    feats[r].append(f.to(torch.float16).cpu())
                inner.commit(requests, tokens, None)

            def finish(self, request):
                inner.finish(request)

        rec.sessions.append(feats)
        return Session()


def generated_records(model, prompts, fids, max_new, eos, *, attention_backend: str = "torch",
                      temperature=0.0, seeds=None, options: dict | None = None, tokenizer=None) -> list[dict]:
    """Training records of the target's own replies to ``prompts``: generated in one batch
    through treespec's engine with the features of every position recorded on the way;
    the label after each position is the token the target wrote there. ``max_new``: one
    length limit for all, or one per prompt (the batch decodes to the largest and each reply
    is cut at its own: what decoding it with its own limit writes, whatever shares its batch).
    ``temperature``: one for all or one per prompt (0: greedy), ``seeds`` one per prompt.
    ``options``: GenerationConfig fields the target answers with (``tokenizer`` for ``stop_strings``)."""
    from ..drafters.none import NoDrafter
    from ..engine import generate

    # No speculation: a batch of requests on a CPU is compute-bound, where every drafted
    # token costs as much as a decoded one.
    rec = _Recorder(NoDrafter(), fids)
    sampled = any(t > 0 for t in temperature) if isinstance(temperature, (list, tuple)) else temperature > 0
    limits = [max_new] * len(prompts) if isinstance(max_new, int) else list(max_new)
    out = generate(model, rec, "chain-1", prompts, max_new_tokens=max(limits), eos_token_id=eos,
                   temperature=temperature, seed=list(seeds) if sampled else None,
                   attention_backend=attention_backend, tokenizer=tokenizer, **(options or {}))
    records = []
    for prompt, gen, f, limit in zip(prompts, out.sequences, rec.sessions[-1], limits):
        gen = list(gen)[:limit]
        toks = list(prompt) + gen
        feats = torch.cat(f)[: len(toks) - 1]
        labels = torch.full((len(toks),), -100, dtype=torch.int64)
        # labels[i] = the target's token after position i (= toks[i+1]).
        labels[len(prompt) - 1: len(toks) - 1] = torch.tensor(gen)
        records.append(record(toks, feats, labels, len(prompt)))
    return records
