"""Drafts that honour a request's hard constraints.

A banned n-gram (``no_repeat_ngram_size``), a bad word, a suppressed token or a minimum length
sets some of the target's logits to -inf at a node: such a token is never the target's choice,
greedy or sampled, so a draft node that carries it is verified and always rejected. Drafters
know nothing of the options: a head trained on plain answers proposes what they ban, and prompt
lookup copies exactly the n-grams ``no_repeat_ngram_size`` forbids. :class:`DraftRules` reads a
request's transformers processors (the objects verification runs) and answers, for a node with
a given path, which tokens its children may not carry. Two places use it:

* builders mask those tokens out of the draft's log-probabilities before taking the top-k
  (:data:`treespec.builder.Constrain`), so the node's slot goes to the best allowed token;
* the engine prunes every drafted node that carries one, with its subtree, before verifying,
  whatever drafter made the tree (prompt lookup's grafts included).

A repetition penalty forbids nothing but moves the target's choice away from tokens already
seen, which drafts trained on plain answers keep proposing; builders apply it to the draft's
log-probabilities as well (``logp * penalty`` for each token of the node's sequence, the rule
transformers applies to a negative logit), an approximation of the target's processed
distribution that the measurement in docs/generation.md justifies.

Exactness does not depend on any of this (verification decides); it only steers drafts towards
tokens that can be accepted. Other soft options (a finite sequence bias, a length penalty) and
a user's own processors are not read: their cost in acceptance stays (docs/generation.md,
"What the options cost").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers.generation import logits_process as hf

from .tree import Tree

__all__ = ["DraftRules", "mask_banned", "draft_constrain"]

log = logging.getLogger(__name__)


@dataclass
class DraftRules:
    """What one request's options forbid after a sequence, for checking drafts.

    Attributes:
        sequence:  the request's prompt and output so far (the engine's own list, which it
                   extends as tokens are committed; read, never written).
        ngram:     ``no_repeat_ngram_size`` (0: none).
        always:    tokens never allowed (suppressed tokens, single-token bad words).
        words:     the prefix of each longer bad word -> the last tokens it bans.
        eos:       the EOS ids a minimum length bans.
        eos_below: EOS is banned while the sequence is shorter than this.
        begin:     ``(length, tokens)``: tokens banned when the sequence has exactly that length
                   (``begin_suppress_tokens``), or None.
        penalty:   ``repetition_penalty`` (1.0: none), for the builders' log-probabilities.
        penalty_from: the first position the penalty counts (``prompt_ignore_length``).
    """

    sequence: list[int]
    ngram: int = 0
    always: frozenset[int] = frozenset()
    words: dict[tuple[int, ...], set[int]] = field(default_factory=dict)
    eos: frozenset[int] = frozenset()
    eos_below: int = 0
    begin: tuple[int, frozenset[int]] | None = None
    penalty: float = 1.0
    penalty_from: int = 0
    _seen: set[int] = field(default_factory=set, repr=False)  # tokens of sequence[penalty_from:]
    _seen_ids: torch.Tensor | None = field(default=None, repr=False)
    _index: dict[tuple[int, ...], set[int]] = field(default_factory=dict, repr=False)  # (n-1)-gram -> next tokens
    _indexed: int = field(default=0, repr=False)  # tokens of ``sequence`` in _index

    @classmethod
    def from_processors(cls, processors: Sequence, sequence: list[int]) -> "DraftRules | None":
        """The hard constraints among transformers' ``processors`` (others are skipped), or None
        when there are none."""
        rules = cls(sequence)
        always, eos = set(), set()
        for p in processors:
            try:
                rules._read(p, always, eos)
            except (AttributeError, TypeError) as e:  # another transformers version's internals
                log.debug("draft rules skip %s: %s", type(p).__name__, e)
        rules.always, rules.eos = frozenset(always), frozenset(eos)
        return rules if rules.bans or rules.penalty != 1.0 else None

    @property
    def bans(self) -> bool:
        """Whether anything is ever banned (else only the penalty applies)."""
        return bool(self.ngram or self.always or self.words or self.eos_below or self.begin)

    def _read(self, p, always: set, eos: set) -> None:
        if isinstance(p, hf.NoRepeatNGramLogitsProcessor):
            self.ngram = int(p.ngram_size)
        elif isinstance(p, hf.SequenceBiasLogitsProcessor):  # NoBadWordsLogitsProcessor too
            bias = p.sequence_bias
            items = bias.items() if isinstance(bias, dict) else ((tuple(s), b) for s, b in bias)
            for seq, b in items:
                if b != float("-inf"):
                    continue
                if len(seq) == 1:
                    always.add(int(seq[0]))
                else:
                    self.words.setdefault(tuple(int(t) for t in seq[:-1]), set()).add(int(seq[-1]))
        elif isinstance(p, hf.MinLengthLogitsProcessor):
            self.eos_below = max(self.eos_below, int(p.min_length))
            eos.update(torch.as_tensor(p.eos_token_id).flatten().tolist())
        elif isinstance(p, hf.MinNewTokensLengthLogitsProcessor):
            self.eos_below = max(self.eos_below, int(p.prompt_length_to_skip) + int(p.min_new_tokens))
            eos.update(torch.as_tensor(p.eos_token_id).flatten().tolist())
        elif isinstance(p, hf.SuppressTokensLogitsProcessor):
            always.update(torch.as_tensor(p.suppress_tokens).flatten().tolist())
        elif isinstance(p, hf.SuppressTokensAtBeginLogitsProcessor):
            self.begin = (int(p.begin_index), frozenset(torch.as_tensor(p.begin_suppress_tokens).flatten().tolist()))
        elif isinstance(p, hf.RepetitionPenaltyLogitsProcessor):
            if p.prompt_ignore_length is None or isinstance(p.prompt_ignore_length, int):
                self.penalty, self.penalty_from = float(p.penalty), int(p.prompt_ignore_length or 0)
        # forced_eos_token_id acts at the last position, which the engine never drafts.

    def _sync(self) -> None:
        """Index the n-grams of tokens committed since the last call."""
        s, n = self.sequence, self.ngram
        if n:
            for i in range(max(self._indexed - n + 1, 0), len(s) - n + 1):
                self._index.setdefault(tuple(s[i : i + n - 1]), set()).add(s[i + n - 1])
        if self.penalty != 1.0:
            self._seen.update(s[max(self._indexed, self.penalty_from):])
        self._indexed = len(s)

    def seen_ids(self) -> torch.Tensor:
        """int64: the tokens the repetition penalty applies to after ``sequence``."""
        self._sync()
        if self._seen_ids is None or self._seen_ids.numel() != len(self._seen):
            self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.int64)
        return self._seen_ids

    def banned(self, path: Sequence[int], with_always: bool = True) -> set[int]:
        """The tokens the target cannot choose after ``sequence + path`` (``path``: a node's
        drafted tokens, root excluded), as transformers' processors decide it; without
        :attr:`always` when ``with_always`` is False."""
        self._sync()
        path = list(path)
        length = len(self.sequence) + len(path)
        out = set(self.always) if with_always else set()
        if length < self.eos_below:
            out |= self.eos
        if self.begin is not None and length == self.begin[0]:
            out |= self.begin[1]
        n = self.ngram
        if n and length + 1 >= n:
            # The last n-1 committed tokens (all of them when fewer) and the path.
            window = self.sequence[max(len(self.sequence) - (n - 1), 0):] + path
            key = tuple(window[len(window) - (n - 1):])
            out |= self._index.get(key, set())
            for i in range(len(window) - n + 1):  # the n-grams that hold a path token
                if tuple(window[i : i + n - 1]) == key:
                    out.add(window[i + n - 1])
        for prefix, last in self.words.items():
            m = len(prefix)
            if length >= m:
                tail = path[max(len(path) - m, 0):]
                head = self.sequence[len(self.sequence) - (m - len(tail)):] if m > len(tail) else []
                if tuple(head + tail) == prefix:
                    out |= last
        return out

    def prune(self, tree: Tree) -> Tree:
        """``tree`` without the drafted nodes whose token is banned after their parent's path
        (and without their subtrees); ``tree`` itself when none is."""
        if not self.bans:
            return tree
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        paths: list[list[int] | None] = [[]]
        banned: dict[int, set[int]] = {}
        for i in range(1, len(parents)):
            p = parents[i]
            if paths[p] is None:
                paths.append(None)
                continue
            if p not in banned:
                banned[p] = self.banned(paths[p])
            paths.append(None if tokens[i] in banned[p] else paths[p] + [tokens[i]])
        kept = [i for i in range(1, len(paths)) if paths[i] is not None]
        return tree if len(kept) == len(paths) - 1 else tree.subtree(kept)


def mask_banned(rules: Sequence[DraftRules | None], paths: torch.Tensor, logp: torch.Tensor,
                to_draft: torch.Tensor | None = None) -> torch.Tensor:
    """``logp`` with each node's banned next tokens at -inf and the repetition penalty applied
    to the tokens of its sequence, each row renormalised.

    Args:
        rules:    per batch row (None: nothing banned).
        paths:    int64 ``[B, k, d]``: each node's path in target ids (root excluded).
        logp:     float ``[B, k, V]``: the draft's log-probabilities of each node's next token.
        to_draft: int64 ``[V_target]``: a target id's draft id, -1 where the draft has none
                  (a head with a smaller vocabulary); None: the ids are the same.
    """
    B, k, V = logp.shape
    logp = _penalised(rules, paths, logp, to_draft)
    rows, cols = [], []
    path_lists = paths.tolist()
    for b, r in enumerate(rules):
        if r is None or not r.bans:
            continue
        always = list(r.always)
        for j in range(k):
            ban = r.banned(path_lists[b][j], with_always=False)
            ban.update(always)
            rows.extend([b * k + j] * len(ban))
            cols.extend(ban)
    if not rows:
        return logp if all(r is None or r.penalty == 1.0 for r in rules) else logp.log_softmax(-1)
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    if to_draft is not None:
        cols_t = to_draft[cols_t]
        rows_t, cols_t = rows_t[cols_t >= 0], cols_t[cols_t >= 0]
    flat = logp.reshape(B * k, V).index_put((rows_t.to(logp.device), cols_t.to(logp.device)),
                                            torch.tensor(float("-inf"), device=logp.device))
    # The draft's probability given what is allowed; a row with nothing left stays -inf.
    alive = torch.isfinite(flat).any(-1, keepdim=True)
    return torch.where(alive, flat.log_softmax(-1), flat).view(B, k, V)


def _penalised(rules: Sequence[DraftRules | None], paths: torch.Tensor, logp: torch.Tensor,
               to_draft: torch.Tensor | None) -> torch.Tensor:
    """``logp`` times each request's penalty at the tokens of each node's sequence (its
    history and its path), not renormalised."""
    B, k, V = logp.shape
    out = None
    for b, r in enumerate(rules):
        if r is None or r.penalty == 1.0:
            continue
        seen = seen_mask(r, paths[b], V, to_draft).to(logp.device)
        if out is None:
            out = logp.clone()
        out[b] = torch.where(seen, logp[b] * r.penalty, logp[b])
    return logp if out is None else out


def seen_mask(rule: DraftRules, paths: torch.Tensor, V: int, to_draft: torch.Tensor | None) -> torch.Tensor:
    """bool ``[k, V]``: the tokens the repetition penalty applies to after each of ``k`` paths
    (int64 ``[k, d]``, target ids): the rule's history and the path, in the draft's ids."""
    k = paths.shape[0]
    ids = torch.cat([rule.seen_ids()[None].expand(k, -1), paths.cpu()], dim=1)  # [k, n + d], target ids
    if to_draft is not None:
        ids = to_draft[ids]
    ids = torch.where(ids >= 0, ids, V)  # a token the draft lacks: a column past the end
    return torch.zeros(k, V + 1, dtype=torch.bool).scatter_(1, ids, True)[:, :V]


def draft_constrain(rules: Sequence[DraftRules | None] | None, to_target: Callable | None = None,
                    to_draft: torch.Tensor | None = None):
    """A builder's :data:`~treespec.builder.Constrain` for a batch with these ``rules`` (one per
    row), or None when no row has any; ``to_target`` maps the builder's ids to the target's."""
    if rules is None or all(r is None for r in rules):
        return None

    def constrain(depth: int, paths: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        if to_target is not None and paths.numel():
            paths = to_target(paths)
        return mask_banned(rules, paths, logp, to_draft)

    return constrain
