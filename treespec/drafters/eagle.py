"""EAGLE draft heads: a one-layer decoder that reads the target's own hidden states.

EAGLE-1/2 (:class:`EagleDrafter`): draft input i is ``fc(cat(embed(token_{i+1}), f_i))``
with ``f_i`` the target's final (post-norm) hidden state at position i; the head's output
goes through the *target's* ``lm_head``. EAGLE-3 (:class:`Eagle3Drafter`): ``f_i`` fuses
the hidden states entering three target layers (low, mid, high) through ``fc``; the layer
attends over ``cat(input_layernorm(embed), hidden_norm(hidden))`` and the head has its own
``norm`` and a ``lm_head`` over a reduced draft vocabulary, mapped back to target ids by
``d2t`` (``target = draft + d2t[draft]``).

The shift by one: the draft's entry i pairs the target state at position i with the token
*after* it, so the entry for the last committed position pairs with the root token and
predicts the root's children. When a tree node of depth d is drafted, its "feature" is its
parent's draft output (the head's guess of the target state), its position is the root's
draft position + d. After each commit the head is re-run on the accepted tokens with the
target's real features ("draft extend"); its tree entries are dropped.

Checkpoint layouts (facts.md section 2) are read and written as published: EAGLE-1/2
``fc.*, layers.0.*``; EAGLE-3 ``fc.*, midlayer.*, norm.*, lm_head.*, d2t, t2d`` (vLLM's
``layers.0.`` spelling of ``midlayer.`` is accepted).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half,
)

from ..attention import TorchBackend, get_backend, kv_dtype, make_batch
from ..builder import Frontier, build_trees
from ..kv_cache import PagedKVCache
from ..runner import FINAL_NORM
from ..warn import warn
from .base import DraftSession, DraftStart, Drafter
from .graphs import GraphedRow, StaticPasses

__all__ = ["EagleHead", "EagleDrafter", "Eagle3Drafter", "load_draft", "eagle3_feature_layers"]

log = logging.getLogger(__name__)


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose input states EAGLE-3 fuses (low, mid, high)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    eagle3: bool
    draft_vocab_size: int
    target_hidden_size: int
    fc_bias: bool = False
    attn_bias: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def from_json(cls, cfg: dict, state: dict) -> "HeadConfig":
        H = cfg["hidden_size"]
        q = state.get("midlayer.self_attn.q_proj.weight", state.get("layers.0.self_attn.q_proj.weight"))
        eagle3 = ("draft_vocab_size" in cfg or "d2t" in state
                  or any(k.startswith("midlayer.") for k in state)
                  or (q is not None and q.shape[1] == 2 * H))  # EAGLE-3 attends over [embed, hidden]
        H = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        for key in ("rope_scaling", "rope_parameters"):
            rs = cfg.get(key) or {}
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind not in ("default", None):
                raise ValueError(f"EAGLE head {key} of type {kind!r} is not supported (only default RoPE)")
        prefix = "midlayer." if eagle3 else "layers.0."
        return cls(
            hidden_size=H,
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or H // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope),
            vocab_size=cfg["vocab_size"],
            eagle3=eagle3,
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or H,
            fc_bias="fc.bias" in state,
            attn_bias=f"{prefix}self_attn.q_proj.bias" in state or "layers.0.self_attn.q_proj.bias" in state,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        )

    def to_json(self) -> dict:
        out = {
            "architectures": ["LlamaForCausalLMEagle3" if self.eagle3 else "LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float16",
            # SGLang ties lm_head to the embedding when this is true (treespec.export).
            "tie_word_embeddings": False,
            # Always written: the EAGLE reference reads a missing "bias" as true and would
            # give an EAGLE-1/2 fc a random bias; SGLang reads it for the EAGLE-3 fc.
            "bias": self.fc_bias,
        }
        if self.eagle3:
            out["draft_vocab_size"] = self.draft_vocab_size
            # Only when it differs: with the key present the EAGLE reference no longer copies
            # the target's embedding, and a head without embed_tokens.weight (treespec's)
            # would draft from a random one. vLLM and SGLang size fc the same either way.
            if self.target_hidden_size != self.hidden_size:
                out["target_hidden_size"] = self.target_hidden_size
        return out

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, hidden_act="silu", vocab_size=self.vocab_size,
        )


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        inp = 2 * c.hidden_size if c.eagle3 else c.hidden_size
        self.q_proj = nn.Linear(inp, c.num_heads * c.head_dim, bias=c.attn_bias)
        self.k_proj = nn.Linear(inp, c.num_kv_heads * c.head_dim, bias=c.attn_bias)
        self.v_proj = nn.Linear(inp, c.num_kv_heads * c.head_dim, bias=c.attn_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        lc = c.llama_config()
        self.self_attn = _Attention(c)
        self.mlp = LlamaMLP(lc)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.eagle3:
            self.input_layernorm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)


class EagleHead(nn.Module):
    """The draft head's weights and math; attention is supplied by the caller so the same
    head runs on treespec's paged cache (inference) or on dense masks (training).

    ``embed`` and (EAGLE-1/2) ``lm_head`` are the target's, held by reference and frozen.
    """

    def __init__(self, c: HeadConfig, embed: nn.Embedding, target_lm_head: nn.Module | None):
        super().__init__()
        self.config = c
        F_in = 3 * c.target_hidden_size if c.eagle3 else 2 * c.hidden_size
        self.fc = nn.Linear(F_in, c.hidden_size, bias=c.fc_bias)
        self.layer = _Layer(c)
        self.rotary = LlamaRotaryEmbedding(config=c.llama_config())
        self._embed = [embed]  # a list: not registered as a submodule, never saved
        self._target_lm_head = [target_lm_head]
        if c.eagle3:
            self.norm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))

    @classmethod
    def for_target(cls, target_model, eagle3: bool = True, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None) -> "EagleHead":
        """A freshly initialised head shaped for ``target_model`` (for training)."""
        tc = target_model.config
        V, H = target_model.get_input_embeddings().weight.shape
        heads = tc.num_attention_heads
        c = HeadConfig(
            hidden_size=H, intermediate_size=intermediate_size or tc.intermediate_size,
            num_heads=heads, num_kv_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or H // heads, rms_norm_eps=tc.rms_norm_eps,
            rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            vocab_size=V, eagle3=eagle3, draft_vocab_size=(draft_vocab_size or V) if eagle3 else V,
            target_hidden_size=tc.hidden_size,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        )
        head = cls(c, target_model.get_input_embeddings(), None if eagle3 else target_model.get_output_embeddings())
        if eagle3:
            head.d2t.zero_()
            head.t2d.zero_()
            head.t2d[: c.draft_vocab_size] = True  # identity mapping until trained
        p = next(target_model.parameters())
        return head.to(device=p.device, dtype=p.dtype)

    # ---- pieces -------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embed[0](tokens)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[T, F]`` -> head input states ``[T, H]`` (EAGLE-3 ``fc``)."""
        return self.fc(features) if self.config.eagle3 else features

    def qkv_input(self, tokens: torch.Tensor, hidden: torch.Tensor):
        """Returns ``(attention input, residual)`` for tokens ``[T]`` and states ``[T, H]``."""
        e = self.embed(tokens).to(hidden.dtype)
        if self.config.eagle3:
            x = torch.cat([self.layer.input_layernorm(e), self.layer.hidden_norm(hidden)], -1)
            return x, hidden
        x = self.fc(torch.cat([e, hidden], -1))
        return x, x

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[length, D]`` for positions ``0 .. length-1``, as :attr:`rotary`
        computes them (each entry one product and one cos/sin, so a row does not depend on the
        other positions computed with it), kept and grown as sessions ask for longer ones."""
        p = next(self.parameters())
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < length or table[0].dtype != p.dtype or table[0].device != p.device:
            n = max(length, 2 * table[0].shape[0] if table is not None else 0)
            x = torch.empty(0, dtype=p.dtype, device=p.device)
            with torch.inference_mode():
                cos, sin = self.rotary(x, torch.arange(n, device=p.device)[None])
            self._rope_table = table = (cos[0], sin[0])
        return table

    def forget_rope_table(self) -> None:
        """Drop the kept ``(cos, sin)`` table (after the rotary frequencies changed, e.g. a cast)."""
        self._rope_table = None

    def forward(self, tokens, hidden, positions, attend, rope=None) -> torch.Tensor:
        """One head pass.

        Args:
            tokens:    int64 ``[T]``: the token each entry pairs with.
            hidden:    ``[T, H]``: target features after :meth:`project`, or draft outputs.
            positions: int64 ``[T]`` RoPE positions.
            attend:    ``(q [T, Hq, D], k [T, Hkv, D], v) -> [T, Hq, D]``.
            rope:      ``(cos, sin)`` ``[T, D]`` of ``positions`` (rows of :meth:`rope_table`),
                       or None to compute them.
        Returns:
            ``[T, H]`` output states (fed to the next depth and to :meth:`logits`).
        """
        c = self.config
        x, residual = self.qkv_input(tokens, hidden)
        a = self.layer.self_attn
        T = x.shape[0]
        q = a.q_proj(x).view(T, c.num_heads, c.head_dim)
        k = a.k_proj(x).view(T, c.num_kv_heads, c.head_dim)
        v = a.v_proj(x).view(T, c.num_kv_heads, c.head_dim)
        if rope is None:
            cos, sin = self.rotary(x, positions[None])
            q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
        else:  # the same arithmetic on [T, H, D], heads broadcast
            cos, sin = rope[0][:, None], rope[1][:, None]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = attend(q, k, v).reshape(T, c.num_heads * c.head_dim)
        h = residual + a.o_proj(o)
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, V_draft]`` (EAGLE-3: draft vocabulary; EAGLE-1/2: the target's)."""
        if self.config.eagle3:
            return self.lm_head(self.norm(h))
        return self._target_lm_head[0](h)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.config.eagle3 else ids

    # ---- checkpoints --------------------------------------------------------------------

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the published key names."""
        prefix = "midlayer." if self.config.eagle3 else "layers.0."
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("rotary."):
                continue
            out[k.replace("layer.", prefix, 1) if k.startswith("layer.") else k] = v
        return out

    def save_pretrained(self, path, dtype=torch.float16) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
            for k, v in self.public_state_dict().items()
        }
        save_file(state, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(self.config.to_json(), indent=2) + "\n")


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    st = path / "model.safetensors"
    if st.exists():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = path / "pytorch_model.bin"
    if pt.exists():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} has neither model.safetensors nor pytorch_model.bin")


def _head_from_dir(path, target_model) -> EagleHead:
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no EAGLE checkpoint at {path}: config.json is missing")
    cfg = json.loads((path / "config.json").read_text())
    state = _read_state(path)
    c = HeadConfig.from_json(cfg, state)
    if c.eagle3:  # vLLM writes midlayer.* as layers.0.*
        state = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in state.items()}
    _check_fit(c, state, target_model)
    emb = target_model.get_input_embeddings()
    head = EagleHead(c, emb, None if c.eagle3 else target_model.get_output_embeddings())
    prefix = "midlayer." if c.eagle3 else "layers.0."
    ours = {}
    for k, v in state.items():
        if k.startswith(prefix):
            ours["layer." + k[len(prefix):]] = v
        elif k == "embed_tokens.weight" or (k == "lm_head.weight" and not c.eagle3):
            # The target's are used (EAGLE trains with them frozen); some EAGLE-3
            # checkpoints ship a copy of the embedding, which vLLM also accepts.
            if k == "embed_tokens.weight" and not (  # equal up to the checkpoint's rounding
                v.shape == emb.weight.shape
                and torch.allclose(v.float(), emb.weight.detach().float().cpu(), rtol=1e-2, atol=1e-4)
            ):
                warn(f"{path} ships an embed_tokens.weight that differs from the target's; "
                     "the target's embedding is used")
            continue
        else:
            ours[k] = v
    if c.eagle3 and c.draft_vocab_size == c.vocab_size:  # a full draft vocabulary may omit the maps
        ours.setdefault("d2t", torch.zeros(c.vocab_size, dtype=torch.int64))
        ours.setdefault("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
    try:
        missing, unexpected = head.load_state_dict(ours, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"EAGLE checkpoint {path} does not fit its config: {e}") from None
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"EAGLE checkpoint {path} does not fit the layout: missing {missing}, unexpected {unexpected}")
    p = next(target_model.parameters())
    return head.to(device=p.device, dtype=p.dtype).eval()


def _check_fit(c: HeadConfig, state: dict, target_model) -> None:
    tc = target_model.config
    tv = target_model.get_input_embeddings().weight.shape[0]
    th = tc.hidden_size
    if c.vocab_size != tv:
        raise ValueError(f"vocabulary mismatch: the EAGLE head was made for {c.vocab_size} tokens, the target has {tv}")
    if c.eagle3:
        d2t = state.get("d2t")
        if d2t is not None:
            ids = torch.arange(d2t.numel()) + d2t.to(torch.int64)
            if d2t.numel() != c.draft_vocab_size or ids.min() < 0 or ids.max() >= tv or ids.unique().numel() != ids.numel():
                raise ValueError("EAGLE-3 d2t must map each draft id to a distinct target id within the vocabulary")
        t2d = state.get("t2d")
        if d2t is not None and t2d is not None:
            if t2d.numel() != tv or int(t2d.sum()) != d2t.numel() or not bool(t2d.bool()[ids].all()):
                raise ValueError("EAGLE-3 t2d must mark exactly the target ids that d2t maps to")
        if c.target_hidden_size != th:
            raise ValueError(f"EAGLE-3 head expects target hidden size {c.target_hidden_size}, the target has {th}")
        w = state.get("fc.weight")
        if w is not None and tuple(w.shape) != (c.hidden_size, 3 * th):
            raise ValueError(f"EAGLE-3 fc.weight is {tuple(w.shape)}, expected {(c.hidden_size, 3 * th)} for this target")
        if c.hidden_size != target_model.get_input_embeddings().weight.shape[1]:
            raise ValueError("EAGLE-3 head hidden size differs from the target's embedding size")
    else:
        if c.hidden_size != th:
            raise ValueError(f"EAGLE head hidden size {c.hidden_size} differs from the target's {th}")
        w = state.get("fc.weight")
        if w is not None and tuple(w.shape) != (th, 2 * th):
            raise ValueError(f"EAGLE fc.weight is {tuple(w.shape)}, expected {(th, 2 * th)}")


class EagleDrafter(Drafter):
    """An EAGLE-1/2 head: ``EagleDrafter.from_pretrained(path, target_model)``.

    ``cuda_graphs``: on a CUDA device, run a single request's head passes (tree levels, commits)
    on fixed shapes and replay each shape from a CUDA graph captured on its first use and kept
    for the next requests (:mod:`treespec.drafters.graphs`); batches of several requests run
    eagerly.
    """

    def __init__(self, head: EagleHead, attention_backend: str = "auto", page_size: int = 16,
                 cuda_graphs: bool = False):
        self.head = head
        self.attention_backend = attention_backend
        self.page_size = page_size
        self.cuda_graphs = cuda_graphs
        self.graphed_row = GraphedRow()  # the graphs and their cache row, lent to one session at a time

    @classmethod
    def from_pretrained(cls, path, target_model, **kw):
        head = _head_from_dir(path, target_model)
        if head.config.eagle3 and cls is EagleDrafter:
            raise ValueError(f"{path} is an EAGLE-3 checkpoint: use Eagle3Drafter or treespec.load_draft")
        if not head.config.eagle3 and cls is Eagle3Drafter:
            raise ValueError(f"{path} is an EAGLE-1/2 checkpoint: use EagleDrafter or treespec.load_draft")
        return _with_calibration(cls(head, **kw), path)

    def modules(self):
        return (self.head,)

    def features_for(self, model):
        if self.head.config.eagle3:
            return eagle3_feature_layers(model.config.num_hidden_layers)
        return (FINAL_NORM,)

    def check_compatible(self, model) -> None:
        if self.head._embed[0] is not model.get_input_embeddings():
            raise ValueError("this EAGLE head was loaded for another target model: load it with this target")

    def prefix_key(self, model):
        p = next(self.head.parameters())
        return (self.head, "eagle", str(p.dtype), str(p.device), self.features_for(model))

    def start(self, model, ctx: DraftStart) -> "EagleSession":
        if ctx.features is None:
            raise RuntimeError("EAGLE drafters need target features")
        return EagleSession(self, ctx)

    def __repr__(self):
        c = self.head.config
        kind = "EAGLE-3" if c.eagle3 else "EAGLE-1/2"
        graphs = ", CUDA graphs" if self.cuda_graphs else ""
        return f"{type(self).__name__}({kind}, hidden {c.hidden_size}, draft vocab {c.draft_vocab_size}{graphs})"


class Eagle3Drafter(EagleDrafter):
    """An EAGLE-3 head (fused features, reduced draft vocabulary)."""


def load_draft(path_or_name, target_model, **kw) -> EagleDrafter:
    """Load an EAGLE-1/2 or EAGLE-3 head from a directory or a shipped name; the format is
    detected from the checkpoint."""
    from ..assets import resolve_draft

    path = resolve_draft(path_or_name)
    head = _head_from_dir(path, target_model)
    return _with_calibration((Eagle3Drafter if head.config.eagle3 else EagleDrafter)(head, **kw), path)


def _with_calibration(drafter: EagleDrafter, path) -> EagleDrafter:
    """``auto`` starts from the head's own calibrations when its directory has them."""
    from ..auto import AutoProfile

    drafter.auto_calibration = AutoProfile.head_calibration(path)
    return drafter


class EagleSession(DraftSession):
    def __init__(self, drafter: EagleDrafter, ctx: DraftStart):
        self.head = head = drafter.head
        c = head.config
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.backend = get_backend(drafter.attention_backend, self.device)
        self.cfg = ctx.tree_cfg
        self.stop = ctx.stop
        self.ctx = ctx
        self.to_draft = None  # target id -> draft id (-1: none), for a head with its own vocabulary
        if c.eagle3 and ctx.rules is not None and any(ctx.rules):
            ids = torch.arange(c.draft_vocab_size, device=head.d2t.device)
            self.to_draft = torch.full((c.vocab_size,), -1, dtype=torch.int64)
            self.to_draft[head.draft_to_target(ids).cpu()] = ids.cpu()
        self.room = room = ctx.tree_cfg.depth * ctx.tree_cfg.top_k + ctx.tree_cfg.num_nodes + 2
        longest = max(len(pr) for pr in ctx.prompts) + ctx.max_new_tokens + room

        def rows(count, tokens):
            return PagedKVCache.with_rows(1, c.num_kv_heads, c.head_dim, count, tokens, drafter.page_size,
                                          kv_dtype(self.dtype, self.device), self.device)

        self.static: StaticPasses | None = None
        self._graphed: GraphedRow | None = None
        lent = None
        if drafter.cuda_graphs:
            if self.device.type != "cuda" and drafter.graphed_row.capture:
                raise ValueError(f"cuda_graphs=True needs the draft head on a CUDA device; it is on {self.device}")
            if len(ctx.prompts) > 1:
                log.warning("CUDA graphs serve one request at a time: these %d requests are drafted eagerly",
                            len(ctx.prompts))
            else:
                lent = drafter.graphed_row.lend(self, head, longest, room, lambda tokens: rows(1, tokens))
                if lent is None:
                    log.warning("CUDA graphs: another session holds this drafter's graphs; this one drafts eagerly")
        if lent is not None:
            self._graphed = drafter.graphed_row
            self.cache, seq, graphed = lent
            self.seq = [seq]
        else:
            self.cache, self.seq = rows(len(ctx.prompts), longest)
        self.root_logp: dict[int, torch.Tensor] = {}
        self.root_state: dict[int, torch.Tensor] = {}
        # One request on a CPU: the lean pass of _run_one (no batch plan; RoPE from a table).
        self.lean = isinstance(self.backend, TorchBackend) and self.device.type == "cpu"
        self.rope = head.rope_table(self.cache.capacity(self.seq[0])) if self.lean else None
        tokens, features = [], []
        for r, (pr, t, f) in enumerate(zip(ctx.prompts, ctx.first_tokens, ctx.features)):
            hit = ctx.prefix[r] if ctx.prefix is not None else None
            if hit is None:
                tokens.append(pr[1:] + [t])
                features.append(f)
                continue
            # Entries 0..n-2 from the cache (row t holds entry t-1); entry n-1 pairs the
            # feature kept at n-1 with the first uncached token, as without the cache.
            self.cache.load(self.seq[r], hit.rows["kv"][1: hit.length])
            tokens.append(pr[hit.length:] + [t])
            features.append(torch.cat([hit.feature[None].to(f), f]))
        self._extend(list(range(len(ctx.prompts))), tokens, features)
        if lent is not None:  # after the prompt's pass, which has a shape of its own and runs once
            self.static = graphed

    def use_static_passes(self, capture: bool) -> None:
        """Run the one request's head passes on fixed shapes (:class:`StaticPasses` over its row of
        this session's cache), each shape captured in a CUDA graph with ``capture`` (tests and
        benchmarks; ``cuda_graphs=True`` uses the drafter's :class:`GraphedRow` instead)."""
        if len(self.seq) != 1:
            raise ValueError(f"static passes serve one request; this session drafts {len(self.seq)}")
        self.static = StaticPasses.over_row(self.head, self.cache, self.seq[0], capture, self.room)

    @torch.inference_mode()
    def _run(self, requests, tokens, hidden, positions, masks, extra_keys=None):
        """Head pass over each request's new entries; returns the per-request output states
        and, where the pass computed them (the static passes), their log-probabilities, else
        None."""
        if (self.lean or self.static is not None) and len(requests) == 1:
            out = self._run_one(requests[0], tokens[0], hidden[0], positions[0], masks[0])
            if out is not None:
                states, logp = out
                return [states], None if logp is None else [logp]
        seqs = [self.seq[r] for r in requests]
        prefix = [self.cache.seq_lens[s] for s in seqs]
        kpos = [p if extra_keys is None else torch.cat([extra_keys[i], p]) for i, p in enumerate(positions)]
        batch = make_batch(self.cache, seqs, prefix, masks, kpos, self.backend)

        def attend(q, k, v):
            self.cache.write(0, batch.write_slots, k, v)
            return self.backend.run(batch, 0, q, self.head.config.head_dim ** -0.5)

        toks = torch.cat(tokens).to(self.device)
        h = self.head(toks, torch.cat(hidden).to(self.dtype), torch.cat(positions).to(self.device), attend)
        return list(torch.split(h, [t.numel() for t in tokens])), None

    def _run_one(self, request, tokens, hidden, positions, mask):
        """:meth:`_run` for one request whose entries lie in its row of the cache, with the
        torch backend's arithmetic (fp32 SDPA over the row's keys) and none of its batch
        planning, which costs more than the head's attention itself. Returns ``(states,
        log-probs)``, the log-probs None unless static passes computed them, or None when the
        row cannot hold the entries (the general pass then runs)."""
        cache, seq = self.cache, self.seq[request]
        L = cache.seq_lens[seq]
        n, m = mask.shape
        kv = L + m
        block = cache.block_rows([seq], kv)
        if block is None or n > m:
            return None
        cache.reserve(seq, kv)
        if self.static is not None:
            out = self.static.run(tokens.to(self.device), hidden, positions.to(self.device), mask, L)
            if out is not None or not self.lean:
                return out
        first, stride, (row,) = block
        start = first + row * stride
        full = torch.ones(n, kv, dtype=torch.bool)
        full[:, L:] = mask
        full = full.to(self.device)[None, None]
        scale = self.head.config.head_dim ** -0.5

        def attend(q, k, v):
            fk, fv = cache.flat(0)
            fk[start + kv - n: start + kv] = k.to(fk.dtype)
            fv[start + kv - n: start + kv] = v.to(fv.dtype)
            keys = fk[start: start + kv].transpose(0, 1).to(torch.float32)[None]
            values = fv[start: start + kv].transpose(0, 1).to(torch.float32)[None]
            out = F.scaled_dot_product_attention(q.to(torch.float32).transpose(0, 1)[None], keys, values,
                                                 attn_mask=full, scale=scale,
                                                 enable_gqa=keys.shape[1] != q.shape[1])
            return out[0].transpose(0, 1).to(q.dtype)

        pos = positions.to(self.device)
        rope = (self.rope[0][pos], self.rope[1][pos])
        return self.head(tokens.to(self.device), hidden.to(self.dtype), pos, attend, rope), None

    def _extend(self, requests, tokens, features):
        """Draft extend: entries (f_i, token_i) for committed tokens, then the root's
        log-probs and state for the next tree."""
        if not requests:
            return
        from ..mask import causal_mask

        toks = [torch.tensor(t, dtype=torch.int64) for t in tokens]
        with torch.inference_mode():
            hid = [self.head.project(f.to(self.device, self.dtype)) for f in features]
        pos = [torch.arange(self.cache.seq_lens[self.seq[r]], self.cache.seq_lens[self.seq[r]] + len(t))
               for r, t in zip(requests, tokens)]
        out, logps = self._run(requests, toks, hid, pos, [causal_mask(len(t)) for t in tokens])
        with torch.inference_mode():
            for i, (r, t, h) in enumerate(zip(requests, tokens, out)):
                s = self.seq[r]
                L = self.cache.seq_lens[s]
                self.cache.commit(s, torch.arange(L, L + len(t)))
                last = h[-1:]
                self.root_state[r] = last
                self.root_logp[r] = (logps[i][-1] if logps is not None
                                     else self.head.logits(last)[0].float().log_softmax(-1))

    def propose(self, requests, roots, max_depth):
        requests = list(requests)
        seqs = [self.seq[r] for r in requests]
        base = [self.cache.seq_lens[s] for s in seqs]  # the root's entry is at base - 1
        tree_pos = torch.zeros(0, dtype=torch.int64)
        head = self.head

        def step(f: Frontier):
            nonlocal tree_pos
            k = f.tokens.shape[1]
            pos = torch.full((k,), f.depth, dtype=torch.int64)
            tok = head.draft_to_target(f.tokens.to(self.device))
            out, logps = self._run(
                requests, list(tok), list(f.parent_state), [b - 1 + pos for b in base],
                list(f.ancestors.cpu()), extra_keys=[b - 1 + tree_pos for b in base],
            )
            tree_pos = torch.cat([tree_pos, pos])
            h = torch.stack(out)  # [B, k, H]
            if logps is not None:
                return torch.stack(logps), h
            with torch.inference_mode():
                logp = head.logits(h).float().log_softmax(-1)
            return logp, h

        root_logp = torch.stack([self.root_logp[r] for r in requests])
        root_state = torch.stack([self.root_state[r] for r in requests])  # [B, 1, H]
        # The builder works in draft ids; roots are target ids and are restored below.
        constrain = self.ctx.constrain_for(requests, lambda ids: head.draft_to_target(ids.to(self.device)).cpu(),
                                           self.to_draft)
        trees = build_trees(torch.zeros(len(requests), dtype=torch.int64), root_logp, step, self.cfg, root_state,
                            stop=self.stop, constrain=constrain)
        for s, b in zip(seqs, base):
            self.cache.truncate(s, b)
        out = []
        for t, root in zip(trees, roots):
            toks = head.draft_to_target(t.tokens.to(self.device)).cpu()
            toks[0] = root
            out.append(t.with_tokens(toks, t.scores))
        return out

    def commit(self, requests, tokens, features):
        self._extend(list(requests), [list(t) for t in tokens], features)

    def close(self):
        """Give the drafter's graphed row back (its one request finished, or generation ended);
        the session drafts no more."""
        self.static = None
        if self._graphed is not None:
            self._graphed.give_back(self)

    def prefix_state(self, request, start):
        """Row t: the head's entry t-1 (``kv`` ``[2, 1, Hkv, D]``), the entry that pairs
        position t-1 with token t, so a page's rows hold for whatever follows the page; row 0
        is empty."""
        s = self.seq[request]
        entries = self.cache.read(s, max(start - 1, 0), max(self.cache.seq_lens[s] - 1, 0))
        if start == 0:
            entries = torch.cat([entries.new_zeros((1, *entries.shape[1:])), entries])
        return {"kv": entries}

    def finish(self, request):
        if self._graphed is not None:  # the row stays with the drafter, for the next session
            self.close()
        else:
            self.cache.free_sequence(self.seq[request])
        self.root_logp.pop(request, None)
        self.root_state.pop(request, None)
