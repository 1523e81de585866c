"""Generation options on trees: transformers' logits processors run at a node with that
node's own history, from a generation config resolved as ``model.generate`` resolves it.

**Per-node processing.** A repetition penalty, a banned n-gram, a minimum length or a user's
own processor is a function of ``(input_ids, scores)``: the sequence so far and the next
token's logits. At a tree node the sequence so far is the committed history followed by the
node's path, so each node is processed with exactly the ``input_ids`` plain decoding would
have had there. Verification walks the tree from the root and processes only the nodes it
reaches (:meth:`treespec.accept.RequestDecoding.choose_reached_nodes`: the accepted path); for
every node's scores (``output_scores``) each processor runs once per depth on a
``[nodes at that depth, L + depth]`` batch (nodes of one depth have histories of one length).
The processors are transformers' own (top-p in a form that gives its output without sorting:
:class:`SortFreeTopP`), built by the model's ``_get_logits_processor`` from a
``GenerationConfig``, so the semantics are those of ``model.generate`` by construction. What
the target chooses from the processed scores, and which drafted nodes that accepts, is
``treespec/accept.py``'s.

Letters: n tree nodes (root included), L committed tokens, V vocabulary.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList, TopPLogitsWarper

from .tree import Tree

__all__ = ["NodeProcessor", "SortFreeTopP", "path_tokens", "resolve_generation_config", "exact_generation_config",
           "check_generation_config", "row_config", "UNSUPPORTED"]

# GenerationConfig fields that cannot be exact on trees, with the reason a user is told.
UNSUPPORTED = {
    "num_beams": "beam search keeps several sequences per request; speculation verifies one",
    "num_return_sequences": "one sequence per request: repeat the prompt in the batch instead",
    "guidance_scale": "classifier-free guidance runs a second, unconditional forward at every token",
    "penalty_alpha": "contrastive search re-ranks candidates with the model's hidden states",
    "dola_layers": "DoLa contrasts layers of the target at every token",
    "diversity_penalty": "group beam search",
    "watermarking_config": "a watermark's state is kept across steps by its own processor",
    "encoder_repetition_penalty": "decoder-only models have no encoder input",
    "encoder_no_repeat_ngram_size": "decoder-only models have no encoder input",
    "forced_bos_token_id": "the first token is the prompt's; a forced BOS applies to encoder-decoder models",
    "token_healing": "token healing rewrites the prompt's last tokens before decoding: heal the prompt first",
    "force_words_ids": "forced words need constrained beam search",
    "constraints": "constraints need constrained beam search",
    "assistant_early_exit": "early-exit self-speculation is another draft: pass treespec's draft instead",
    "speculation_type": "treespec is the speculation: pass the draft to treespec.generate",
    "assistant_model": "treespec is the assisted generation: pass the draft to treespec.generate",
    "prompt_lookup_num_tokens": "treespec has its own prompt lookup: draft='ngram' or '<head>+lookup'",
    "output_logits": "treespec returns the processed scores (output_scores=True), not the raw logits",
    "output_attentions": "the tree forward's attention weights are not kept",
    "output_hidden_states": "the tree forward's hidden states are not kept (a drafter reads its own features)",
}

# Options of other engines' APIs (vLLM, OpenAI) that users carry over, with what to use here.
ELSEWHERE = {
    "logit_bias": "use sequence_bias={(token_id,): bias, ...}",
    "frequency_penalty": "transformers has repetition_penalty (a multiplicative penalty on tokens seen)",
    "presence_penalty": "transformers has repetition_penalty (a multiplicative penalty on tokens seen)",
    "stop": "use stop_strings=[...] (with tokenizer=) or eos_token_id",
}


def resolve_generation_config(model, generation_config: GenerationConfig | None, **kwargs) -> GenerationConfig:
    """The config ``model.generate(generation_config=..., **kwargs)`` would decode with: the
    model's own generation config and transformers' defaults under what is given.

    Raises ValueError naming any option that cannot be exact on trees (``UNSUPPORTED``).
    """
    cfg, unused = model._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    if unused:
        raise ValueError(f"unknown generation options {sorted(unused)}: not fields of transformers' GenerationConfig")
    return check_generation_config(model, cfg)


def exact_generation_config(model, **fields) -> GenerationConfig:
    """A config of exactly ``fields``: nothing from the model's generation config or
    transformers' defaults (no implicit ``top_k=50``). Raises TypeError on a name that is not a
    GenerationConfig field, ValueError on an option ``UNSUPPORTED`` names."""
    for name, instead in ELSEWHERE.items():
        if name in fields:
            raise ValueError(f"{name} is another library's option, not transformers': {instead}")
    known = GenerationConfig().to_dict()
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}: not an option of treespec.generate "
                        f"nor a field of transformers' GenerationConfig")
    return check_generation_config(model, GenerationConfig(**fields))


def row_config(config: GenerationConfig, prompt_len: int, max_new: int) -> GenerationConfig:
    """``config`` for one request decoded as its prompt alone, its lengths set as ``generate``
    sets them: ``max_length`` the prompt and the budget (where ``forced_eos_token_id`` forces
    EOS), and ``min_length`` from ``min_new_tokens``, which takes precedence over it."""
    c = copy.copy(config)
    c.max_length = prompt_len + max_new
    if c.min_new_tokens is not None:
        c.min_length = prompt_len + c.min_new_tokens
    return c


def check_generation_config(model, cfg: GenerationConfig) -> GenerationConfig:
    """``cfg`` checked as ``generate`` checks it, refusing what ``UNSUPPORTED`` names, with the
    EOS and pad tensors its processors read set."""
    cfg.validate()  # what generate checks first: contradictory options raise transformers' own error
    defaults = model.generation_config._get_default_generation_params()
    for name, why in UNSUPPORTED.items():
        value = getattr(cfg, name, None)
        if value not in (None, False) and value != defaults.get(name):
            raise ValueError(f"{name}={value!r} cannot run under speculation: {why}")
    # Sets the EOS/pad tensors the processors read (min_new_tokens bans EOS, for one).
    model._prepare_special_tokens(cfg, kwargs_has_attention_mask=True, device=next(model.parameters()).device)
    return cfg


def path_tokens(tree: Tree, nodes: torch.Tensor, depth: int) -> torch.Tensor:
    """int64 ``[len(nodes), depth]``: the drafted tokens on the path to each node (root
    excluded, the node included), for nodes all at ``depth``."""
    if depth == 0:
        return torch.empty(len(nodes), 0, dtype=torch.int64)
    anc = tree.attention_mask()[nodes][:, 1:]  # [k, n-1] ancestors-or-self, root dropped
    # Parents precede children, so each row's ancestors in index order are its path in order.
    return tree.tokens[1:].expand(len(nodes), -1)[anc].view(len(nodes), depth)


@dataclass
class NodeProcessor:
    """One request's logits processors, applied at tree nodes.

    Attributes:
        processors: transformers' ``LogitsProcessorList`` for this request (its prompt
                    length fixes where ``min_new_tokens`` and the like count from).
    """

    processors: LogitsProcessorList

    @classmethod
    def build(cls, model, config: GenerationConfig, prompt_len: int,
              user: LogitsProcessorList | None = None) -> "NodeProcessor":
        procs = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt_len, encoder_input_ids=None,
            prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(user or []),
            device=str(next(model.parameters()).device), model_kwargs={})
        return cls.of(procs)

    @classmethod
    def of(cls, procs) -> "NodeProcessor":
        """Over a list of transformers processors as they are, but top-p in its form that gives
        the same output without sorting each row where the cut is clear."""
        return cls(LogitsProcessorList(SortFreeTopP.of(p) if type(p) is TopPLogitsWarper else p for p in procs))

    def __bool__(self) -> bool:
        return len(self.processors) > 0

    def __call__(self, history: torch.Tensor, logits: torch.Tensor, tree: Tree | None = None) -> torch.Tensor:
        """float32 ``[n, V]``: each node's logits processed with its own history.

        Args:
            history: int64 ``[L]``, the committed tokens, the root last.
            logits:  ``[n, V]``, the target's logits at each node (one row, the root, without a tree).
            tree:    the verified tree (None: ``logits`` is the root's alone).
        """
        scores = logits.float()
        if not self.processors:
            return scores
        if tree is None:
            return self.processors(history[None].to(scores.device), scores)
        out = torch.empty_like(scores)
        depth = tree.depth
        for d in range(int(depth.max()) + 1):
            nodes = torch.nonzero(depth == d).flatten()
            ids = torch.cat([history.expand(len(nodes), -1), path_tokens(tree, nodes, d)], dim=1)
            out[nodes] = self.processors(ids.to(scores.device), scores[nodes])
        return out


class SortFreeTopP(TopPLogitsWarper):
    """transformers' ``TopPLogitsWarper``, output for output, mostly without sorting the vocabulary.

    transformers sorts every row (milliseconds for a 49k vocabulary on a CPU, once per
    processed node) to drop the tokens whose cumulative probability from the least probable
    up is at most ``1 - top_p``: exactly the tokens with at least ``top_p`` of the mass above
    them. Here the mass above each of the ``K`` most probable tokens comes from a top-k in
    float64, and the row's cut is used when it is clear of rounding: the last kept token has
    less than ``top_p`` above it and the first dropped one at least ``top_p``, each by more than
    transformers' float32 softmax and cumulative sum can move a cumulative probability ``c``
    (``3 V u c + 1e-5``, u = 2^-24: the worst case of summing V terms, any order; the constant
    covers each term's own rounding, in ``x - max`` up to about 104 u, and in the exponential), no tie across the cut, the cut inside the ``K`` and
    ``min_tokens_to_keep`` no more than it keeps. Any other row goes through transformers' own
    code; the lower the temperature, the more rows are clear.
    """

    K = 256

    @classmethod
    def of(cls, warper: TopPLogitsWarper) -> "SortFreeTopP":
        return cls(warper.top_p, warper.filter_value, warper.min_tokens_to_keep)

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        if scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[-1] <= 1:
            return super().__call__(input_ids, scores)
        V = scores.shape[-1]
        k = min(self.K, V)
        top, idx = scores.double().softmax(-1).topk(k, dim=-1)  # most probable first
        above = top.cumsum(-1) - top  # the mass above each of them
        kept = (above < self.top_p).sum(-1)  # a prefix: ``above`` grows along the row
        last, first = (kept - 1).clamp(0, k - 1)[:, None], kept.clamp(max=k - 1)[:, None]
        a_last, a_first = above.gather(1, last)[:, 0], above.gather(1, first)[:, 0]
        slack = 3 * V * 2.0 ** -24
        clear = ((kept < k) & (kept >= self.min_tokens_to_keep)
                 & (self.top_p - a_last > slack * (1 - a_last) + 1e-5)
                 & (a_first - self.top_p > slack * (1 - a_first) + 1e-5)
                 & (top.gather(1, last)[:, 0] != top.gather(1, first)[:, 0]))  # NaN rows: not clear
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(
            1, idx, torch.arange(k, device=scores.device)[None] < kept[:, None])
        out = scores.masked_fill(~keep, self.filter_value)
        if not bool(clear.all()):
            rows = ~clear
            ids = input_ids[rows.to(input_ids.device)] if input_ids is not None else None
            out[rows] = super().__call__(ids, scores[rows])
        return out
