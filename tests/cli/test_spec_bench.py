"""Spec-Bench in treespec: which questions a selection gives, MT-bench's second turn asked
after the target's own first answer (greedy, still token for token HF generate's), and the
per-category figures, their mean, and Spec-Bench's own "Overall" (the mean of per-question
tokens/s over the baseline's).
A tiny fp32 llama with a ChatML template; a few tokens a turn."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from treespec.bench import BenchConfig, format_table, run_bench, to_json
from treespec.config import TreeConfig
from treespec.drafters import NgramDrafter
from treespec.prompts import (MT_BENCH_CATEGORIES, SPEC_BENCH_CATEGORIES, Prompt, dataset_file, load_bench_prompts,
                              load_prompts, spec_bench_questions)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- which questions ----------------------------------------------------------------------


def test_num_prompts_is_per_category_in_the_leaderboards_order():
    rows = spec_bench_questions("spec-bench", 2)
    assert [r["category"] for r in rows] == [c for c in SPEC_BENCH_CATEGORIES for _ in range(2)]
    # conversation takes MT-bench's categories in turn (writing, then roleplay), the others file order
    assert [r["question_id"] for r in rows] == [81, 91, 161, 162, 241, 242, 321, 322, 401, 402, 481, 482]
    assert len(spec_bench_questions()) == 480 and len(spec_bench_questions(num_prompts=10)) == 60
    first8 = spec_bench_questions("spec-bench:conversation", 8)
    assert [r["mt_bench_category"] for r in first8] == list(MT_BENCH_CATEGORIES)  # one of each
    assert len(spec_bench_questions("spec-bench:conversation")) == 80


def test_one_category_alone():
    assert [r["question_id"] for r in spec_bench_questions("spec-bench:qa", 2)] == [321, 322]
    writing = spec_bench_questions("spec-bench:writing", 3)
    assert [r["question_id"] for r in writing] == [81, 82, 83]
    assert {r["category"] for r in writing} == {"writing"}  # reported under its own name when chosen alone
    assert len(spec_bench_questions("spec-bench:rag")) == 80
    for bad in ("spec-bench:nope", "spec-bench:"):
        with pytest.raises(ValueError, match="unknown Spec-Bench category"):
            dataset_file(bad)  # the command line's check before the model loads
    with pytest.raises(ValueError, match="num_prompts"):
        spec_bench_questions(num_prompts=0)


def test_prompts_are_chat_templated_user_turns(chat_lm, caplog):
    _, tok = chat_lm
    prompts, fmt = load_bench_prompts("spec-bench", tok, 1)
    assert fmt == "chat" and [p.category for p in prompts] == list(SPEC_BENCH_CATEGORIES)
    conv, translation = prompts[0], prompts[1]
    rows = spec_bench_questions("spec-bench", 1)
    assert tok.decode(list(conv.ids)) == f"<|im_start|>user\n{rows[0]['turns'][0]}<|im_end|>\n<|im_start|>assistant\n"
    assert conv.num_turns == 2 and conv.turns == tuple(rows[0]["turns"])
    assert translation.num_turns == 1 and translation.turns == ()
    assert load_prompts("spec-bench", tok, 1)[0] == [list(p.ids) for p in prompts]  # first turns for other commands
    with pytest.raises(ValueError, match="prompt-field"):
        load_bench_prompts("spec-bench", tok, 1, prompt_field="question")
    plain = type(tok).from_pretrained(tok.name_or_path)
    plain.chat_template = None
    with caplog.at_level(logging.WARNING, logger="treespec.prompts"):
        raw, fmt = load_bench_prompts("spec-bench:writing", plain, 1)
    assert fmt == "raw" and "no chat template" in caplog.text
    assert raw[0].chat is False and tok.decode(list(raw[0].ids), skip_special_tokens=True) == rows[0]["turns"][0]


def test_the_second_turn_follows_the_answer(chat_lm):
    _, tok = chat_lm
    p = Prompt(tuple(tok("x")["input_ids"]), "conversation", ("Tell a story.", "Now shorter."))
    answer = tok("Lily saw a dog.", add_special_tokens=False)["input_ids"]
    assert tok.decode(p.next_turn(tok, [answer])) == (
        "<|im_start|>user\nTell a story.<|im_end|>\n<|im_start|>assistant\nLily saw a dog.<|im_end|>\n"
        "<|im_start|>user\nNow shorter.<|im_end|>\n<|im_start|>assistant\n")
    raw = Prompt((), None, ("Tell a story.", "Now shorter."), chat=False)
    assert tok.decode(raw.next_turn(tok, [answer]), skip_special_tokens=True) == \
        "Tell a story.\n\nLily saw a dog.\n\nNow shorter."
    with pytest.raises(ValueError, match="no turn after"):
        p.next_turn(tok, [answer, answer])


# ---- running both turns -------------------------------------------------------------------


def _configs():
    return [BenchConfig.hf_lookup(3), BenchConfig.treespec(NgramDrafter(), TreeConfig.chain(3), "ngram", "chain-3")]


def test_two_turns_each_after_the_own_answer_and_greedy_exact(chat_lm):
    model, tok = chat_lm
    prompts, _ = load_bench_prompts("spec-bench:conversation", tok, 2)
    res = run_bench(model, prompts, _configs(), max_new_tokens=6, tokenizer=tok, warmup=False)
    assert res.treespec_mismatches == 0 and all(not r.mismatches for r in res.results)
    for i, p in enumerate(prompts):
        base = res.baseline.runs[i]
        assert len(base.turn_lengths) == 2 and len(base.tokens) == sum(base.turn_lengths) == 12  # both turns count
        first = tok.decode(base.turn_tokens(0), skip_special_tokens=True).strip()
        assert first and tok.decode(base.turn_prompts[1]) == (
            f"<|im_start|>user\n{p.turns[0]}<|im_end|>\n<|im_start|>assistant\n{first}<|im_end|>\n"
            f"<|im_start|>user\n{p.turns[1]}<|im_end|>\n<|im_start|>assistant\n")
        # turn 2 is HF generate's greedy answer to that conversation, and every configuration's too
        ids = torch.tensor([base.turn_prompts[1]])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert base.turn_tokens(1) == hf[0, ids.shape[1]:].tolist()
        for r in res.results[1:]:
            assert r.runs[i].turn_prompts == base.turn_prompts and r.runs[i].tokens == base.tokens
    spec = res.results[-1].runs[0].metrics
    assert spec["num_generated"] == 12 and len(spec["accepted"]) == spec["num_request_steps"]


def test_hf_compiled_runs_every_call_on_one_static_cache(chat_lm, monkeypatch):
    """HF generate's compiled baseline sizes its static cache once for the bench (both turns of
    the longest conversation fit) and its warm-up fills it: every call, warm-up included, runs on
    that one cache length, so its decode compiles once, before the timed calls (as a cache
    outgrown in a timed call would compile again inside it)."""
    model, tok = chat_lm
    prompts, _ = load_bench_prompts("spec-bench:conversation", tok, 2)
    calls = []  # (input length, max_new_tokens, max_cache_len) of each HF call
    monkeypatch.setattr(type(model), "generate", lambda self, ids, generation_config=None, **kw: (
        calls.append((ids.shape[1], generation_config.max_new_tokens, generation_config.max_cache_len)),
        torch.cat([ids, torch.zeros(1, generation_config.max_new_tokens, dtype=ids.dtype)], 1))[1])
    run_bench(model, prompts, [BenchConfig.hf_generate_compiled()], max_new_tokens=6, tokenizer=tok, warmup=True)
    compiled = [c for c in calls if c[2] is not None]  # the plain baseline's calls have no static cache
    assert len(calls) == 2 * len(compiled) and len(compiled) == 1 + 2 * 2  # a warm-up, two turns a prompt
    bound = compiled[0][2]
    assert bound == 1 << (bound.bit_length() - 1) and all(c == bound for _, _, c in compiled)
    assert compiled[0][0] + compiled[0][1] == bound  # the warm-up fills it
    assert all(n + new <= bound for n, new, _ in compiled[1:])


def test_a_second_turn_difference_is_judged_in_that_turn(chat_lm, monkeypatch):
    """A wrong token in turn 2 only: found at its place in the whole output, and judged
    (unexplained) against the fp32 model given turn 2's own prompt."""
    import treespec.bench.running as bench

    model, tok = chat_lm
    real, calls = bench.ts_generate, []

    def wrong_in_turn_two(*a, **kw):
        out = real(*a, **kw)
        calls.append(len(a[3]))
        if len(calls) % 2 == 0:
            out.sequences[0][-1] = (out.sequences[0][-1] + 1) % len(tok)
        return out

    monkeypatch.setattr(bench, "ts_generate", wrong_in_turn_two)
    prompts, _ = load_bench_prompts("spec-bench:conversation", tok, 1)
    res = run_bench(model, prompts, _configs()[1:], max_new_tokens=5, tokenizer=tok, warmup=False)
    r = res.results[-1]
    assert r.mismatches == [0] and r.unexplained == [0]
    assert r.first_diff[0] == 5 + 4  # turn 1's five tokens, then turn 2's last
    assert calls[1] > calls[0]  # turn 2 was given the longer conversation


def test_tokens_after_a_near_tie_are_judged_on_their_own_prefix(chat_lm, monkeypatch):
    """An output that leaves HF generate's at a near-tie and later emits a token greedy decoding
    would not (on its own prefix) is unexplained: the first difference alone passed it."""
    import treespec.bench.running as bench

    model, tok = chat_lm
    prompts, _ = load_bench_prompts("spec-bench:qa", tok, 1)
    real = bench.ts_generate
    seen = {}

    def near_tie_then_wrong(*a, **kw):
        out = real(*a, **kw)
        prompt, seq = list(a[3]), out.sequences[0]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + seq[:1]])).logits[0, -1].float()
        top2 = logits.topk(2).indices.tolist()
        seq[1] = top2[1] if seq[1] == top2[0] else top2[0]  # the runner-up: a near-tie within the tolerance
        seen["gap"] = float(logits.max() - logits[seq[1]])
        with torch.inference_mode():
            later = model(torch.tensor([prompt + seq[:4]])).logits[0, -1].float()
        seq[4] = int(later.argmin())  # a token no greedy choice makes
        seen["bad"] = float(later.max() - later.min())
        return out

    monkeypatch.setattr(bench, "ts_generate", near_tie_then_wrong)
    config = BenchConfig.treespec(NgramDrafter(), TreeConfig.chain(3), "ngram", "chain-3")
    res = run_bench(model, prompts, [config], max_new_tokens=8, tokenizer=tok, warmup=False, near_tie_tolerance=5.0)
    r = res.results[-1]
    assert seen["gap"] <= 5.0 < seen["bad"]
    d = r.divergences[0]
    assert d.position == 1 and d.fp32_shortfall == pytest.approx(seen["gap"], abs=1e-3)
    assert d.later_position is not None and d.later_shortfall > 5.0 and r.unexplained == [0]


# ---- figures --------------------------------------------------------------------------------


def test_per_category_figures_and_overall_is_their_mean(chat_lm):
    model, tok = chat_lm
    prompts, _ = load_bench_prompts("spec-bench", tok, 1)
    res = run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False)
    data = to_json(res)
    assert data["categories"] == list(SPEC_BENCH_CATEGORIES)
    assert [(p["category"], p.get("turns", 1)) for p in data["prompts"]] == [
        ("conversation", 2)] + [(c, 1) for c in SPEC_BENCH_CATEGORIES[1:]]
    for c in data["configs"]:
        cats = c["categories"]
        assert list(cats) == list(SPEC_BENCH_CATEGORIES) and all(v["num_prompts"] == 1 for v in cats.values())
        assert c["overall_speedup"] == pytest.approx(sum(v["speedup"] for v in cats.values()) / 6)
        qa = data["prompts"][3]["results"][c["name"]]
        assert cats["qa"]["tokens_per_second"] == pytest.approx(qa["tokens_per_second"])
        assert cats["qa"]["speedup"] == pytest.approx(qa["speedup"])
        # Spec-Bench's own ratio: one question a category makes it the pooled one; overall it is
        # the mean of every question's tokens/s over the baseline's mean, not the categories' mean
        assert all(v["spec_bench_speedup"] == pytest.approx(v["speedup"]) for v in cats.values())
        rates = [[p["results"][n]["tokens_per_second"] for p in data["prompts"]] for n in (c["name"], "hf-generate")]
        assert c["overall_spec_bench_speedup"] == pytest.approx(sum(rates[0]) / sum(rates[1]))
    base, lookup, spec = data["configs"]
    assert all(v["speedup"] == pytest.approx(1.0) for v in base["categories"].values())
    assert lookup["categories"]["rag"]["mean_accepted_length"] is None  # HF's lookup reports none
    assert all(v["mean_accepted_length"] >= 1.0 for v in spec["categories"].values())
    table = format_table(data, legend=False).splitlines()
    assert table[0].split() == ["config", "conv", "transl", "summ", "qa", "math", "rag", "tau", "overall", "SB",
                                "overall"]
    assert table[4].split()[-2:] == [f"{spec['overall_speedup']:.2f}x",  # the leaderboard's row
                                     f"{spec['overall_spec_bench_speedup']:.2f}x"]
    assert format_table(data, wide=True, legend=False).splitlines()[0].split()[1:7] == list(SPEC_BENCH_CATEGORIES)


# ---- a long run resumes from its journal --------------------------------------------------


def test_a_stopped_run_resumes_from_its_journal(chat_lm, tmp_path, caplog):
    model, tok = chat_lm
    prompts, _ = load_bench_prompts("spec-bench", tok, 1)  # six questions, the first with two turns
    journal = tmp_path / "bench.jsonl"
    full = run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False)

    def stop_after_three(progress):
        if progress.stage == "prompts" and progress.done == 3 and progress.config is None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False, journal=journal,
                  callback=stop_after_three)
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 3  # the settings, then prompts 0, 1, 2

    ran = []
    res = run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False, journal=journal,
                    callback=lambda p: ran.append(p.done) if p.config is not None else None)
    assert sorted(set(ran)) == [3, 4, 5]  # only the prompts the journal lacked were run
    assert any("resumed: the first 3 prompt(s)" in n for n in res.notes)
    for a, b in zip(res.results, full.results):
        assert [r.tokens for r in a.runs] == [r.tokens for r in b.runs]
        assert a.runs[0].turn_lengths == b.runs[0].turn_lengths and len(a.runs[0].turn_lengths) == 2
    spec = res.results[-1]
    assert spec.runs[0].metrics["num_steps"] > 0  # treespec's counters came back with the record
    assert len(journal.read_text().splitlines()) == 1 + 6

    # Read back whole: nothing runs (no warm-up either), the same figures; a judged difference
    # in the journal comes back as one (put there by hand: greedy here never differs).
    lines = journal.read_text().splitlines()
    rec = json.loads(lines[2])
    rec["divergences"][spec.config.name] = dict(position=1, reference_token=5, token=6, fp32_shortfall=9.0,
                                                tolerance=0.5)
    journal.write_text("\n".join(lines[:2] + [json.dumps(rec)] + lines[3:]) + "\n")
    stages = []
    again = run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=True, journal=journal,
                      callback=lambda p: stages.append(p.stage))
    assert "warmup" not in stages
    assert [r.seconds for r in again.results[-1].runs] == [r.seconds for r in spec.runs]
    figures = {c["name"]: c for c in to_json(again)["configs"]}
    assert figures[spec.config.name]["mismatches"] == 1 and figures[spec.config.name]["unexplained"] == 1
    assert figures[spec.config.name]["divergences"]["1"]["kind"] == "unexplained"
    assert again.treespec_unexplained == 1
    first = {c["name"]: c for c in to_json(res)["configs"]}
    for name, c in figures.items():  # all else as the run that wrote it
        if name != spec.config.name:
            assert {k: v for k, v in c.items() if k != "divergences"} == \
                {k: v for k, v in first[name].items() if k != "divergences"}

    # A line cut short by a stop mid-write: that prompt runs again.
    journal.write_text("\n".join(lines[:6]) + "\n" + '{"prompt": 5, "ru')
    with caplog.at_level(logging.WARNING, logger="treespec.bench"):
        ran.clear()
        run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False, journal=journal,
                  callback=lambda p: ran.append(p.done) if p.config is not None else None)
    assert "cut short" in caplog.text and sorted(set(ran)) == [5]
    assert len(journal.read_text().splitlines()) == 1 + 6
    # A last record whole but for its newline: kept, and the next one starts its own line.
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:5]))
    ran.clear()
    run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False, journal=journal,
              callback=lambda p: ran.append(p.done) if p.config is not None else None)
    assert sorted(set(ran)) == [4, 5] and len(journal.read_text().splitlines()) == 1 + 6


def test_a_journal_of_other_settings_is_refused(chat_lm, tmp_path):
    model, tok = chat_lm
    prompts, _ = load_bench_prompts("spec-bench:qa", tok, 1)
    journal = tmp_path / "bench.jsonl"
    run_bench(model, prompts, _configs(), max_new_tokens=3, tokenizer=tok, warmup=False, journal=journal)
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens differ\)"):
        run_bench(model, prompts, _configs(), max_new_tokens=4, tokenizer=tok, warmup=False, journal=journal)
    with pytest.raises(ValueError, match=r"configs differ"):
        run_bench(model, prompts, _configs()[1:], max_new_tokens=3, tokenizer=tok, warmup=False, journal=journal)
    other, _ = load_bench_prompts("spec-bench:rag", tok, 1)
    with pytest.raises(ValueError, match=r"prompts differ"):
        run_bench(model, other, _configs(), max_new_tokens=3, tokenizer=tok, warmup=False, journal=journal)
    w = next(model.parameters())
    with torch.no_grad():
        w.view(-1)[0] += 1.0  # the same model, other weights
        try:
            with pytest.raises(ValueError, match=r"weights differ"):
                run_bench(model, prompts, _configs(), max_new_tokens=3, tokenizer=tok, warmup=False, journal=journal)
        finally:
            w.view(-1)[0] -= 1.0
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="not a treespec bench journal"):
        run_bench(model, prompts, _configs(), max_new_tokens=3, tokenizer=tok, warmup=False,
                  journal=tmp_path / "notes.txt")


def test_the_journal_keeps_a_judged_difference(tmp_path):
    from treespec.bench import RunRecord
    from treespec.bench.journal import Journal
    from treespec.divergence import Divergence

    path = tmp_path / "j.jsonl"
    book = Journal(path, {"k": 1})
    d0 = Divergence(position=3, reference_token=7, token=9, fp32_shortfall=0.01, tolerance=0.5)
    book.append(0, {"a": RunRecord([1, 2], 0.5, {"num_steps": 2}, [[4, 5]], [2])}, {"a": d0})
    (runs, divergences), = Journal(path, {"k": 1}).done
    assert runs["a"] == RunRecord([1, 2], 0.5, {"num_steps": 2}, [], [2])  # the turns' prompts are not kept
    assert divergences["a"] == d0 and divergences["a"].near_tie
