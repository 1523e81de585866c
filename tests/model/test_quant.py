"""4-bit and 8-bit weights through torch's CPU kernels (treespec.models.quant, .gguf_blocks).

Tolerances, per output ``y[m, n]``, relative to ``b = |x| @ |W|^T`` (the sum of the absolute
products, what every rounding of the sum scales with):

- fp32: ``K * 2^-24 * b``, the worst-case rounding of a length-K dot product in fp32 summed in
  any order (plus one rounding of ``(q - 8) * scale + zero`` a weight, inside it);
- bf16: ``2^-7 * b``: the output rounded to bf16 (2^-9), the weights rounded to bf16 for the
  kernel's products (2^-9), fp32 sums between; measured here at most 0.0034 b.

The reference is always ``F.linear`` in fp32 on the weights as the format defines them,
computed here from the codes, scales and zeros (rounded to the activations' dtype where the
kernel stores them in it), never from the module.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.tiny import STORIES260K_MISSING, stories260k_gguf, tiny_model
from treespec.drafters.model import ModelDrafter
from treespec.drafters.ngram import NgramDrafter
from treespec.models import load
from treespec.models.gguf_blocks import decode_blocks, gguf_linears
from treespec.models.quant import GROUP_SIZES, Int4Linear, Int8Linear, quantize_linears, weights_format

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=30)
DTYPES = (torch.float32, torch.bfloat16)


def tolerance(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The module's allowed distance from ``F.linear(x, w)`` in fp32, per output (module docstring)."""
    b = x.float().abs() @ w.float().abs().t()
    rel = w.shape[1] * 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -7
    return rel * b + 1e-30


def assert_linear_close(module, w: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, bias=None):
    """``module(x)`` within :func:`tolerance` of ``F.linear`` on ``w`` in fp32."""
    y = module(x.to(dtype))
    assert y.dtype == dtype and y.shape == (*x.shape[:-1], w.shape[0])
    ref = F.linear(x.to(dtype).float(), w.float(), None if bias is None else bias.to(dtype).float())
    err = (y.float() - ref).abs()
    bound = tolerance(x.to(dtype).reshape(-1, x.shape[-1]), w, dtype).view(ref.shape)
    if bias is not None:
        bound = bound + 2.0 ** -8 * bias.float().abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"{dtype}: error {worst:.2f}x the tolerance"


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


# ---- the modules against their formats ----------------------------------------------------


@settings(**SETTINGS)
@given(rows=st.integers(1, 70), blocks=st.integers(1, 3), group=st.sampled_from(GROUP_SIZES),
       tokens=st.sampled_from([(1,), (3,), (16,), (17,), (2, 5)]), copies=st.sampled_from([1, 2]),
       bias=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_int4_linear_is_its_format(rows, blocks, group, tokens, copies, bias, dtype, seed):
    """``(q - 8) * scale + zero`` per group, any row count (padded to 16 inside), the input read
    ``copies`` times against its own columns, any leading shape."""
    g = torch.Generator().manual_seed(seed)
    k = group * blocks
    q = torch.randint(0, 16, (rows, k * copies), generator=g)
    scale = torch.rand(rows, k * copies // group, generator=g) * 0.02
    zero = torch.randn(rows, k * copies // group, generator=g) * 0.05
    b = torch.randn(rows, generator=g) if bias else None
    module = Int4Linear(q, scale, zero, group, b, copies=copies, dtype=dtype)
    s, z = (rounded(t, dtype).repeat_interleave(group, 1) for t in (scale, zero))
    w = ((q.float() - 8) * s + z).view(rows, copies, k).sum(1)  # [N, K]: the copies' columns add up
    x = torch.randn(*tokens, k, generator=g)
    assert_linear_close(module, w, x, dtype, b)
    assert (module.in_features, module.out_features) == (k, rows)
    if dtype == torch.float32:  # the kernel over an identity gives the weight back, to one rounding
        size = ((q.float() - 8).abs() * s + z.abs()).view(rows, copies, k).sum(1)
        assert ((module.dequantize() - w).abs() <= 2.0 ** -22 * size).all()


@settings(**SETTINGS)
@given(rows=st.integers(1, 70), k16=st.integers(1, 12), tokens=st.sampled_from([(1,), (4,), (17,), (2, 3)]),
       bias=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_int8_linear_is_its_format(rows, k16, tokens, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (rows, 16 * k16), generator=g, dtype=torch.int8)
    scale = torch.rand(rows, generator=g) * 0.01
    b = torch.randn(rows, generator=g) if bias else None
    module = Int8Linear(q, scale, b, dtype=dtype)
    w = q.float() * rounded(scale, dtype)[:, None]
    assert_linear_close(module, w, torch.randn(*tokens, 16 * k16, generator=g), dtype, b)


def test_shapes_the_kernels_refuse_are_errors():
    with pytest.raises(ValueError, match="group size"):
        Int4Linear(torch.zeros(16, 32, dtype=torch.long), torch.ones(16, 2), torch.zeros(16, 2), 16)
    with pytest.raises(ValueError, match="multiple of group"):
        Int4Linear(torch.zeros(16, 48, dtype=torch.long), torch.ones(16, 1), torch.zeros(16, 1), 32)
    with pytest.raises(ValueError, match="multiple of 16"):  # torch's bf16 int8 kernel crashes on these
        Int8Linear(torch.zeros(4, 24, dtype=torch.int8), torch.ones(4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128])
def test_quantized_on_load_within_half_a_step(dtype, group):
    """A layer quantized from its weights: each weight within half a step of its group (int4) or
    row (int8), plus the bf16 rounding of the scale; the forward is the dequantized weight's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=True).to(dtype)
    w = linear.weight.float()
    int4 = Int4Linear.from_linear(linear, group)
    groups = w.view(48, -1, group)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(group, 1)
    deq = int4.dequantize().float()
    slack = 0.5 + (0 if dtype == torch.float32 else 0.02)  # a bf16 step is 2^-8 off: codes 0..15 x that
    assert ((deq - w).abs() <= slack * step + 2.0 ** -8 * w.abs()).all()
    assert_linear_close(int4, deq, torch.randn(5, 256), dtype, linear.bias)

    int8 = Int8Linear.from_linear(linear)
    step8 = w.abs().amax(-1, keepdim=True) / 127
    assert ((int8.dequantize() - w).abs() <= 0.5 * step8 * (1 + 2.0 ** -7)).all()
    assert_linear_close(int8, int8.dequantize(), torch.randn(5, 256), dtype, linear.bias)


# ---- GGUF blocks ------------------------------------------------------------------------


def q4_k_blocks(rng, rows: int, supers: int) -> np.ndarray:
    """Random Q4_K super-blocks [rows, supers * 144] (gguf cannot quantize to Q4_K): any bits are
    a valid block once d and dmin are finite float16s."""
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    for i, (lo, hi) in ((0, (1e-4, 0.05)), (2, (1e-4, 0.02))):
        raw[..., i:i + 2] = rng.uniform(lo, hi, (rows, supers, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_decode_to_the_files_weights(kind):
    """Codes, scales and zeros that the int4 kernel's formula turns into exactly what
    ``gguf.quants.dequantize`` reads from the blocks (Q4_1, Q4_K: up to one fp32 rounding of the
    zero)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((40, 512)) * rng.uniform(0.01, 3, (40, 1))).astype(np.float32)
    dense[3, :32] = 0.25  # a flat block: scale 0
    raw = q4_k_blocks(rng, 40, 2) if kind == "Q4_K" else gguf.quants.quantize(dense, qtype)
    file = gguf.quants.dequantize(raw, qtype)  # [40, 512] float32
    codes, scale, zero, copies = decode_blocks(raw, kind)
    assert copies == (2 if kind == "Q8_0" else 1) and codes.shape == (40, 512 * copies)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    s, z = scale.numpy().repeat(32, 1), zero.numpy().repeat(32, 1)
    mine = ((codes.numpy().astype(np.float32) - 8) * s + z).reshape(40, copies, 512).sum(1)
    if kind in ("Q4_1", "Q4_K"):
        np.testing.assert_allclose(mine, file, rtol=0, atol=2.0 ** -22 * np.abs(z).max())
    else:
        np.testing.assert_array_equal(mine, file)
    for dtype in DTYPES:  # and through the kernel: F.linear on the file's weights
        module = Int4Linear(codes, scale, zero, 32, copies=copies, dtype=dtype)
        if dtype == torch.float32:
            assert_linear_close(module, torch.from_numpy(file), torch.randn(3, 512), dtype)
        else:  # against the same blocks with scale and zero rounded to bf16, as stored
            w = ((codes.float() - 8) * rounded(scale, dtype).repeat_interleave(32, 1)
                 + rounded(zero, dtype).repeat_interleave(32, 1)).view(40, copies, 512).sum(1)
            assert_linear_close(module, w, torch.randn(3, 512), dtype)


STORIES = stories260k_gguf()
needs_stories = pytest.mark.skipif(STORIES is None, reason=STORIES260K_MISSING)
# What each linear of the requantized stories260K is stored as; ffn_down (172 inputs) stays F32,
# as llama.cpp leaves a row that no block divides.
REQUANT = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
           "ffn_up": "Q8_0", "output": "Q8_0"}


def write_requantized(source: Path, target: Path) -> Path:
    """stories260K with its linears in Q4_0 / Q4_1 / Q8_0 blocks (:data:`REQUANT`), every other
    field and tensor as the source has it."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        kind = REQUANT.get(tensor.name.split(".")[-2])
        data = np.asarray(tensor.data, dtype=np.float32)
        if kind is None:
            writer.add_tensor(tensor.name, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.fixture(scope="module")
def requantized(tmp_path_factory):
    if STORIES is None:
        pytest.skip(STORIES260K_MISSING)
    return write_requantized(STORIES, tmp_path_factory.mktemp("gguf") / "stories260K-q.gguf")


@functools.cache
def stories_prompt(path: Path) -> list[int]:
    _, tok = load(path)
    return tok("Once upon a time").input_ids


def test_gguf_linears_equal_the_files_dequantized_weights(requantized):
    """Every Q4_0 / Q4_1 / Q8_0 linear of the file (Q and K rows back in rotate-half order)
    against the dense layer the loader de-quantized from the same file, in fp32 and bf16;
    the F32 ffn_down stays dense, and the head only when asked."""
    import gguf

    for dtype in DTYPES:
        dense, _ = load(requantized, dtype=torch.float32)
        model, _ = load(requantized, dtype=dtype)
        summary = gguf_linears(model, requantized, head=True)
        assert len(summary.swapped) == 5 * 6 + 1
        assert {why for _, why in summary.dense} == {"F32 in the file"}
        assert all(".mlp.down_proj" in name for name, _ in summary.dense)
        gmax = {}
        for name in summary.swapped:
            module, w = model.get_submodule(name), dense.get_submodule(name).weight.detach()
            assert isinstance(module, Int4Linear)
            x = torch.randn(4, w.shape[1])
            if dtype == torch.float32:
                assert_linear_close(module, w, x, dtype)
            else:  # scales and zeros rounded to bf16: each weight within 3 x 2^-9 of its group's largest
                groups = w.abs().view(w.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1)
                y, ref = module(x.to(dtype)).float(), F.linear(x.to(dtype).float(), w)
                gmax[name] = ((y - ref).abs() / (2.0 ** -6 * x.to(dtype).float().abs() @ groups.t())).max().item()
        assert all(v <= 1 for v in gmax.values()), max(gmax.items(), key=lambda kv: kv[1])
    assert gguf.GGUFReader(requantized).tensors[3].tensor_type.name == "Q4_1"  # the file is what it says


def test_gguf_weights_generate_as_the_dequantized_model(requantized):
    """fp32: the file's blocks through the kernel make the same greedy text as the model
    de-quantized from the file, and treespec on them (prompt lookup, a draft model) the same as HF
    generate on them."""
    prompt = stories_prompt(requantized)
    dense, _ = load(requantized)
    model, _ = load(requantized, weights="gguf")
    assert weights_format(model) == "dense+int4-g32+int4-g32x2"  # ffn_down and the head dense; Q8_0 split
    ids = torch.tensor([prompt])
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)[0, len(prompt):]
    plain = dense.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert hf.tolist() == plain[0, len(prompt):].tolist()
    draft, _ = load(requantized, weights="gguf")  # a second copy: a draft is never the target itself
    for drafter in (NgramDrafter(), ModelDrafter(draft)):
        out = treespec.generate(model, drafter, "chain-3", [prompt], max_new_tokens=40)
        assert out.sequences[0] == hf.tolist()


def test_gguf_weights_need_blocks_and_a_gguf(tmp_path):
    with pytest.raises(ValueError, match="no .gguf file"):
        load(tmp_path, weights="gguf")
    with pytest.raises(ValueError, match="one of"):
        load(tmp_path, weights="int3")
    if STORIES is not None:  # all F32: nothing to run on the kernels
        with pytest.raises(ValueError, match="holds no linear weights in Q4_0, Q4_1, Q4_K, Q8_0 blocks"):
            load(STORIES, weights="gguf")


# ---- the command line ----------------------------------------------------------------------


def test_cli_generate_on_gguf_blocks_is_their_greedy_text(requantized, capsys, one_thread):
    """``--weights gguf``: the streamed text is HF generate's on the file's blocks."""
    from treespec import cli

    model, tok = load(requantized, weights="gguf")
    ids = torch.tensor([tok("Once upon a time").input_ids])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    expected = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    rc = cli.main(["generate", "--model", str(requantized), "--weights", "gguf", "--dtype", "float32", "--draft",
                   "ngram", "--tree", "chain-3", "--no-pack", "--prompt", "Once upon a time",
                   "--max-new-tokens", "24"])
    out, _ = capsys.readouterr()
    assert rc == 0 and len(expected) > 20 and out.startswith(expected)


def test_cli_weights_errors_are_one_line(tmp_path, capsys, one_thread):
    from helpers.tiny import save_tiny_lm
    from treespec import cli

    folder = save_tiny_lm(tmp_path / "lm")
    capsys.readouterr()  # saving draws transformers' bars
    rc = cli.main(["generate", "--model", str(folder), "--weights", "gguf", "--draft", "ngram", "--prompt", "Hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("treespec: error: --weights gguf: ")
    assert "no .gguf file" in err[0] and "int4" in err[0]


# ---- quantized on load: treespec on the quantized model ------------------------------------


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_treespec_on_quantized_tiny_equals_its_hf_generate(weights, family, one_thread):
    """Greedy treespec (a weak draft model, prompt lookup) on a quantized target: token for
    token its own HF generate, in fp32; every linear but the head quantized."""
    model = tiny_model(family, 3, hidden=64, heads=4, kv_heads=2)
    summary = quantize_linears(model, weights)
    assert len(summary.swapped) == 2 * 7 and [n for n, _ in summary.dense] == ["lm_head"]
    assert weights_format(model) == ("dense+int4-g32" if weights == "int4" else "dense+int8")
    draft = tiny_model(family, 4, hidden=64, heads=4, kv_heads=2, layers=1)
    for prompt in ([1, 5, 9, 5, 9, 5], [7] * 3 + [2, 8, 2, 8, 2]):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        for drafter in (ModelDrafter(draft), NgramDrafter()):
            out = treespec.generate(model, drafter, "cpu-tiny", [prompt], max_new_tokens=24)
            assert out.sequences[0] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_seeds_and_options_hold_on_quantized_weights(weights, one_thread):
    """On a quantized target, as on dense weights (tests/engine/test_generation_options.py):
    greedy with generation options is its own HF generate with the same options, token for
    token, whatever the drafter; a seed fixes the sampled output (temperature, top-p, a
    repetition penalty) whatever the drafter and tree, treespec's own one-token decoding
    (``"none"``) included; another seed changes it."""
    model = tiny_model("llama", 3, hidden=64, heads=4, kv_heads=2)
    quantize_linears(model, weights)
    draft = tiny_model("llama", 4, hidden=64, heads=4, kv_heads=2, layers=1)
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15]
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, **options)
    for drafter in ("none", NgramDrafter(), ModelDrafter(draft)):
        out = treespec.generate(model, drafter, "cpu-tiny", [prompt], max_new_tokens=24, **options)
        assert out.sequences[0] == ref[0, len(prompt):].tolist()
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    runs = {(str(d), tree): treespec.generate(model, d, tree, [prompt], seed=[77], **kw).sequences[0]
            for d in ("none", "ngram", ModelDrafter(draft)) for tree in ("chain-3", "cpu-tiny")}
    assert len({tuple(r) for r in runs.values()}) == 1, runs
    assert treespec.generate(model, "none", "chain-3", [prompt], seed=[78], **kw).sequences[0] != runs["none", "chain-3"]


@needs_stories
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_stories260k_quantized_on_load(weights, one_thread):
    """The F32 file quantized on load: ffn_down stays dense (172 inputs: no int4 group divides
    them, and the int8 kernel needs a multiple of 16); the greedy story stays the model's ("Once upon a time, there was a little girl named
    Lily"), and treespec's output is the quantized model's own."""
    model, tok = load(STORIES, weights=weights)
    prompt = tok("Once upon a time").input_ids
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)[0]
    assert "there was a little girl named Lily" in tok.decode(ref)
    out = treespec.generate(model, NgramDrafter(), "chain-3", [prompt], max_new_tokens=32)
    assert out.sequences[0] == ref[len(prompt):].tolist()
    kinds = {type(m).__name__ for m in model.model.layers[0].mlp.children()}
    assert kinds == {"Int4Linear" if weights == "int4" else "Int8Linear", "Linear", "SiLUActivation"}


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_width_split_runs_the_quantized_copy_up_to_its_rows_and_its_own_weights_above(weights, one_thread):
    """keep_dense: a forward of up to max_rows rows runs the quantized copy, a wider one the dense
    copy, whose weights are what the quantized layer de-quantizes to (fp32: equal within fp32
    rounding), so treespec's greedy output on the split model is its own HF generate's at any
    width, and the format names the split."""
    from treespec.models.quant import WidthSplitLinear, keep_dense, set_split_rows

    model = tiny_model("llama", 3, hidden=64, heads=4, kv_heads=2)
    quantize_linears(model, weights)
    assert keep_dense(model, max_rows=2) == 2 * 7
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, WidthSplitLinear)
    calls = []
    for name in ("quantized", "dense"):
        getattr(layer, name).register_forward_hook(lambda m, i, o, name=name: calls.append((name, i[0].shape[1])))
    x2, x3 = torch.randn(1, 2, 128), torch.randn(1, 3, 128)
    with torch.no_grad():
        layer(x2), layer(x3)
        assert calls == [("quantized", 2), ("dense", 3)]
        w = layer.quantized.dequantize().float()
        torch.testing.assert_close(layer.dense(x3), F.linear(x3, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.quantized(x3), layer.dense(x3), rtol=1e-4, atol=1e-4)
    assert weights_format(model).endswith("split2")
    ids = torch.tensor([[1, 5, 9, 5, 9, 5]])
    for rows in (0, 2, 1 << 30):
        set_split_rows(model, rows)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        out = treespec.generate(model, NgramDrafter(), "cpu-tiny", [ids[0].tolist()], max_new_tokens=16)
        assert out.sequences[0] == ref[0, 6:].tolist()


def test_choose_split_rows_keeps_the_quantized_copy_while_it_is_faster(monkeypatch):
    """The width is the widest from 1 at which the quantized copies ran faster at every width
    so far (a fake clock: quantized faster at 1 and 2 rows, slower from 4)."""
    from treespec import split_choice
    from treespec.models.quant import keep_dense

    model = tiny_model("llama", 3, hidden=64, heads=4, kv_heads=2)
    quantize_linears(model, "int4")
    keep_dense(model)

    def fake_forward(runner, max_tokens, clock):
        def once(q):
            quantized = model.model.layers[0].mlp.down_proj.max_rows > 1000
            return q * (0.5 if quantized and q <= 2 else 2.0 if quantized else 1.0)
        return once

    monkeypatch.setattr(split_choice, "prefixed_forward", fake_forward)
    rows, times = split_choice.choose_split_rows(model)
    assert rows == 2 and times[1] == (0.5, 1.0) and times[4] == (8.0, 4.0)
    assert model.model.layers[1].self_attn.q_proj.max_rows == 2
    assert split_choice.choose_split_rows(tiny_model("llama", 3)) == (0, {})  # no split layers: untouched


def test_packing_leaves_quantized_layers_and_keys_by_format():
    """oneDNN packing takes the dense layers left (the head); its cached timings are per format."""
    from treespec.packing import PackedLinear, PackedLinears, packing_supported
    from treespec.pack_choice import packing_key

    keys = {}
    for weights in ("dense", "int4", "int8"):
        model = tiny_model("llama", 0, hidden=64)
        if weights != "dense":
            quantize_linears(model, weights)
        keys[weights] = packing_key(model)
        if packing_supported(model):
            ids = torch.tensor([[1, 2, 3]])
            ref = model(ids).logits
            with PackedLinears(model) as packed:
                assert len(packed) == (1 if weights != "dense" else 2 * 7 + 1)
                assert isinstance(model.lm_head, PackedLinear)
                torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)
    assert len({key["weights"] for key in keys.values()}) == 3


def test_quantize_refuses_what_it_cannot_make():
    model = tiny_model("llama", 0)
    with pytest.raises(ValueError, match="int4 or int8"):
        quantize_linears(model, "gguf")
    with pytest.raises(ValueError, match="group size"):
        quantize_linears(model, "int4", group=48)
    assert weights_format(model) == "dense"


# ---- the shipped target ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_runs_its_own_q4_1_blocks(smollm2, dtype):
    """SmolLM2's 210 Q4_1 linears from the GGUF it ships as, each against the dense layer the
    converted copy holds (transformers' de-quantization and rotary order); its Q8_0 tied head
    through the split when asked."""
    from treespec.models import MODELS

    dense = smollm2[0]
    model, _ = load("smollm2-135m-instruct", dtype=dtype)
    summary = gguf_linears(model, MODELS["smollm2-135m-instruct"].locate(None), head=True)
    assert len(summary.swapped) == 211 and not summary.dense
    assert model.lm_head.copies == 2  # Q8_0: two 4-bit halves
    torch.manual_seed(0)
    for name in (*summary.swapped[::7], "lm_head"):
        module, w = model.get_submodule(name), dense.get_submodule(name).weight.detach()
        x = torch.randn(3, w.shape[1])
        if dtype == torch.float32:
            assert_linear_close(module, w, x, dtype)
        else:
            groups = w.abs().view(w.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1)
            y, ref = module(x.to(dtype)).float(), F.linear(x.to(dtype).float(), w)
            assert ((y - ref).abs() <= 2.0 ** -6 * (x.to(dtype).float().abs() @ groups.t())).all(), name


@pytest.mark.slow
def test_smollm2_gguf_weights_greedy_is_its_own(smollm2):
    """bf16, the shipped pair on the GGUF's own blocks: treespec's greedy output is HF generate's
    on the same quantized model."""
    from treespec.drafters import load_draft

    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16, weights="gguf")
    assert weights_format(model) == "int4-g32+int4-g32x2"  # the layers Q4_1, the tied output head Q8_0 (two copies)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 times 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok(text).input_ids
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    draft = load_draft("smollm2-135m-instruct-eagle", model)
    out = treespec.generate(model, draft, "chain-3", [prompt], max_new_tokens=32)
    assert out.sequences[0] == ref[0, len(prompt):].tolist()
