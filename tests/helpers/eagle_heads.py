"""EAGLE heads written by hand in the published layouts, and the tiny targets they draft for.

Checkpoints are written under the key names of the published heads, as SafeAILab/EAGLE
(``eagle/model/cnets.py``) reads them: EAGLE-1/2 ``fc`` and ``layers.0.*``; EAGLE-3 ``fc``,
``midlayer.*`` (vLLM's ``layers.0.*``), ``norm``, ``lm_head``, ``d2t`` and ``t2d``. Never with
``EagleHead.save_pretrained``, so a loader that only reads its own writer's files fails the
tests that use them. Random heads rarely draft right, so one hand-set EAGLE-1 head on a
near-bigram target ("informed") gets runs of accepted drafts and multi-token commits.

Sizes: target vocabulary V = 64, hidden H = 32; EAGLE-3 draft vocabulary Vd = 40.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

import treespec
from helpers.tiny import tiny_model
from treespec import TreeConfig
from treespec.drafters.base import DraftStart
from treespec.runner import FINAL_NORM

V, H, VD = 64, 32, 40
E3_LAYERS = 8  # EAGLE-3 reads the states entering layers (2, 4, 5): three distinct layers


# ---- checkpoints in the published layouts ---------------------------------------------------


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)

    def w(out, inp, scale=1.0):  # nn.Linear-like magnitude: activations stay O(1)
        return torch.randn(out, inp, generator=g) * (scale / math.sqrt(inp))

    def norm(n):  # not all ones, so a skipped or misplaced norm shows
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    return g, w, norm


def eagle1_checkpoint(seed: int = 0, bias: bool = True, intermediate: int = 48, heads: int = 4,
                      kv_heads: int = 2, rope_theta: float = 5000.0):
    """(config.json dict, state dict) of an EAGLE-1/2 head, as SafeAILab/EAGLE publishes it."""
    g, w, norm = _weights(seed)
    D = H // heads
    p = "layers.0."
    state = {
        "fc.weight": w(H, 2 * H),  # [H, 2H]: input is cat(embed(token), feature)
        p + "self_attn.q_proj.weight": w(heads * D, H),
        p + "self_attn.k_proj.weight": w(kv_heads * D, H),
        p + "self_attn.v_proj.weight": w(kv_heads * D, H),
        p + "self_attn.o_proj.weight": w(H, heads * D),
        p + "mlp.gate_proj.weight": w(intermediate, H),
        p + "mlp.up_proj.weight": w(intermediate, H),
        p + "mlp.down_proj.weight": w(H, intermediate),
        p + "post_attention_layernorm.weight": norm(H),  # layer 0 has no input_layernorm
    }
    if bias:
        state["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta, "vocab_size": V, "max_position_embeddings": 256,
        "hidden_act": "silu", "torch_dtype": "float16",
    }
    if bias:
        config["bias"] = True
    return config, state


def draft_vocab(seed: int, vd: int = VD):
    """(d2t int64 [vd], t2d bool [V]): a sorted random subset of target ids, injective."""
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randperm(V, generator=g)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(vd), t2d  # target = draft + d2t[draft]


def eagle3_checkpoint(seed: int = 0, vllm: bool = False, intermediate: int = 48, heads: int = 4,
                      kv_heads: int = 2, head_dim: int = 16, rope_theta: float = 50000.0):
    """(config.json dict, state dict) of an EAGLE-3 head; ``vllm`` spells ``midlayer.`` as
    ``layers.0.``. ``head_dim`` differs from H / heads, so it must be read from the config."""
    g, w, norm = _weights(seed)
    p = "layers.0." if vllm else "midlayer."
    d2t, t2d = draft_vocab(seed)
    state = {
        "fc.weight": w(H, 3 * H),  # [H, 3H]: fuses the low, mid and high target states
        p + "self_attn.q_proj.weight": w(heads * head_dim, 2 * H),  # input cat(embeds, hidden)
        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * H),
        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * H),
        p + "self_attn.o_proj.weight": w(H, heads * head_dim),
        p + "hidden_norm.weight": norm(H),
        p + "input_layernorm.weight": norm(H),
        p + "post_attention_layernorm.weight": norm(H),
        p + "mlp.gate_proj.weight": w(intermediate, H),
        p + "mlp.up_proj.weight": w(intermediate, H),
        p + "mlp.down_proj.weight": w(H, intermediate),
        "norm.weight": norm(H),
        "lm_head.weight": w(VD, H),
        "d2t": d2t,
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "vocab_size": V,
        "draft_vocab_size": VD, "max_position_embeddings": 256, "hidden_act": "silu",
        "torch_dtype": "float16",
    }
    return config, state


def informed_eagle1_checkpoint(seed: int = 11):
    """An EAGLE-1 head that drafts well for a near-bigram target (:func:`eagle_target`
    ``"informed"``): fc passes the token embedding through and the layer adds little, so
    the draft logits are close to ``lm_head(embed(token))``, whose argmax is the target's
    when the target's own layers add little. Runs of accepted drafts exercise multi-token
    commits and multi-entry draft extends."""
    config, state = eagle1_checkpoint(seed, bias=False)
    state["fc.weight"] = torch.cat([torch.eye(H), 0.02 * state["fc.weight"][:, H:]], 1)
    state["layers.0.self_attn.o_proj.weight"] *= 0.02
    state["layers.0.mlp.down_proj.weight"] *= 0.02
    return config, state


def stored(state: dict) -> dict:
    """The state as the checkpoint holds it (floating tensors in fp16)."""
    return {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def write_head(path: Path, config: dict, state: dict, fmt: str = "safetensors") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(stored(state), str(path / "model.safetensors"))
    else:
        torch.save(stored(state), str(path / "pytorch_model.bin"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def hf_features(model, tokens, layers) -> torch.Tensor:
    """``[T, F]`` target features from scratch: ``hidden_states[i]`` enters layer i, and
    ``hidden_states[-1]`` is the final (post-norm) state."""
    with torch.no_grad():
        hs = model(torch.tensor([list(tokens)]), output_hidden_states=True).hidden_states
    return torch.cat([hs[-1 if i == FINAL_NORM else i][0] for i in layers], -1)


def drawn_request(eagle_ckpts, kind: str, dtype, seed: int, data):
    """A head of ``kind`` on a copy of its target in ``dtype``, a tree configuration and a
    request drawn by hypothesis: ``(model, drafter, cfg, tokens, n, feats)``, the request's
    first ``n`` of 40 random ``tokens`` prompted, ``feats`` the target's features of all 40."""
    import copy

    from hypothesis import strategies as st

    from helpers.tiny import dynamic_configs

    model = copy.deepcopy(eagle_target(kind, peak=4.0)).to(dtype)  # a copy: the module's targets stay fp32
    drafter = treespec.load_draft(eagle_ckpts(kind)[0], model)
    drafter.head.to(dtype)
    cfg = data.draw(dynamic_configs(max_top_k=4, max_nodes=16))
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, V, (40,), generator=g).tolist()
    n = data.draw(st.integers(1, 12))
    return model, drafter, cfg, full, n, hf_features(model, full, drafter.features_for(model)).to(dtype)


# ---- targets --------------------------------------------------------------------------------

_TARGETS: dict = {}  # made once per session: every test file that asks gets the same model


def eagle_target(kind: str, seed: int = 0, family: str = "llama", peak: float = 60.0):
    """Tiny targets: EAGLE-1/2 heads read 2 layers' output, EAGLE-3 needs >= 6 layers;
    ``"informed"`` is a 2-layer target whose layers are scaled down (nearly a bigram model)."""
    kind = {"eagle3-vllm": "eagle3"}.get(kind, kind)
    key = (kind, seed, family, peak)
    if key not in _TARGETS:
        layers = E3_LAYERS if kind == "eagle3" else 2
        model = tiny_model(family, seed, vocab=V, hidden=H, layers=layers, peak=peak)
        if kind == "informed":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.mul_(0.2)
                    layer.mlp.down_proj.weight.mul_(0.2)
        _TARGETS[key] = model
    return _TARGETS[key]


def start_session(drafter, model, prompts, first, cfg=TreeConfig.chain(2), max_new=32):
    """An EagleSession as the engine starts it, with the target's features computed from scratch
    (:func:`hf_features`)."""
    layers = drafter.features_for(model)
    feats = [hf_features(model, p, layers) for p in prompts]
    return drafter.start(model, DraftStart([list(p) for p in prompts], list(first), feats, max_new, cfg))
