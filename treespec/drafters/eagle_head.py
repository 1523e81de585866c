"""The EAGLE draft head: its module and its checkpoints.

EAGLE-1/2: draft input i is ``fc(cat(embed(token_{i+1}), f_i))`` with ``f_i`` the target's
final (post-norm) hidden state at position i; the head's output goes through the *target's*
``lm_head``. EAGLE-3: ``f_i`` fuses the hidden states entering three target layers (low, mid,
high, :func:`eagle3_feature_layers`) through ``fc``; the layer attends over
``cat(input_layernorm(embed), hidden_norm(hidden))`` and the head has its own ``norm`` and a
``lm_head`` over a reduced draft vocabulary, mapped back to target ids by ``d2t``
(``target = draft + d2t[draft]``).

:class:`EagleHead` holds the weights and the math of one pass; attention is the caller's, so
the same head drafts on treespec's paged cache (:mod:`treespec.drafters.eagle`) and trains on
dense masks (:mod:`treespec.train`). :func:`load_head` reads a checkpoint for a target model,
:meth:`EagleHead.save_pretrained` writes one.

Checkpoint layouts, as the EAGLE authors, vLLM and SGLang publish and read them:
EAGLE-1/2 ``fc.*, layers.0.*``; EAGLE-3 ``fc.*, midlayer.*, norm.*, lm_head.*, d2t, t2d``
(vLLM's ``layers.0.`` spelling of ``midlayer.`` is accepted). Sizes in ``config.json``
(``hidden_size``, ``intermediate_size``, heads, ``draft_vocab_size``, ``target_hidden_size``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half,
)

from ..warn import warn

__all__ = ["EagleHead", "HeadConfig", "load_head", "eagle3_feature_layers"]


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose input states EAGLE-3 fuses (low, mid, high)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class HeadConfig:
    """A head's sizes, read from and written to its ``config.json`` (:meth:`from_json`,
    :meth:`to_json`)."""

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


def load_head(path, target_model) -> EagleHead:
    """The EAGLE-1/2 or EAGLE-3 head in directory ``path`` (``config.json`` and
    ``model.safetensors`` or ``pytorch_model.bin``; the format is detected from them), checked
    against ``target_model`` (vocabulary, hidden sizes, ``d2t``/``t2d``) and placed on its
    device in its dtype, in eval mode. The head borrows the target's embedding (and, EAGLE-1/2,
    its ``lm_head``). Raises FileNotFoundError without a checkpoint, ValueError when it does not
    fit its config or the target."""
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
