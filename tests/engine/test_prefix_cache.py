"""Prefix caching (issue 28): a PrefixCache changes what is computed, never what is generated.

- Outputs with the cache equal outputs without it (greedy, and sampled with a seed) for an
  EAGLE-3 head, an EAGLE-1 head that drafts well (multi-token commits), a draft model, prompt
  lookup and a head with lookup grafted on: hypothesis over page sizes, hit lengths from 0 to
  the whole prompt, partial pages, prompts that run into an earlier answer, budgets that evict,
  batch rows sharing prefixes. Hits are checked to happen (their lengths are predicted).
- No acceptance lost: the EAGLE head's trees after a hit are the trees without the cache, and
  a deliberately wrong coupling (the head's rows shifted by one) changes them.
- The store: LRU eviction of unheld leaves in literal cases, the budget, and accounting that
  balances after many random requests, abandoned streams and errors mid-generation.
- Errors: another model, dtype or page size; bad arguments.

Targets are tiny (V = 64); fp32, one thread.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.pairs import KINDS, pair
from helpers.tiny import tiny_model
from treespec import PrefixCache
from treespec.drafters import Drafter, RecordingDrafter
from treespec.prefix_cache import PrefixUse
from treespec.runner import ModelRunner

V = 64
SETTINGS = dict(deadline=None, derandomize=True,  # fixed examples: a float near-tie cannot make a flaky run
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Random heads and draft models rarely draft right; that is not what these tests are about.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:the model accepted none")]


def token_bytes(model) -> int:
    """Bytes of the target's K/V per token (fp32 cache)."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_balanced(cache: PrefixCache):
    cache.check()
    stats = cache.stats()
    assert stats["pages_in_use"] == 0 and stats["bytes"] <= stats["max_bytes"], stats


# generate has no page_size argument: stream does (generate's is 16). Through stream, tests
# choose the page size.
def generate(model, drafter, prompts, cache=None, page_size=16, **kw):
    seqs, scores, metrics = [[] for _ in prompts], [[] for _ in prompts], None
    for out in treespec.stream(model, drafter, "cpu", prompts, page_size=page_size, attention_backend="torch",
                               prefix_cache=cache, **kw):
        for s, t in zip(seqs, out.tokens):
            s.extend(t)
        for s, x in zip(scores, out.scores or []):
            s.append(x)
        metrics = out.metrics
    return treespec.GenerateOutput(seqs, metrics, [torch.cat(x) for x in scores] if any(scores) else None)


def assert_same_scores(got, want):
    """The logits every token was chosen from agree: a cached K/V off by anything shows here
    long before it moves an argmax of these peaked models."""
    for a, b in zip(got.scores, want.scores):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-3), (a - b).abs().max()


def _trees(rec: RecordingDrafter):
    return [[(t.parents.tolist(), t.tokens.tolist(), t.scores) for t in trees] for trees, _ in rec.trees]


def _same_trees(a, b) -> bool:
    if len(a) != len(b):
        return False
    for step_a, step_b in zip(a, b):
        for (pa, ta, sa), (pb, tb, sb) in zip(step_a, step_b):
            if pa != pb or ta != tb or not torch.allclose(sa, sb, atol=1e-4):
                return False
    return True


# ---- outputs are the same --------------------------------------------------------------------


@st.composite
def scenarios(draw):
    base = draw(st.lists(st.integers(0, V - 1), min_size=3, max_size=28))
    rows = draw(st.integers(1, 3))
    return dict(
        page_size=draw(st.sampled_from([1, 2, 3, 4, 8])),
        base=base,
        chat=draw(st.booleans()),  # the second prompts run into the first call's answer
        cuts=draw(st.lists(st.floats(0, 1), min_size=rows, max_size=rows)),
        tails=draw(st.lists(st.lists(st.integers(0, V - 1), max_size=5), min_size=rows, max_size=rows)),
        budget_tokens=draw(st.sampled_from([1, 6, 20, 10_000, 10_000, 10_000])),  # 1: nothing fits; 6, 20 evict
        max_new=(draw(st.integers(1, 8)), draw(st.integers(1, 8))),
        sampled=draw(st.booleans()),
    )


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, **SETTINGS)
@given(sc=scenarios())
def test_outputs_with_the_cache_are_the_outputs_without(kind, sc):
    model, drafter = pair(kind)
    P = sc["page_size"]
    cache = PrefixCache(max_bytes=sc["budget_tokens"] * token_bytes(model))
    kw = dict(temperature=1.0, seed=7) if sc["sampled"] else {}
    first = generate(model, drafter, sc["base"], cache, P, max_new_tokens=sc["max_new"][0], **kw)
    assert_balanced(cache)
    assert first.sequences == generate(model, drafter, sc["base"], max_new_tokens=sc["max_new"][0], **kw).sequences
    seen = sc["base"] + first.sequences[0]
    source = seen if sc["chat"] else sc["base"]
    prompts = [(source[: round(c * len(source))] + t) or source[:1] for c, t in zip(sc["cuts"], sc["tails"])]
    rec_got, rec_want = RecordingDrafter(drafter), RecordingDrafter(drafter)
    got = generate(model, rec_got, prompts, cache, P, max_new_tokens=sc["max_new"][1], output_scores=True, **kw)
    want = generate(model, rec_want, prompts, max_new_tokens=sc["max_new"][1], output_scores=True, **kw)
    assert got.sequences == want.sequences
    assert_same_scores(got, want)
    assert _same_trees(_trees(rec_got), _trees(rec_want))  # the drafter drafts as it would without the cache
    assert_balanced(cache)
    hits = [r.hit_tokens for r in got.metrics.requests]
    assert all(h % P == 0 and h < len(p) for h, p in zip(hits, prompts))
    if sc["budget_tokens"] == 10_000:  # nothing evicted: the hit is what the first call filed
        committed = seen[:-1]  # the last token's K/V are never computed
        expect = [min(lcp(p, committed), len(p) - 1) // P * P for p in prompts]
        if kind == "model":  # the draft model's own K/V may lag a step behind: its hit can be shorter
            assert all(h <= e for h, e in zip(hits, expect)) and (sum(expect) == 0 or sum(hits) > 0)
        else:
            assert hits == expect


@pytest.mark.parametrize("kind", ("ngram", "model", "eagle3"))
def test_sampled_outputs_with_a_seed_are_the_same(kind):
    """On softer targets (sampling really samples), one seed gives the same tokens with a warm
    cache, a cold one and none."""
    model, drafter = pair(kind, peak=3.0)
    rng = random.Random(1)
    system = [rng.randrange(V) for _ in range(21)]
    prompts = [system + [rng.randrange(V) for _ in range(n)] for n in (2, 5, 9)]
    cache = PrefixCache(max_bytes=10**8)
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=20, seed=[3, 4, 5])
    cold = generate(model, drafter, prompts, cache, 4, **kw)
    warm = generate(model, drafter, prompts, cache, 4, **kw)
    none = generate(model, drafter, prompts, **kw)
    assert cold.sequences == warm.sequences == none.sequences
    assert [r.hit_tokens for r in cold.metrics.requests] == [0, 0, 0]
    assert all(r.hit_tokens >= 20 for r in warm.metrics.requests)
    greedy = generate(model, drafter, prompts, max_new_tokens=12)
    assert greedy.sequences != none.sequences  # the sampled run did sample


# ---- no acceptance lost ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ("eagle3", "eagle1"))
@pytest.mark.parametrize("page_size", (1, 4, 5))
def test_the_heads_trees_after_a_hit_are_the_trees_without_the_cache(kind, page_size):
    model, head = pair(kind)
    rng = random.Random(page_size)
    system = [rng.randrange(V) for _ in range(22)]
    prompts = [system + [5, 9], system[:13] + [1, 2, 3], system]
    cache = PrefixCache(max_bytes=10**8)
    generate(model, head, [system + [7]], cache, page_size, max_new_tokens=6)
    rec_hit, rec_none = RecordingDrafter(head), RecordingDrafter(head)
    got = generate(model, rec_hit, prompts, cache, page_size, max_new_tokens=10)
    want = generate(model, rec_none, prompts, max_new_tokens=10)
    assert got.sequences == want.sequences
    assert [r.hit_tokens for r in got.metrics.requests] == [
        min(lcp(p, system + [7]), len(p) - 1) // page_size * page_size for p in prompts]
    assert _same_trees(_trees(rec_hit), _trees(rec_none))  # every step's, the first after the hit included
    if kind == "eagle1":  # the informed head drafts right: acceptance is there to lose
        assert want.metrics.mean_accepted_length > 1.5
        assert got.metrics.mean_accepted_length == want.metrics.mean_accepted_length


def test_a_wrong_coupling_changes_the_trees(monkeypatch):
    """The check above has teeth: reading the head's rows one position off (entry i paired
    with token i instead of i+1) keeps the output exact but changes what the head drafts."""
    model, head = pair("eagle3")
    rng = random.Random(0)
    system = [rng.randrange(V) for _ in range(22)]
    cache = PrefixCache(max_bytes=10**8)
    generate(model, head, [system], cache, 4, max_new_tokens=4)
    real = PrefixUse.draft_prefixes

    def shifted(self):
        out = real(self)
        for p in out or []:
            if p is not None:
                p.rows["kv"] = torch.roll(p.rows["kv"], 1, dims=0)
        return out

    monkeypatch.setattr(PrefixUse, "draft_prefixes", shifted)
    rec_hit, rec_none = RecordingDrafter(head), RecordingDrafter(head)
    got = generate(model, rec_hit, [system + [3]], cache, 4, max_new_tokens=6)
    want = generate(model, rec_none, [system + [3]], max_new_tokens=6)
    assert got.metrics.requests[0].hit_tokens == 20
    assert got.sequences == want.sequences  # lossless whatever the draft
    assert not _same_trees(_trees(rec_hit)[:1], _trees(rec_none)[:1])


# ---- drafters that keep no state, or cannot use it ------------------------------------------


def test_drafters_share_the_targets_pages_and_file_their_own_state():
    """Pages filed with prompt lookup (no drafter state) serve prompt lookup at once, and an
    EAGLE head only once it has filed its own rows; a head's pages then serve lookup too."""
    model, head = pair("eagle3")
    rng = random.Random(2)
    system = [rng.randrange(V) for _ in range(18)]
    cache = PrefixCache(max_bytes=10**8)
    hits = lambda out: [r.hit_tokens for r in out.metrics.requests]  # noqa: E731
    for drafter, want in (("ngram", [0]), ("ngram", [16]), (head, [0]), (head, [16]), ("ngram", [16])):
        out = generate(model, drafter, [system + [1]], cache, 4, max_new_tokens=3)
        assert hits(out) == want, drafter
        assert out.sequences == generate(model, drafter, [system + [1]], max_new_tokens=3).sequences
        assert_balanced(cache)


class _NoKey(Drafter):
    """An EAGLE head behind a drafter that knows nothing of prefix caching (no prefix_key)."""

    def __init__(self, inner):
        self.inner = inner

    def features_for(self, model):
        return self.inner.features_for(model)

    def start(self, model, ctx):
        return self.inner.start(model, ctx)


def test_a_feature_reading_drafter_without_a_key_gets_no_hits_and_a_warning():
    model, head = pair("eagle3")
    prompt = list(range(1, 20))
    cache = PrefixCache(max_bytes=10**8)
    generate(model, "ngram", [prompt], cache, 4, max_new_tokens=3)  # the target's pages are there
    with pytest.warns(treespec.TreespecWarning, match="serves no hits with _NoKey"):
        out = generate(model, _NoKey(head), [prompt], cache, 4, max_new_tokens=6)
    assert out.metrics.requests[0].hit_tokens == 0
    assert out.sequences == generate(model, head, [prompt], max_new_tokens=6).sequences
    assert_balanced(cache)


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics_count_hits_prefill_tokens_and_time_to_first_token():
    model, drafter = pair("ngram")
    prompt = list(range(3, 33))  # 30 tokens
    cache = PrefixCache(max_bytes=10**8)
    cold = generate(model, drafter, [prompt, prompt[:10]], cache, 8, max_new_tokens=4)
    warm = generate(model, drafter, [prompt, prompt[:10]], cache, 8, max_new_tokens=4)
    r = warm.metrics.requests
    assert [(x.prompt_tokens, x.hit_tokens, x.prefill_tokens) for x in r] == [(30, 24, 6), (10, 8, 2)]
    assert [(x.hit_tokens, x.prefill_tokens) for x in cold.metrics.requests] == [(0, 30), (0, 10)]
    assert warm.metrics.hit_tokens == 32 and warm.metrics.prefill_tokens == 8
    assert warm.metrics.summary()["hit_tokens"] == 32 and warm.metrics.summary()["prefill_tokens"] == 8
    assert 0 < r[0].first_token_seconds == r[1].first_token_seconds <= warm.metrics.total_seconds
    assert cache.stats()["hit_tokens"] == 32 and cache.stats()["lookups"] == 4


# ---- the store -------------------------------------------------------------------------------


class _Model:
    """Something to bind a bare cache to (only its identity counts)."""


def _bare(pages: int, P: int = 2) -> tuple[PrefixCache, int]:
    page = torch.zeros(P, 2, 1, 1, 1)  # [P, 2, layers, Hkv, D]
    size = page.numel() * page.element_size()
    cache = PrefixCache(max_bytes=pages * size)
    cache.bind(_Model(), P, {})
    return cache, size


def _file(cache, tokens, path=()):
    """File ``tokens``; position p's K/V hold the number p."""
    return cache.insert(tokens, list(path), lambda a, e: torch.arange(a, e).float().view(-1, 1, 1, 1, 1).expand(
        -1, 2, 1, 1, 1))


def _pages(cache) -> set:
    """Every cached prefix, as a tuple of its tokens."""
    out, stack = set(), [((), cache._root)]
    while stack:
        prefix, node = stack.pop()
        for key, child in node.children.items():
            out.add(prefix + key)
            stack.append((prefix + key, child))
    return out


def test_eviction_drops_the_least_recently_used_unheld_leaf():
    cache, size = _bare(pages=3)
    assert _file(cache, [1, 2, 3, 4]) == 2 and _file(cache, [5, 6, 7]) == 1  # a partial page is not filed
    assert _pages(cache) == {(1, 2), (1, 2, 3, 4), (5, 6)}
    cache.release(cache.match([1, 2, 3, 4, 9], 5, None))  # [1 2][3 4] used last
    assert _file(cache, [7, 8]) == 1  # evicts [5 6], the least recently used leaf
    assert _pages(cache) == {(1, 2), (1, 2, 3, 4), (7, 8)}
    held = cache.match([1, 2, 3, 4], 4, None)
    assert [n.tokens for n in held] == [(1, 2), (3, 4)]
    # [9 10][11 12] needs two pages: [7 8] goes, then only held pages are left: one is filed.
    assert _file(cache, [9, 10, 11, 12]) == 1
    assert _pages(cache) == {(1, 2), (1, 2, 3, 4), (9, 10)}
    assert cache.stats()["evicted_pages"] == 2 and cache.bytes == 3 * size
    cache.release(held)
    assert_balanced(cache)
    # Extending a held path files below it; each page's K/V are its own positions'.
    path = cache.match([1, 2, 3, 4, 5, 6], 6, None)
    assert _file(cache, [1, 2, 3, 4, 5, 6], path) == 1
    cache.release(path)
    node = cache.match([1, 2, 3, 4, 5, 6], 6, None)
    assert [float(n.kv[0, 0, 0, 0, 0]) for n in node] == [0.0, 2.0, 4.0]
    cache.release(node)
    assert_balanced(cache)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(node)


def test_a_page_larger_than_the_budget_is_not_filed():
    cache, _ = _bare(pages=1, P=2)
    assert _file(cache, [1, 2, 3, 4]) == 1 and cache.num_pages == 1
    cache, _ = _bare(pages=1, P=2)
    cache.max_bytes -= 1
    assert _file(cache, [1, 2]) == 0 and cache.bytes == 0


def test_accounting_balances_after_many_requests_aborted_streams_and_errors(monkeypatch):
    """Random requests over a few shared system prompts, with a budget of a few pages: after
    every call the cache fits its budget, holds no page, and counts what it holds; streams
    closed early and an error mid-generation let go of their pages too."""
    model, drafter = pair("eagle3")
    rng = random.Random(0)
    systems = [[rng.randrange(V) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    cache = PrefixCache(max_bytes=30 * token_bytes(model))
    hits = 0
    for i in range(24):
        prompts = [rng.choice(systems)[: rng.randrange(1, 21)] + [rng.randrange(V) for _ in range(rng.randrange(4))]
                   for _ in range(rng.randrange(1, 4))]
        draft = rng.choice([drafter, "ngram", "none"])
        steps = treespec.stream(model, draft, "cpu", prompts, max_new_tokens=rng.randrange(1, 7), page_size=4,
                                attention_backend="torch", prefix_cache=cache)
        if i % 5 == 4:  # abandoned after the first step
            out = next(steps)
            hit = sum(r.hit_tokens for r in out.metrics.requests)
            hits += hit
            assert (cache.stats()["pages_in_use"] > 0) == (hit > 0)  # held while the stream runs
            steps.close()
        else:
            for out in steps:
                pass
            hits += sum(r.hit_tokens for r in out.metrics.requests)
        assert_balanced(cache)
    assert hits > 0 and cache.stats()["evicted_pages"] > 0 and cache.stats()["hit_tokens"] == hits

    calls = {"n": 0}
    real = ModelRunner.forward

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(self, *a, **k)

    monkeypatch.setattr(ModelRunner, "forward", failing)
    with pytest.raises(RuntimeError, match="injected"):
        generate(model, "ngram", [systems[0] + [1]], cache, 4, max_new_tokens=5)
    assert_balanced(cache)


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1GB", None])
def test_the_budget_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        PrefixCache(max_bytes=bad)


def test_a_cache_serves_one_model_page_size_and_dtype():
    model, _ = pair("ngram")
    other = tiny_model("llama", 5)  # same shapes, other weights: its K/V would be silently wrong
    cache = PrefixCache(max_bytes=10**7)
    generate(model, "ngram", [list(range(10))], cache, 4, max_new_tokens=2)
    with pytest.raises(ValueError, match="another model"):
        generate(other, "ngram", [list(range(10))], cache, 4, max_new_tokens=2)
    with pytest.raises(ValueError, match="pages of 4 tokens and this call's page_size is 8"):
        generate(model, "ngram", [list(range(10))], cache, 8, max_new_tokens=2)
    with pytest.raises(ValueError, match="must be a treespec.PrefixCache"):
        generate(model, "ngram", [list(range(10))], {"max_bytes": 1}, 4, max_new_tokens=2)
    cast = tiny_model("llama", 5)
    cache2 = PrefixCache(max_bytes=10**7)
    generate(cast, "ngram", [list(range(10))], cache2, 4, max_new_tokens=2)
    cast.to(torch.float64)
    with pytest.raises(ValueError, match="changed since this PrefixCache was filled.*float64"):
        generate(cast, "ngram", [list(range(10))], cache2, 4, max_new_tokens=2)
    cache2.clear()  # emptied and unbound: serves the float64 model now
    generate(cast, "ngram", [list(range(10))], cache2, 4, max_new_tokens=2)
    assert cache2.num_pages == 2 and cache2.stats()["lookups"] == 1


def test_clear_is_refused_while_a_stream_holds_pages():
    model, _ = pair("ngram")
    cache = PrefixCache(max_bytes=10**7)
    generate(model, "ngram", [list(range(12))], cache, 4, max_new_tokens=2)
    steps = treespec.stream(model, "ngram", "cpu", [list(range(12))], max_new_tokens=4, page_size=4,
                            prefix_cache=cache)
    next(steps)
    with pytest.raises(RuntimeError, match="in use by a running generation"):
        cache.clear()
    steps.close()
    cache.clear()
    assert cache.num_pages == 0 and cache.bytes == 0


def test_a_cache_whose_model_is_gone_serves_the_next():
    import gc

    cache = PrefixCache(max_bytes=10**7)
    gone = tiny_model("llama", 6)
    generate(gone, "ngram", [list(range(10))], cache, 4, max_new_tokens=2)
    del gone
    gc.collect()
    model = tiny_model("llama", 7)
    out = generate(model, "ngram", [list(range(10))], cache, 4, max_new_tokens=2)
    assert out.metrics.requests[0].hit_tokens == 0 and cache.num_pages == 2  # nothing of the old model's served


def test_kv_read_and_load_round_trip():
    from treespec.kv_cache import PagedKVCache

    src, (a,) = PagedKVCache.with_rows(3, 2, 4, 1, 10, page_size=4)
    torch.manual_seed(0)
    src.reserve(a, 7)
    for layer in range(3):
        src.write(layer, src.span(a, 0, 7), torch.randn(7, 2, 4), torch.randn(7, 2, 4))
    src.commit(a, torch.arange(7))
    kv = src.read(a, 2, 7)  # [5, 2, layers, Hkv, D]
    assert kv.shape == (5, 2, 3, 2, 4)
    assert torch.equal(kv[:, 1, 2], src.gather(2, src.span(a, 2, 7))[1])  # V of layer 2
    dst, (b, c) = PagedKVCache.with_rows(3, 2, 4, 2, 10, page_size=4)
    dst.load(c, kv)
    assert dst.seq_lens[c] == 5 and torch.equal(dst.read(c, 0, 5), kv)
    with pytest.raises(ValueError, match="needs an empty sequence"):
        dst.load(c, kv)
    with pytest.raises(ValueError, match="do not fit this cache"):
        dst.load(b, kv[:, :, :2])
    with pytest.raises(ValueError, match="not committed"):
        src.read(a, 0, 8)
