"""The CPU fast path and its honest baselines.

- oneDNN-packed linear weights compute what ``nn.Linear`` computes (bf16: the same kernel,
  identical values; fp32: a different summation order) and swap out cleanly, also after
  an exception; treespec on packed weights stays greedy-equal to plain HF generate.
- packed or plain is decided by timing both (on a fake clock here): the faster tree forward
  wins, only steady timings are cached, the key follows dtype and threads; the bench's
  same-path baseline is the faster of plain and packed HF generate, and its header says so.
- treespec without a draft (root-only trees) is plain autoregressive decoding.
- bf16 greedy: every difference from HF generate is judged in fp32 at its first token; with
  the correct tree mask none is unexplained, with a wrong mask some are (so the judgement
  has teeth).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import treespec
from helpers.references import hf_greedy
from helpers.tiny import tiny_model
from treespec import Tree, TreeConfig
from treespec.bench import BenchConfig, run_bench, to_json
from treespec.divergence import NEAR_TIE_TOLERANCE, classify_divergence, first_difference, fp32_reference
from treespec.drafters import ModelDrafter, NgramDrafter, NoDrafter
from treespec.pack_choice import PackingChoice, PackingTimes, choose_packing, measure_packing, packing_key
from treespec.packing import PackedLinear, PackedLinears, onednn_packs, packing_supported

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
# bf16 packing is a CPU feature (AVX512 BW/VL/DQ or AVX-NE-CONVERT): AMD Zen 3 lacks it
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU (no AVX512 BW/VL/DQ, no AVX-NE-CONVERT)"))]


PROMPTS = [[1, 5, 9, 3, 7, 5, 9], [2, 4, 6, 8, 10, 12, 4, 6], [3, 3, 3, 11, 17, 19, 23, 3, 11]]


# ---- packed weights ----------------------------------------------------------------------


@needs_onednn
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_packed_linear_matches_linear(dtype, rows):
    torch.manual_seed(rows)
    lin = nn.Linear(48, 80, bias=True).to(dtype)
    x = torch.randn(2, rows, 48).to(dtype)
    with torch.inference_mode():
        want = lin(x).float()
        got = PackedLinear(lin)(x).float()
    assert got.shape == want.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-2)


@needs_onednn
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_model_logits_and_clean_swap(dtype):
    model = tiny_model("llama", seed=3).to(dtype)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    keys = set(model.state_dict())
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = model(ids).logits.float()
        packed = PackedLinears(model)
        assert len(packed) == len(linears) > 0
        with packed:
            assert all(type(m) is not nn.Linear for m in model.modules())
            assert set(model.state_dict()) == keys  # parameters are shared, not renamed
            with packed:  # re-entrant
                got = model(ids).logits.float()
            assert any(isinstance(m, PackedLinear) for m in model.modules())
    torch.testing.assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-2)
    assert {n: m for n, m in model.named_modules() if type(m) is nn.Linear} == linears  # the same objects back


@needs_onednn
def test_packed_weights_restored_after_an_exception():
    model = tiny_model("llama", seed=4)
    packed = PackedLinears(model)
    with pytest.raises(RuntimeError, match="boom"):
        with packed:
            raise RuntimeError("boom")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_packing_refuses_unsupported_dtypes():
    model = tiny_model("llama", seed=4).to(torch.float16)
    assert not packing_supported(model)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinears(model)


@needs_onednn
def test_packing_bf16_where_onednn_cannot_says_what_to_do(monkeypatch):
    import treespec.packing as packing

    monkeypatch.setattr(packing, "onednn_packs", lambda dtype: dtype == torch.float32)  # a Zen 3, say
    model = tiny_model("llama", seed=4).to(torch.bfloat16)
    assert not packing_supported(model)
    with pytest.raises(ValueError, match="cannot pack bfloat16 weights on this CPU.*float32"):
        PackedLinears(model)


@needs_onednn
def test_onednn_packs_what_onednn_says_it_supports(monkeypatch):
    assert not onednn_packs(torch.float16)
    assert onednn_packs(torch.float32)
    # the probe agrees with oneDNN's own capability check, so a probe that wrongly said no on a
    # bf16-capable CPU (and skipped the bf16 packing tests) would fail here
    assert onednn_packs(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def refuse(*a, **kw):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert not onednn_packs.__wrapped__(torch.float32)  # uncached: a refusal is a no, not a crash


@needs_onednn
@pytest.mark.parametrize("tree", ["chain-3", "cpu-tiny", "cpu"])
def test_greedy_on_packed_weights_equals_plain_hf_generate(tree):
    model = tiny_model("qwen2", seed=5)
    draft = ModelDrafter(tiny_model("qwen2", seed=5))  # the target's twin: deep acceptance
    with PackedLinears(model):
        out = treespec.generate(model, draft, tree, PROMPTS, max_new_tokens=20)
    for p, seq in zip(PROMPTS, out.sequences):
        assert seq == hf_greedy(model, p, 20)
    assert out.metrics.mean_accepted_length > 1.5


@needs_onednn
def test_packed_eagle3_head_drafts_the_same_trees():
    from treespec.drafters import Eagle3Drafter, EagleHead

    model = tiny_model("llama", seed=10, layers=4)
    head = EagleHead.for_target(model, eagle3=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    drafter = Eagle3Drafter(head)
    plain = treespec.generate(model, drafter, "cpu", PROMPTS, max_new_tokens=16)
    packed = PackedLinears(model, *drafter.modules())
    assert len(packed) > len(PackedLinears(model))  # the head's layers too
    with packed:
        out = treespec.generate(model, drafter, "cpu", PROMPTS, max_new_tokens=16)
    assert out.sequences == plain.sequences == [hf_greedy(model, p, 16) for p in PROMPTS]
    assert [r.accepted for r in out.metrics.requests] == [r.accepted for r in plain.metrics.requests]


# ---- packed or plain: the start-up decision -----------------------------------------------

MS = 1e-3
# (plain 1-token, plain 16-token, packed 1-token, packed 16-token) ms, and what must be chosen
INTEL_FP32 = (30, 50, 40, 45)  # packing slows a decode step, speeds the tree: treespec packed, HF plain
ZEN4 = (36, 52, 31, 38)  # packing speeds both
NOWHERE = (30, 40, 40, 55)  # packing slows both: treespec plain


def times(ms, spread=0.05):
    return PackingTimes((1, 16), (ms[0] * MS, ms[1] * MS), (ms[2] * MS, ms[3] * MS), spread=spread)


@pytest.mark.parametrize("ms, pack, decode_packed", [(INTEL_FP32, True, False), (ZEN4, True, True),
                                                     (NOWHERE, False, False)])
def test_the_choice_follows_the_faster_forward(ms, pack, decode_packed):
    choice = PackingChoice.from_times(times(ms))
    assert (choice.pack, choice.decode_packed, choice.source) == (pack, decode_packed, "measured")
    text = choice.describe()
    assert text.startswith(f"treespec on {'packed' if pack else 'plain'} weights")
    assert f"{ms[3]:.1f} ms packed, {ms[1]:.1f} ms plain" in text and f"{ms[2]:.1f} ms packed, {ms[0]:.1f}" in text
    assert f"faster {'packed' if decode_packed else 'plain'}" in text
    data = choice.to_json()
    assert data["treespec"] == ("packed" if pack else "plain") and data["spread"] == 0.05
    assert data["one_token"] == ("packed" if decode_packed else "plain")
    assert PackingTimes.from_json(data["seconds"]) == choice.times


def test_packing_values_check_themselves():
    with pytest.raises(ValueError, match="source"):
        PackingChoice(True, "guessed")
    with pytest.raises(ValueError, match="times"):
        PackingChoice(True, "measured")  # a measured choice without its timings
    with pytest.raises(ValueError, match="times"):
        PackingChoice(False, "given", times(ZEN4))
    with pytest.raises(ValueError, match="positive"):
        PackingTimes((1, 16), (0.03, 0.0), (0.03, 0.04))
    with pytest.raises(ValueError, match="ascending"):
        PackingTimes((16, 1), (0.03, 0.04), (0.03, 0.04))
    assert PackingChoice(True, "given").describe() == "treespec on packed weights, as asked (not measured)"
    assert PackingChoice(True, "given").decode_packed is None


class PackClock:
    """Time that moves only when a forward runs: ``cost[(packed, q)]`` seconds each, times
    ``slow(call)``; records what ran, in order."""

    def __init__(self, ms, slow=lambda call: 1.0):
        self.now, self.ran, self.slow = 0.0, [], slow
        self.cost = {(False, 1): ms[0] * MS, (False, 16): ms[1] * MS, (True, 1): ms[2] * MS, (True, 16): ms[3] * MS}

    def __call__(self) -> float:
        return self.now

    def timed(self, runner):
        real = runner.forward

        def forward(cache, seqs, toks, *a, **k):
            packed = any(isinstance(m, PackedLinear) for m in runner.model.modules())
            q = len(toks[0])
            self.ran.append((packed, q))
            self.now += self.cost.get((packed, q), 0.1) * self.slow(len(self.ran))
            return real(cache, seqs, toks, *a, **k)

        runner.forward = forward
        return runner


@needs_onednn
def test_measure_packing_alternates_and_takes_medians_on_a_fake_clock():
    from treespec.runner import ModelRunner

    model = tiny_model("llama", seed=2)
    clock = PackClock(INTEL_FP32)
    runner = clock.timed(ModelRunner(model))
    with runner.attached():
        got = measure_packing(runner, PackedLinears(model), repeats=4, clock=clock)
    want = times(INTEL_FP32)
    assert got.tokens == (1, 16) and got.spread == pytest.approx(0.0, abs=1e-9)
    assert got.plain == pytest.approx(want.plain) and got.packed == pytest.approx(want.packed)
    assert clock.ran[:3] == [(False, 128), (False, 16), (True, 16)]  # the prompt, then a warm-up each way
    rounds = [clock.ran[3 + 4 * r: 7 + 4 * r] for r in range(4)]
    assert rounds[0] == [(False, 1), (True, 1), (False, 16), (True, 16)]
    assert rounds[1] == [(True, 1), (False, 1), (True, 16), (False, 16)]  # the other goes first
    assert rounds[2] == rounds[0] and len(clock.ran) == 3 + 16
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # left plain

    slow = PackClock(INTEL_FP32, slow=lambda call: 1000.0)  # 30-50 s a forward: one round, then the budget is gone
    runner = slow.timed(ModelRunner(model))
    with runner.attached():
        got = measure_packing(runner, PackedLinears(model), clock=slow)
    assert len(slow.ran) == 3 + 4 and got.spread == float("inf")  # nothing to compare: never cached


def fake_measure(monkeypatch, *results):
    """``measure_packing`` returning ``results`` in turn; the list of calls made."""
    import treespec.pack_choice as pc

    calls = []

    def measure(runner, packed):
        assert isinstance(packed, PackedLinears) and runner.model is packed.model
        calls.append(packed)
        return results[min(len(calls), len(results)) - 1]

    monkeypatch.setattr(pc, "measure_packing", measure)
    return calls


@needs_onednn
@pytest.mark.parametrize("spread, cached", [(0.05, True), (0.6, False), (float("inf"), False)])
def test_only_steady_timings_are_cached(monkeypatch, tmp_path, caplog, spread, cached):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = fake_measure(monkeypatch, times(INTEL_FP32, spread))
    model = tiny_model("llama", seed=2)
    with caplog.at_level("INFO", logger="treespec.pack_choice"):
        first, packed = choose_packing(model)
        again, _ = choose_packing(model)
    assert first.pack and first.source == "measured" and isinstance(packed, PackedLinears)
    files = list((tmp_path / "costs").glob("packing-*.json"))
    assert len(files) == int(cached) and len(calls) == (1 if cached else 2)
    assert again.source == ("cached" if cached else "measured") and again.times == first.times
    said = [r.getMessage() for r in caplog.records]
    assert any("mostly noise" in m and "not cached" in m for m in said) == (not cached)
    assert any(m.startswith("treespec on packed weights: a 16-token forward") for m in said)  # with its timings
    if cached:
        assert json.loads(files[0].read_text())["key"] == packing_key(model)
        _, _ = choose_packing(model, refresh=True)
        assert len(calls) == 2  # refresh measures again


@needs_onednn
def test_plain_choice_packs_nothing_unless_kept(monkeypatch, tmp_path):
    """Where plain weights win, treespec gets no packed copies (a cached choice makes none at
    all); a benchmark that keeps them runs packed HF generate beside."""
    import treespec.pack_choice as pc

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    fake_measure(monkeypatch, times(NOWHERE))
    model = tiny_model("llama", seed=2)
    choice, packed = choose_packing(model)
    assert not choice.pack and packed is None
    made = []
    monkeypatch.setattr(pc, "PackedLinears", lambda *a, **k: made.append(a) or PackedLinears(*a, **k))
    choice, packed = choose_packing(model)
    assert (choice.source, packed, made) == ("cached", None, [])
    head = nn.Linear(4, 4)
    choice, packed = choose_packing(model, head, keep=True)
    assert not choice.pack and isinstance(packed, PackedLinears) and len(made) == 1 and made[0][1] is head
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@needs_onednn
def test_packing_key_follows_dtype_threads_and_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = fake_measure(monkeypatch, times(ZEN4))
    model = tiny_model("llama", seed=2)
    key = packing_key(model)
    assert key["dtype"] == "float32" and key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads()
    assert key["parameters"] == sum(p.numel() for p in model.parameters()) and key["device"]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        choose_packing(model)
        torch.set_num_threads(2)
        assert packing_key(model) == {**key, "threads": 2}
        choose_packing(model)  # another thread count: measured again
    finally:
        torch.set_num_threads(n)
    assert len(calls) == 2
    if onednn_packs(torch.bfloat16):
        assert packing_key(model.to(torch.bfloat16))["dtype"] == "bfloat16"
        choose_packing(model)
        assert len(calls) == 3
    assert packing_key(tiny_model("llama", seed=2, layers=3))["model_config"] != key["model_config"]
    assert len(list((tmp_path / "costs").glob("packing-*.json"))) == len(calls)


def test_a_model_onednn_cannot_pack_is_plain_unmeasured(monkeypatch):
    calls = fake_measure(monkeypatch, times(ZEN4))
    choice, packed = choose_packing(tiny_model("llama", seed=2).to(torch.float16))
    assert (choice, packed, calls) == (PackingChoice(False, "unsupported"), None, [])


# ---- no draft ----------------------------------------------------------------------------


def test_no_drafter_is_autoregressive_decoding():
    model = tiny_model("llama", seed=6)
    out = treespec.generate(model, NoDrafter(), TreeConfig.chain(1), PROMPTS, max_new_tokens=12)
    assert out.sequences == [hf_greedy(model, p, 12) for p in PROMPTS]
    assert out.metrics.mean_accepted_length == 1.0
    assert out.metrics.tree_tokens == out.metrics.num_request_steps  # the root alone each step
    assert treespec.generate(model, "none", "chain-2", PROMPTS[0], max_new_tokens=5).sequences[0] == \
        hf_greedy(model, PROMPTS[0], 5)


def test_prompts_as_numpy_arrays():
    import numpy as np

    model = tiny_model("llama", seed=6)
    arrays = [np.array(p, dtype=np.int64) for p in PROMPTS[:2]]
    out = treespec.generate(model, "none", "chain-1", arrays, max_new_tokens=4)
    assert out.sequences == [hf_greedy(model, p, 4) for p in PROMPTS[:2]]
    assert treespec.generate(model, "none", "chain-1", arrays[0], max_new_tokens=4).sequences[0] == \
        hf_greedy(model, PROMPTS[0], 4)


# ---- greedy differences judged in fp32 ---------------------------------------------------


@pytest.mark.parametrize("ref, other, want", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),  # mismatch at position 1
    ([1, 2, 3], [1, 2], 2),  # one stopped early
    ([], [4], 0),
])
def test_first_difference(ref, other, want):
    assert first_difference(ref, other) == want


def test_classify_divergence_reads_the_fp32_logits():
    model = tiny_model("llama", seed=7)
    prompt = PROMPTS[1]
    ref = hf_greedy(model, prompt, 6)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:3]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    gap = float(logits.max() - logits[runner_up])
    d = classify_divergence(model, prompt, ref, ref[:3] + [runner_up, 0, 0], tolerance=gap + 1e-3)
    assert (d.position, d.reference_token, d.token) == (3, ref[3], runner_up)
    assert d.fp32_shortfall == pytest.approx(gap, abs=1e-4) and d.near_tie
    assert not classify_divergence(model, prompt, ref, ref[:3] + [runner_up], tolerance=gap / 2).near_tie
    assert classify_divergence(model, prompt, ref, list(ref), tolerance=0.0) is None
    early = classify_divergence(model, prompt, ref, ref[:2], tolerance=1e9)
    assert early.position == 2 and not early.near_tie  # stopping early is never a near-tie


def test_worst_greedy_shortfall_judges_every_token_on_its_own_prefix():
    """A greedy fp32 output lies at the fp32 maximum everywhere; a token swapped in after the
    first difference is found where it is, by how far it lies below; with the options'
    processors the scores are judged as greedy saw them."""
    from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from treespec.divergence import worst_greedy_shortfall

    model = tiny_model("llama", seed=7)
    prompt = PROMPTS[1]
    ref = hf_greedy(model, prompt, 10)
    j, short = worst_greedy_shortfall(model, prompt, ref)
    assert short <= 1e-5
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:6]])).logits[0, -1]
    bad = int(logits.argmin())
    j, short = worst_greedy_shortfall(model, prompt, ref[:6] + [bad] + ref[7:], start=2)
    assert j == 6 and short == pytest.approx(float(logits.max() - logits[bad]), abs=1e-4)
    assert worst_greedy_shortfall(model, prompt, ref, start=len(ref)) == (-1, 0.0)
    penalised = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0)])
    ids = torch.tensor([prompt])
    with_penalty = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                  repetition_penalty=3.0)[0, len(prompt):].tolist()
    assert worst_greedy_shortfall(model, prompt, with_penalty, penalised)[1] <= 1e-5


def _bf16_unexplained(model, trees, drafter_for, n=24):
    """Greedy treespec vs HF generate in bf16: (differences, unexplained ones)."""
    ref32 = fp32_reference(model)
    diffs = unexplained = 0
    for tree in trees:
        out = treespec.generate(model, drafter_for(), tree, PROMPTS, max_new_tokens=n)
        for p, seq in zip(PROMPTS, out.sequences):
            d = classify_divergence(ref32, p, hf_greedy(model, p, n), seq, NEAR_TIE_TOLERANCE[torch.bfloat16])
            diffs += d is not None
            unexplained += d is not None and not d.near_tie
    return diffs, unexplained


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_greedy_has_no_unexplained_difference(family):
    model = tiny_model(family, seed=8).to(torch.bfloat16)
    twin = tiny_model(family, seed=8).to(torch.bfloat16)
    _, unexplained = _bf16_unexplained(model, ["chain-4", "cpu"], lambda: ModelDrafter(twin))
    assert unexplained == 0
    _, unexplained = _bf16_unexplained(model, ["cpu-tiny"], NgramDrafter)
    assert unexplained == 0


def test_bf16_judgement_catches_a_wrong_tree_mask(monkeypatch):
    model = tiny_model("llama", seed=8).to(torch.bfloat16)
    twin = tiny_model("llama", seed=8).to(torch.bfloat16)
    # Every node sees the whole tree (siblings and descendants too): wrong logits.
    monkeypatch.setattr(Tree, "attention_mask", lambda self: torch.ones(self.num_nodes, self.num_nodes, dtype=torch.bool))
    diffs, unexplained = _bf16_unexplained(model, ["cpu"], lambda: ModelDrafter(twin))
    assert unexplained > 0 and diffs >= unexplained


# ---- the bench's baselines ---------------------------------------------------------------


@needs_onednn
def test_bench_runs_the_same_advantage_baselines(monkeypatch):
    model = tiny_model("llama", seed=9)
    packed = PackedLinears(model)
    configs = [BenchConfig.hf_generate(fast=True), BenchConfig.treespec_ar(),
               BenchConfig.treespec(NgramDrafter(), TreeConfig.chain(3), "ngram", "chain-3")]
    # Which configurations ran on the packed weights: count packed forwards per run.
    import treespec.bench.running as bench

    calls, runs = [0], []
    real_forward, real_run = PackedLinear.forward, bench._run_one_inner

    def counting_forward(self, x):
        calls[0] += 1
        return real_forward(self, x)

    def counting_run(model, cfg, *a, **kw):
        before = calls[0]
        rec = real_run(model, cfg, *a, **kw)
        runs.append((cfg.name, calls[0] > before))
        return rec

    monkeypatch.setattr(PackedLinear, "forward", counting_forward)
    monkeypatch.setattr(bench, "_run_one_inner", counting_run)
    res = run_bench(model, PROMPTS, configs, max_new_tokens=10, warmup=False, fast_path=packed)
    on_packed = {name: used for name, used in runs}
    assert on_packed == {"hf-generate": False, "hf-generate+fast": True, "treespec-ar": True, "ngram/chain-3": True}
    data = to_json(res)
    names = [c["name"] for c in data["configs"]]
    assert names == ["hf-generate", "hf-generate+fast", "treespec-ar", "ngram/chain-3"]
    assert data["best_baseline"] in ("hf-generate", "hf-generate+fast", "treespec-ar")
    assert data["settings"]["fast_path"] == "oneDNN-packed linear weights"
    assert data["unexplained_mismatches"] == 0
    for c in data["configs"]:
        assert c["speedup_vs_best_baseline"] > 0
    best = next(c for c in data["configs"] if c["name"] == data["best_baseline"])
    assert best["speedup_vs_best_baseline"] == pytest.approx(1.0)
    assert data["same_path_baseline"] in ("hf-generate", "hf-generate+fast")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@needs_onednn
def test_bench_runs_treespec_plain_where_plain_wins_and_packed_hf_beside(monkeypatch):
    """A plain choice: treespec's configurations (its own one-token decoding too) run on plain
    weights, HF generate on both; the choice and its timings are recorded and headed."""
    import treespec.bench.running as bench
    from treespec.bench import header_lines

    model = tiny_model("llama", seed=9)
    choice = PackingChoice.from_times(times(NOWHERE), "cached")
    configs = [BenchConfig.hf_generate(fast=True), BenchConfig.treespec_ar(fast=choice.pack),
               BenchConfig.treespec(NgramDrafter(), TreeConfig.chain(3), "ngram", "chain-3", fast=choice.pack)]
    runs = []
    real_run = bench._run_one_inner

    def which_weights(model, cfg, *a, **kw):
        runs.append((cfg.name, any(isinstance(m, PackedLinear) for m in model.modules())))
        return real_run(model, cfg, *a, **kw)

    monkeypatch.setattr(bench, "_run_one_inner", which_weights)
    res = run_bench(model, PROMPTS[:1], configs, max_new_tokens=6, warmup=False, fast_path=PackedLinears(model),
                    packing=choice)
    assert dict(runs) == {"hf-generate": False, "hf-generate+fast": True, "treespec-ar": False, "ngram/chain-3": False}
    data = to_json(res)
    packing = data["settings"]["packing"]
    assert (packing["treespec"], packing["one_token"], packing["source"]) == ("plain", "plain", "cached")
    assert packing["seconds"] == {"tokens": [1, 16], "plain": [0.03, 0.04], "packed": [0.04, 0.055]}
    head = header_lines(data)
    assert head[0] == "packing: " + choice.describe() and "measured by an earlier run" in head[0]
    assert head[1].startswith(f"same-path baseline: {data['same_path_baseline']}, HF generate on ")
    json.dumps(data)  # plain JSON types


def _hf_result(rates: dict[str, float]):
    """A bench result whose configurations generated 10 tokens a prompt at ``rates`` tok/s."""
    from treespec.bench import BenchResult, ConfigResult, RunRecord
    from treespec.sampling_args import SamplingParams

    made = {"hf-generate": BenchConfig.hf_generate(), "hf-generate+fast": BenchConfig.hf_generate(fast=True),
            "hf-prompt-lookup-3": BenchConfig.hf_lookup(3)}
    results = [ConfigResult(made[name], [RunRecord(list(range(10)), 10 / tps)] * 2) for name, tps in rates.items()]
    return BenchResult([5, 5], results, SamplingParams(), 10, 0, packing=PackingChoice.from_times(times(INTEL_FP32)))


@pytest.mark.parametrize("plain, packed, same", [(10.0, 8.0, "hf-generate"), (10.0, 12.5, "hf-generate+fast")])
def test_same_path_baseline_is_the_faster_hf_generate(plain, packed, same):
    """Intel fp32 (packing slows HF's decode) and AMD (it speeds it): the ratio over the
    same-path baseline is over the faster of the two, and the header names it."""
    from treespec.bench import header_lines

    data = to_json(_hf_result({"hf-generate": plain, "hf-generate+fast": packed, "hf-prompt-lookup-3": 16.0}))
    assert data["same_path_baseline"] == same
    spec = data["configs"][2]
    assert spec["speedup"] == pytest.approx(16.0 / plain)
    assert spec["speedup_vs_same_path"] == pytest.approx(16.0 / max(plain, packed))
    assert spec["median_speedup_vs_same_path"] == pytest.approx(16.0 / max(plain, packed))
    head = header_lines(data)
    assert head[0].startswith("packing: treespec on packed weights: a 16-token forward")
    weights = "packed" if same.endswith("+fast") else "plain"
    assert head[1] == (f"same-path baseline: {same}, HF generate on {weights} weights, the faster here "
                       f"({packed:.1f} tok/s packed, {plain:.1f} plain)")
    plain_only = to_json(_hf_result({"hf-generate": plain, "hf-prompt-lookup-3": 16.0}))
    assert plain_only["same_path_baseline"] == "hf-generate"
    assert header_lines(plain_only)[1] == "same-path baseline: hf-generate (HF generate did not run on packed weights)"
