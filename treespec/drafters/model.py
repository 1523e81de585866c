"""An independent small causal LM as the drafter.

The draft model runs on treespec's runtime like the target: its own paged KV cache, the
same attention backends. Per step, for each request:

1. the tokens committed since the last step (accepted drafts and the bonus, or the first
   token after prefill) are run causally and committed to the draft cache; the last one
   is the root and its logits give the first tree level;
2. the tree grows level by level (dynamic EAGLE-2 or a static shape): each level's
   frontier is written to the draft cache after the committed prefix and sees the prefix
   plus its own ancestors;
3. the tree levels are dropped from the draft cache (``truncate``); only committed tokens
   stay.
"""

from __future__ import annotations

import torch

from ..builder import Frontier, build_trees
from ..mask import causal_mask
from ..runner import ModelRunner
from .base import DraftSession, DraftStart, Drafter, check_vocab

__all__ = ["ModelDrafter"]


class ModelDrafter(Drafter):
    """Draft with ``draft_model``, a transformers causal LM sharing the target's vocabulary."""

    def __init__(self, draft_model, attention_backend: str = "auto", page_size: int = 16):
        self.model = draft_model
        self.attention_backend = attention_backend
        self.page_size = page_size

    def modules(self):
        return (self.model,)

    def check_compatible(self, model) -> None:
        if self.model is model:
            raise ValueError("the draft model is the target model itself: use a smaller model")
        if self.model.config is model.config:
            raise ValueError(
                "draft and target share one config object: switching one's attention "
                "implementation would switch both; build them from separate configs"
            )
        check_vocab(
            self.model.get_output_embeddings().weight.shape[0],
            model.get_output_embeddings().weight.shape[0],
            f"the draft model {type(self.model).__name__}",
        )

    def prefix_key(self, model):
        p = next(self.model.parameters())
        return (self.model, "model", str(p.dtype), str(p.device))

    def start(self, model, ctx: DraftStart) -> "ModelDraftSession":
        return ModelDraftSession(self, ctx)

    def __repr__(self):
        return f"ModelDrafter({type(self.model).__name__}, {self.model.config.num_hidden_layers} layers)"


class ModelDraftSession(DraftSession):
    def __init__(self, drafter: ModelDrafter, ctx: DraftStart):
        self.runner = ModelRunner(drafter.model, drafter.attention_backend)
        self.cfg = ctx.tree_cfg
        self.stop = ctx.stop
        self.ctx = ctx
        room = ctx.tree_cfg.depth * ctx.tree_cfg.top_k + ctx.tree_cfg.num_nodes + 2
        longest = max(len(p) for p in ctx.prompts) + ctx.max_new_tokens + room
        self.cache, self.seq = self.runner.new_rows_cache(len(ctx.prompts), longest, drafter.page_size)
        self.pending = [[t] for t in ctx.first_tokens]  # committed, not yet in the draft cache
        hits = [0] * len(ctx.prompts)
        for r, hit in enumerate(ctx.prefix or []):
            if hit is not None:  # a prefix cache hit: the draft model's K/V of its tokens
                self.cache.load(self.seq[r], hit.rows["kv"])
                hits[r] = hit.length
        with self.runner.attached():
            self._run_causal(list(range(len(ctx.prompts))), [list(p[n:]) for p, n in zip(ctx.prompts, hits)],
                             logits=False)

    def _run_causal(self, requests, token_lists, logits=True):
        seqs = [self.seq[r] for r in requests]
        toks, pos, masks = [], [], []
        for s, t in zip(seqs, token_lists):
            L = self.cache.seq_lens[s]
            toks.append(torch.tensor(t, dtype=torch.int64))
            pos.append(torch.arange(L, L + len(t)))
            masks.append(causal_mask(len(t)))
        out = self.runner.forward(
            self.cache, seqs, toks, pos, masks, logits_rows=[[len(t) - 1] for t in token_lists]
        )
        for s, t in zip(seqs, token_lists):
            L = self.cache.seq_lens[s]
            self.cache.commit(s, torch.arange(L, L + len(t)))
        return torch.cat(out.logits) if logits else None  # [B, V]

    def propose(self, requests, roots, max_depth):
        requests = list(requests)
        with self.runner.attached():
            root_logits = self._run_causal(requests, [self.pending[r] for r in requests])
            for r in requests:
                self.pending[r] = []
            seqs = [self.seq[r] for r in requests]
            base = [self.cache.seq_lens[s] for s in seqs]  # the root sits at base - 1
            tree_pos = torch.zeros(0, dtype=torch.int64)  # RoPE positions of tree levels so far

            def step(f: Frontier):
                nonlocal tree_pos
                k = f.tokens.shape[1]
                pos = torch.full((k,), f.depth, dtype=torch.int64)
                out = self.runner.forward(
                    self.cache, seqs, list(f.tokens.cpu()), [b - 1 + pos for b in base],
                    list(f.ancestors.cpu()), extra_keys=[b - 1 + tree_pos for b in base],
                )
                tree_pos = torch.cat([tree_pos, pos])
                return torch.stack(out.logits).float().log_softmax(-1), None  # [B, k, V]

            trees = build_trees(
                torch.as_tensor(list(roots)), root_logits.float().log_softmax(-1), step, self.cfg, stop=self.stop,
                constrain=self.ctx.constrain_for(requests),
            )
            for s, b in zip(seqs, base):
                self.cache.truncate(s, b)  # drop the tree levels
        return trees

    def commit(self, requests, tokens, features):
        for r, t in zip(requests, tokens):
            self.pending[r].extend(t)

    def prefix_state(self, request, start):
        """Row t: the draft model's K/V at position t, every layer (tokens not yet run through
        the draft model, at most one step's, have none)."""
        s = self.seq[request]
        return {"kv": self.cache.read(s, start, self.cache.seq_lens[s])}

    def finish(self, request):
        self.cache.free_sequence(self.seq[request])
