"""``treespec generate`` end to end on a tiny random llama with a byte-level tokenizer that the
tests build and save (``helpers.tiny.save_tiny_lm``): the greedy continuation streamed, prompts
from a flag, a file or a pipe, draft heads and draft models, and every refusal in one line
(a prompt past the context, a head for another model, a vocabulary mismatch, no chat template,
CUDA graphs on a CPU, an unknown model name)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers.cli import error_line, run_cli
from helpers.references import hf_greedy_text
from helpers.tiny import tiny_model
from treespec import cli

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- generate ---------------------------------------------------------------------------


def test_generate_ngram_streams_the_greedy_continuation(capsys, caplog, monkeypatch, lm, lm_dir, tmp_path):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))  # an auto tree measures a cost curve
    rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "auto",
                       "--prompt", "Once upon a time", "--max-new-tokens", "16")
    assert rc == 0
    expected = hf_greedy_text(*lm, "Once upon a time", 16)
    assert len(expected) > 10
    assert out.startswith(expected)
    summary = [ln for ln in err.splitlines() if "tokens/s" in ln]
    assert len(summary) == 1
    assert "16 tokens" in summary[0] and "mean accepted length" in summary[0] and "steps" in summary[0]
    # decoding's rate apart from the prompt's prefill (issue 31: a long prompt's prefill sank the rate)
    n = len(lm[1]("Once upon a time")["input_ids"])
    assert re.search(r"decoding [0-9.]+ tokens/s \(15 tokens in [0-9.]+ s\), prefill [0-9]+ tokens/s "
                     rf"\({n} prompt tokens", summary[0]), summary[0]
    # what a first auto run waits on is said without -v (the command line shows treespec.costs at INFO)
    said = [r.getMessage() for r in caplog.records if r.name == "treespec.costs"]
    assert said and said[0].startswith("measuring what a verify forward of 1 to")


def test_generate_compile_gives_the_greedy_continuation(capsys, caplog, monkeypatch, lm, lm_dir):
    """--compile: the verify forward compiled on fixed shapes (and an EAGLE head's passes; prompt
    lookup has none) gives HF generate's greedy text; with --cuda-graphs it is one line's error."""
    import treespec.engine

    seen, real = {}, treespec.engine.stream

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(treespec.engine, "stream", spy)
    rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                           "--prompt", "Once upon a time", "--max-new-tokens", "12", "--compile")
    assert rc == 0, err
    assert out.startswith(hf_greedy_text(*lm, "Once upon a time", 12))
    assert seen["fixed_shapes"] == "compile"
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compiled the verify forward for") for m in said)  # what the first run waited on
    assert not any("drafter runs eagerly" in m for m in said)  # lookup has no passes to compile: nothing to say
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--compile", "--cuda-graphs", "--prompt", "x")
    assert rc == 2 and "give one" in error_line(err)


def test_generate_refuses_a_prompt_past_the_context_unless_asked(capsys, lm_dir):
    long = "Once upon a time " * 80  # past the tiny model's 256 positions
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                     "--prompt", long, "--max-new-tokens", "4")
    assert rc == 2
    line = error_line(err)
    assert "longer than the model's context of 256 positions" in line and "--allow-past-context" in line
    rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                       "--prompt", long, "--max-new-tokens", "4", "--allow-past-context")
    assert rc == 0, err
    assert "decoding" in err and "warning" not in err


def test_generate_warns_in_one_line_when_the_answer_may_run_past_the_context(capsys, lm_dir):
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                     "--prompt", "Once upon a time " * 10, "--max-new-tokens", "200")
    assert rc == 0, err
    (line,) = [ln for ln in err.splitlines() if "warning" in ln]
    assert line.startswith("treespec: warning: a prompt of ") and line.endswith("pass --allow-past-context to go past it without this warning")


def test_generate_reads_a_piped_prompt(lm, lm_dir):
    """``echo "Tell me about Paris" | treespec generate`` answered the built-in prompt (issue 31)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "treespec.cli", "generate", "--model", lm_dir, "--draft", "ngram",
                        "--tree", "chain-2", "--max-new-tokens", "8"], input="Once upon a time\n",
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(hf_greedy_text(*lm, "Once upon a time", 8))  # no chat template: plain text
    assert "the prompt from stdin (16 characters), as plain text" in p.stderr


def test_generate_prompt_file_and_the_built_in_prompt_said(capsys, monkeypatch, lm, lm_dir, tmp_path):
    import io

    f = tmp_path / "p.txt"
    f.write_text("Once upon a time\n")
    rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                       "--max-new-tokens", "8", "--prompt-file", str(f))
    assert rc == 0, err
    assert out.startswith(hf_greedy_text(*lm, "Once upon a time", 8))
    assert f"the prompt from --prompt-file {f}" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # an empty pipe (< /dev/null): no prompt given
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                     "--max-new-tokens", "2")
    assert rc == 0, err
    assert "no prompt given" in err and "built-in one: 'Natalia sold clips" in err
    rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(tmp_path / "absent.txt"))
    assert rc == 2 and "no such file" in error_line(err)
    rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(f), "--chat", "Hi")
    assert rc == 2 and "not allowed with" in error_line(err)


def test_generate_with_head_directory_and_model_draft(capsys, lm, lm_dir, tmp_path):
    """A (random) EAGLE-3 head directory and an independent draft model: still the greedy text."""
    from treespec.drafters import EagleHead

    model, _ = lm
    torch.manual_seed(0)
    EagleHead.for_target(model, eagle3=True).save_pretrained(tmp_path / "head")
    expected = hf_greedy_text(*lm, "Once upon a time", 12)
    for draft in (str(tmp_path / "head"), f"model:{lm_dir}"):
        rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", draft, "--tree", "cpu-tiny",
                           "--prompt", "Once upon a time", "--max-new-tokens", "12")
        assert rc == 0, err
        assert out.startswith(expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_graphs_on_a_cpu_are_refused_in_one_line(capsys, lm_dir):
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--cuda-graphs", "--device", "cpu",
                     "--prompt", "Once upon a time", "--max-new-tokens", "4")
    assert rc == 2
    assert "--cuda-graphs needs the model on a CUDA GPU" in error_line(err)


def test_capture_has_no_cuda_graphs_flag(capsys):  # it runs the target alone: the flag would do nothing
    argv = ["capture", "--data", "gsm8k-train", "--out", "x"]
    assert cli.build_parser().parse_args(argv).data
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv + ["--cuda-graphs"])
    assert "unrecognized arguments: --cuda-graphs" in capsys.readouterr().err


def test_generate_vocabulary_mismatch(capsys, lm_dir, tmp_path):
    from treespec.drafters import EagleHead

    EagleHead.for_target(tiny_model(vocab=64), eagle3=True).save_pretrained(tmp_path / "head64")
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", str(tmp_path / "head64"),
                     "--prompt", "Hi")
    assert rc == 2
    assert "vocabulary mismatch" in error_line(err) and "--draft ngram" in err


def test_generate_head_for_another_model_says_what_to_do(capsys, lm, lm_dir, tmp_path):
    """--model of one's own with an EAGLE head of another size: the error says what works
    (issue 31: "expects target hidden size 576, the target has 64" and nothing more)."""
    from treespec.drafters import EagleHead

    other = tiny_model(vocab=lm[0].config.vocab_size, hidden=64, layers=5)  # the same vocabulary, wider
    EagleHead.for_target(other, eagle3=True).save_pretrained(tmp_path / "wide-head")
    capsys.readouterr()
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", str(tmp_path / "wide-head"), "--prompt", "Hi")
    assert rc == 2
    line = error_line(err)
    assert "expects target hidden size 64, the target has 32" in line
    for hint in ("--draft ngram", "--draft layers:K", "treespec train-eagle"):
        assert hint in line


def test_draft_model_without_a_tokenizer(capsys, lm, lm_dir, tmp_path):
    lm[0].save_pretrained(tmp_path / "no-tokenizer")
    capsys.readouterr()
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", f"model:{tmp_path / 'no-tokenizer'}",
                     "--prompt", "Hi")
    assert rc == 2
    line = error_line(err)
    assert "has a model but no tokenizer" in line and "tokenizer.save_pretrained" in line
    assert "sentencepiece" not in line


def test_unknown_model_name_answers_at_once_in_one_line(capsys, monkeypatch):
    """Offline, an unknown name took 27-37 s and 22 retry warnings (issue 31): the hub is asked
    only when it answers, and the error is one line."""
    import time

    import treespec.models.loading as model_loading

    def never(*a, **k):
        raise AssertionError("transformers was asked for a name the hub cannot give")

    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, "generate", "--model", "no-such-model-xyz", "--draft", "ngram", "--prompt", "Hi")
    assert rc == 2 and time.perf_counter() - t0 < 15  # this machine as it is: offline here
    assert "'no-such-model-xyz' is not a known name (smollm2-135m-instruct)" in error_line(err)
    monkeypatch.setattr(model_loading, "hub_reachable", lambda timeout=2.0: False)
    monkeypatch.setattr(model_loading, "from_transformers", never)
    rc, _, err = run_cli(capsys, "generate", "--model", "no-such-model-xyz", "--draft", "ngram", "--prompt", "Hi")
    assert rc == 2 and "the hub (huggingface.co) cannot be reached from here" in error_line(err)
    rc, _, err = run_cli(capsys, "generate", "--model", "no such model", "--draft", "ngram", "--prompt", "Hi")
    assert rc == 2 and error_line(err).endswith("or a Hugging Face hub id")


def test_generate_chat_needs_a_template(capsys, lm_dir):
    rc, _, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--chat", "Hi")
    assert rc == 2
    assert "no chat template" in error_line(err)
