"""Training an EAGLE head for a target model, on a CPU if need be.

Pipeline (each stage resumable from ``out_dir``):

1. **Capture** (``captured.pt``): per conversation, the token ids, the target features at
   every position (EAGLE-3: the states entering layers low/mid/high; EAGLE-1/2: the final
   post-norm state) and the target's greedy next token at every position (the label).
   With ``regenerate=True`` the answers are first replaced by the target's own greedy
   replies (self-distillation): features are captured during that generation, and the
   labels are the generated tokens themselves.
2. **Vocabulary** (EAGLE-3 with a reduced draft vocabulary): the ``draft_vocab_size`` most
   frequent label tokens, sorted by id, give ``d2t``/``t2d``.
3. **Train** with training-time test (EAGLE-3): step 1 runs the head on real features;
   step s feeds the head's own step-(s-1) outputs back as features, attending as a
   depth-(s-1) tree node would (to the real prefix and to its own chain of ancestors).
   Loss: cross-entropy against the target's greedy token, weighted ``0.8**(s-1)``.
4. **Save** the head in the public EAGLE-3 (or EAGLE-1/2) layout, fp16 safetensors.

Why EAGLE-3-style training: the drafted tree is deeper than one step, and from depth 2 on
the head reads its own outputs. Training on exactly that (training-time test) is what the
EAGLE-3 paper credits for acceptance that keeps growing with data; EAGLE-1's feature
regression only approximates it. A reduced draft vocabulary cuts the head's largest cost
on a CPU (the output projection: 49152 x 576 for SmolLM2).
"""

from __future__ import annotations

import ctypes
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..drafters.eagle import EagleHead
from .shards import load_shards
from .data import DataStats, read_jsonl, tokenize_example
from .records import Progress, feature_ids, generated_records, teacher_forced_records

__all__ = ["TrainConfig", "train_eagle", "capture", "Progress", "validate", "keep_freed_memory", "time_train_steps"]

log = logging.getLogger(__name__)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what a training step frees for the next step (blocks under
    1 GiB from the heap, its top given back only past 2 GiB free) instead of handing a step's
    activations and gradients back to the system and faulting them in again, page by page:
    1.2-1.3x faster steps on two Zen 4 threads (docs/training.md, "Precision"). Process-wide,
    so ``treespec train-eagle`` calls it and :func:`train_eagle` does not. Returns whether it
    applied: False where the C library has no ``mallopt`` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30) and mallopt(m_trim_threshold, 2**31 - 1)
                and mallopt(m_top_pad, 256 << 20))


@dataclass
class TrainConfig:
    data: str
    out_dir: str
    eagle3: bool = True
    draft_vocab_size: int | None = 4096  # None: the full target vocabulary
    max_examples: int | None = None
    max_length: int = 512  # longer conversations are skipped and counted
    regenerate: bool = False  # self-distillation: the target's own replies as answers
    regenerate_count: int | None = None  # with regenerate: only the first N examples; the
    # rest keep the data's answers, labelled with the target's greedy tokens
    regen_max_new_tokens: int = 256
    regen_batch_size: int = 16
    capture_batch_size: int = 8
    ttt_steps: int = 3
    epochs: float = 2.0
    batch_size: int = 8  # conversations per optimiser step
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    val_examples: int = 32
    checkpoint_every: int = 200
    threads: int | None = None
    dtype: str = "auto"  # compute dtype of training: "bfloat16" (autocast; master weights and
    # AdamW state stay fp32), "float32", or "auto" (bf16 on a GPU or a CPU with native bf16)
    captured: str | None = None  # treespec capture folders (treespec.train.capture), comma-separated:
    # train on their shards (the first max_examples conversations of them in order) instead of
    # capturing from data
    captured_source: str | None = None  # with captured: only this dataset of its mix
    val_captured: str | None = None  # a capture folder held out for validation (all its greedy
    # conversations, up to val_examples), so that runs on different data compare on one set
    soft_labels: bool = False  # train on the target's whole next-token distribution over the draft
    # vocabulary (recomputed from the captured final state), as EAGLE-3's training does, instead of
    # its one token; needs a capture with the final state (captured, features "both")
    init: str | None = None  # start from this head (a directory or a shipped head's name) instead of
    # a fresh one: its weights, layout and draft vocabulary (fine-tuning on new data)


# ---- capture ----------------------------------------------------------------------------


@torch.inference_mode()
def capture(model, tokenizer, cfg: TrainConfig, callback: Callable[[Progress], None] | None = None):
    """Stage 1: returns a list of records ``{"tokens", "features" (fp16), "labels", "prompt_len"}``."""
    stats = DataStats()
    examples = read_jsonl(cfg.data, cfg.max_examples, stats)
    fids = feature_ids(model, "eagle3" if cfg.eagle3 else "eagle1")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    records = []
    eos = tokenizer.eos_token_id
    regen_n = (len(examples) if cfg.regenerate_count is None else cfg.regenerate_count) if cfg.regenerate else 0
    # Plain-text records have no prompt to answer: they are always teacher-forced.
    forced = [ex for ex in examples[:regen_n] if ex.text is not None] + examples[regen_n:]
    if regen_n:
        items = []
        for ex in (ex for ex in examples[:regen_n] if ex.text is None):
            ids, plen = tokenize_example(tokenizer, ex, answer="")
            if plen + 2 > cfg.max_length:
                stats.skipped_too_long += 1
                continue
            items.append(ids[:plen])
        order = sorted(range(len(items)), key=lambda i: len(items[i]))
        bs = cfg.regen_batch_size
        if callback:  # the bar starts with the work, so that its rate is the work's
            callback(Progress("regenerate", 0, len(order), {}))
        for start in range(0, len(order), bs):
            batch = [items[i] for i in order[start:start + bs]]
            records.extend(_regenerate(model, batch, fids, cfg, eos))
            if callback:
                callback(Progress("regenerate", min(start + bs, len(order)), len(order), {}))
    items = []
    for ex in forced:
        ids, plen = tokenize_example(tokenizer, ex)
        if len(ids) > cfg.max_length:
            stats.skipped_too_long += 1
            continue
        if len(ids) >= 3:
            items.append((ids, plen))
    bs = cfg.capture_batch_size
    if callback and items:
        callback(Progress("capture", 0, len(items), {}))
    for start in range(0, len(items), bs):
        records.extend(teacher_forced_records(model, items[start:start + bs], fids, pad))
        if callback:
            callback(Progress("capture", min(start + bs, len(items)), len(items), {}))
    if stats.skipped_too_long:
        log.warning("skipped %d conversations longer than max_length=%d", stats.skipped_too_long, cfg.max_length)
    if not records:
        raise ValueError(f"no training conversations left ({stats.describe()})")
    return records, stats


def _regenerate(model, prompts, fids, cfg: TrainConfig, eos):
    """The target's own greedy replies and the features of every position, in one pass."""
    max_new = max(1, min(cfg.regen_max_new_tokens, cfg.max_length - max(len(p) for p in prompts)))
    return generated_records(model, prompts, fids, max_new, eos, attention_backend="torch")


# ---- vocabulary ---------------------------------------------------------------------------


def draft_vocabulary(records, vocab_size: int, draft_vocab_size: int, always=()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [Vd] int64, t2d [V] bool)`` from label frequencies: the most frequent tokens
    (and ``always``), sorted by id so that ``target = draft + d2t[draft]``."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in records:
        lab = r["labels"]
        lab = lab[lab >= 0]
        counts.index_add_(0, lab, torch.ones_like(lab))
    for t in always:
        counts[t] = counts.max() + 1
    keep = counts.topk(min(draft_vocab_size, vocab_size)).indices.sort().values
    d2t = keep - torch.arange(keep.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[keep] = True
    return d2t, t2d


# ---- training-time test --------------------------------------------------------------------


def _ttt_masks(T: int, steps: int, lengths: torch.Tensor) -> list[torch.Tensor]:
    """For step s (1-based) a bool mask ``[B, T, s*T]`` over keys ``[K_1 | ... | K_s]``:
    entry i sees step-1 keys at positions <= i-s+1 (the real prefix up to the simulated
    root) and the step-j key at position i-s+j (its depth-(j-1) ancestor), j = 2..s."""
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    valid = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] keys that exist
    out = []
    for s in range(1, steps + 1):
        blocks = [(j <= i - s + 1)]
        for jj in range(2, s + 1):
            blocks.append(j == i - s + jj)
        m = torch.cat(blocks, 1)[None] & valid.repeat(1, s)[:, None, :]
        m[..., (s - 1) * T:] |= torch.eye(T, dtype=torch.bool)  # self, so no row is empty
        out.append(m)
    return out


def ttt_loss(head: EagleHead, batch, steps: int):
    """Mean weighted loss and per-step top-1 accuracy for a padded batch.

    batch: ``tokens [B, T+1]``, ``features [B, T, F]``, ``labels [B, T]`` (entry i pairs
    feature i with token i+1 and predicts the target's token after position i+1: labels
    are shifted accordingly by the caller), ``lengths [B]`` entries per row; optionally
    ``target_probs [B, T, Vd]``: the target's distribution there over the draft vocabulary
    (soft labels: the loss is its cross-entropy with the head's, at the entries that have
    a label in the draft vocabulary). Accuracy is always against ``labels``.
    """
    c = head.config
    tokens, feats, labels, lengths = batch["tokens"], batch["features"], batch["labels"], batch["lengths"]
    B, T = labels.shape
    pos = torch.arange(T)
    masks = _ttt_masks(T, steps, lengths)
    in_tok = tokens[:, 1: T + 1]  # entry i pairs with token i+1
    hidden = head.project(feats)
    ks, vs = [], []
    total, accs = 0.0, []
    weight_sum = 0.0
    for s in range(1, steps + 1):
        x, residual = head.qkv_input(in_tok.reshape(-1), hidden.reshape(B * T, -1))
        a = head.layer.self_attn
        q = a.q_proj(x).view(B, T, c.num_heads, c.head_dim)
        k = a.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
        v = a.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
        cos, sin = head.rotary(x, pos[None].expand(B, T))
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ks.append(k)
        vs.append(v.transpose(1, 2))
        o = F.scaled_dot_product_attention(
            q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=masks[s - 1][:, None],
            enable_gqa=c.num_heads != c.num_kv_heads,
        )  # [B, Hq, T, D]
        h = residual.view(B, T, -1) + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = h + head.layer.mlp(head.layer.post_attention_layernorm(h))
        logits = head.logits(h)  # [B, T, Vd]
        # Step s at entry i stands for a depth-(s-1) node at position i: only entries whose
        # simulated root (i-s+1) exists count.
        lab = labels.clone()
        lab[:, : s - 1] = -100
        if c.eagle3:
            lab = torch.where(lab >= 0, _to_draft(head, lab.clamp(min=0)), -100)
        if batch.get("target_probs") is not None:
            sel = lab >= 0
            logp = torch.log_softmax(logits[sel].float(), -1)
            loss = -(batch["target_probs"][sel] * logp).sum(-1).mean() if sel.any() else logits.sum() * float("nan")
        else:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), lab.reshape(-1), ignore_index=-100)
        w = 0.8 ** (s - 1)
        if torch.isfinite(loss):
            total = total + w * loss
            weight_sum += w
        sel = lab >= 0
        accs.append(float((logits.argmax(-1)[sel] == lab[sel]).float().mean()) if sel.any() else float("nan"))
        # The next step reads this step's outputs, shifted: entry i takes entry i-1's output.
        hidden = torch.cat([h[:, :1] * 0, h[:, :-1]], 1)
    if not weight_sum:  # no label of the batch in the draft vocabulary: a zero loss, still a graph
        return logits.sum() * 0.0, accs
    return total / weight_sum, accs


def _to_draft(head: EagleHead, target_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids, -100 where the token is outside the draft vocabulary."""
    if not hasattr(head, "_t2d_index"):
        idx = torch.full((head.config.vocab_size,), -100, dtype=torch.int64)
        keep = torch.arange(head.config.draft_vocab_size) + head.d2t
        idx[keep] = torch.arange(keep.numel())
        head._t2d_index = idx
    return head._t2d_index[target_ids]


def target_probs(final: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution over the draft vocabulary: softmax of its logits
    ``final @ rows.T`` restricted to the draft's tokens (``rows``: the target's output rows of
    those tokens, ``[Vd, H]``), as EAGLE-3's training forms its soft labels."""
    return torch.softmax(final.float() @ rows.float().T, -1)


def _collate(records, idx, rows: torch.Tensor | None = None):
    """A padded batch (see :func:`ttt_loss`); with ``rows`` (soft labels) also the target's
    distribution at each entry, from the records' final states."""
    rs = [records[i] for i in idx]
    T = max(r["tokens"].numel() - 1 for r in rs)
    B = len(rs)
    Fdim = rs[0]["features"].shape[1]
    tokens = torch.zeros(B, T + 1, dtype=torch.int64)
    feats = torch.zeros(B, T, Fdim)
    labels = torch.full((B, T), -100, dtype=torch.int64)
    lengths = torch.zeros(B, dtype=torch.int64)
    for b, r in enumerate(rs):
        n = r["tokens"].numel()
        tokens[b, :n] = r["tokens"]
        feats[b, : n - 1] = r["features"][: n - 1].float()
        # Entry i (feature i, token i+1) predicts the target's token after position i+1.
        labels[b, : n - 2] = r["labels"][1: n - 1]
        lengths[b] = n - 1
    batch = {"tokens": tokens, "features": feats, "labels": labels, "lengths": lengths}
    if rows is not None:
        final = torch.zeros(B, T, rows.shape[1])
        for b, r in enumerate(rs):
            n = r["tokens"].numel()
            final[b, : n - 2] = r["final"][1: n - 1].float()  # the state whose logits give labels[b, :n-2]
        with torch.no_grad():
            batch["target_probs"] = target_probs(final, rows)
    return batch


def validate(head: EagleHead, records, ttt_steps: int) -> tuple[float, list[float]]:
    """Loss and top-1 agreement with the target's token by training-time-test step of
    ``head`` on captured ``records`` (one batch, no gradients): how ``train_eagle``
    validates, so that heads trained elsewhere compare on the same conversations."""
    with torch.no_grad():
        loss, accs = ttt_loss(head, _collate(records, range(len(records))), ttt_steps)
    return float(loss), list(accs)


def _autocast_dtype(name: str, device_type: str) -> torch.dtype | None:
    """bf16 for autocast, or None (plain fp32). A TTT step's forward+backward measured 1.77x
    faster in bf16 than fp32 on one AMD Zen 4 core (native bf16; docs/training.md)."""
    if name == "float32":
        return None
    if name == "bfloat16":
        return torch.bfloat16
    if name != "auto":
        raise ValueError(f"training dtype must be auto, bfloat16 or float32, got {name!r}")
    from ..packing import default_dtype

    return torch.bfloat16 if default_dtype(device_type) == torch.bfloat16 else None


def _training_records(model, tokenizer, cfg: TrainConfig, out: Path, callback) -> list[dict]:
    """Stage 1: the records of a capture folder (``cfg.captured``), or those an earlier run left
    in ``out``, or a new capture saved there."""
    cap_path = out / "captured.pt"
    if cfg.captured:
        records = []
        for folder in cfg.captured.split(","):
            left = None if cfg.max_examples is None else cfg.max_examples - len(records)
            if left is not None and left <= 0:
                break
            got = load_shards(folder, eagle3=cfg.eagle3, limit=left, source=cfg.captured_source,
                              final=cfg.soft_labels)
            log.info("training on %d conversations captured in %s", len(got), folder)
            records += got
    elif cfg.soft_labels:
        raise ValueError("soft labels need a capture folder with the final state (treespec capture, "
                         "features 'both'): train with captured=DIR")
    elif cap_path.exists():
        records = torch.load(cap_path, weights_only=False)
        log.info("resuming: %d captured conversations from %s", len(records), cap_path)
    else:
        t0 = time.time()
        records, stats = capture(model, tokenizer, cfg, callback)
        torch.save(records, cap_path)
        log.info("captured %d conversations in %.0f s (%s)", len(records), time.time() - t0, stats.describe())
    return records


def _new_head(model, tokenizer, cfg: TrainConfig, records) -> tuple[EagleHead, torch.Tensor | None]:
    """Stage 2: a float32 head for ``model``, all its parameters trainable; with EAGLE-3 its draft
    vocabulary from the labels of ``records`` and its output rows started from the target's.
    Also those rows, frozen, for soft labels (``[Vd, H]``; None without soft labels).
    With ``cfg.init``, the head it names instead, as it is (its layout and draft vocabulary)."""
    if cfg.init:
        head = _init_head(model, cfg)
    else:
        V = model.get_input_embeddings().weight.shape[0]  # a draft vocabulary no larger than the target's
        vocab = min(cfg.draft_vocab_size, V) if cfg.draft_vocab_size else None
        head = EagleHead.for_target(model, eagle3=cfg.eagle3, draft_vocab_size=vocab).float()
    if cfg.eagle3 and not cfg.init:
        V = head.config.vocab_size
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        d2t, t2d = draft_vocabulary(records, V, head.config.draft_vocab_size, always=eos)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        with torch.no_grad():  # start the draft's output layer from the target's rows
            keep = torch.arange(d2t.numel()) + d2t
            head.lm_head.weight.copy_(model.get_output_embeddings().weight[keep].float())
    rows = None
    if cfg.soft_labels:
        if not cfg.eagle3:
            raise ValueError("soft labels are implemented for the EAGLE-3 layout (its draft vocabulary)")
        keep = torch.arange(head.config.draft_vocab_size) + head.d2t  # the target's rows of the draft
        rows = model.get_output_embeddings().weight[keep].detach().float().clone()  # vocabulary, frozen
    for p in head.parameters():
        p.requires_grad_(True)
    return head, rows


def _init_head(model, cfg: TrainConfig) -> EagleHead:
    """The float32 head ``cfg.init`` names, checked against the run's layout."""
    from ..assets import resolve_draft
    from ..drafters.eagle_head import load_head as _head_from_dir

    head = _head_from_dir(resolve_draft(cfg.init), model).float()
    c = head.config
    if c.eagle3 != cfg.eagle3:
        raise ValueError(f"init={cfg.init!r} is an {'EAGLE-3' if c.eagle3 else 'EAGLE-1/2'} head, but the run "
                         f"trains {'EAGLE-3' if cfg.eagle3 else 'EAGLE-1/2'}: pass the matching --arch")
    if c.eagle3 and cfg.draft_vocab_size and cfg.draft_vocab_size != c.draft_vocab_size:
        raise ValueError(f"init={cfg.init!r} has a draft vocabulary of {c.draft_vocab_size}, the run asks for "
                         f"{cfg.draft_vocab_size}: fine-tuning keeps the head's (pass --draft-vocab "
                         f"{c.draft_vocab_size})")
    log.info("starting from the head %s (%s)", cfg.init, "EAGLE-3" if c.eagle3 else "EAGLE-1/2")
    return head


def _split(records, cfg: TrainConfig) -> tuple[list[int], list[dict]]:
    """``(indices of the training records, validation records)``: the held-out capture folder's
    greedy conversations (``cfg.val_captured``), else a seeded tenth of ``records`` at most."""
    rng = random.Random(cfg.seed)
    order = list(range(len(records)))
    rng.shuffle(order)
    if cfg.val_captured:
        val_records = load_shards(cfg.val_captured, eagle3=cfg.eagle3, greedy_only=True)[: cfg.val_examples]
        if val_records:
            return order, val_records
    val = order[: min(cfg.val_examples, len(order) // 10)]
    return order[len(val):], [records[i] for i in val]


def train_eagle(model, tokenizer, cfg: TrainConfig, callback: Callable[[Progress], None] | None = None) -> EagleHead:
    """Run the whole pipeline; returns the trained head (also saved to ``cfg.out_dir``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    records = _training_records(model, tokenizer, cfg, out, callback)
    head, rows = _new_head(model, tokenizer, cfg, records)
    train, val = _split(records, cfg)
    _optimise(head, records, train, rows, cfg, out / "checkpoint.pt", callback)
    head.eval()
    if val:
        vloss, vacc = validate(head, val, cfg.ttt_steps)
        log.info("validation loss %.3f, top-1 accuracy by step %s", float(vloss), [round(a, 3) for a in vacc])
        (out / "validation.txt").write_text(
            f"loss {float(vloss):.4f}\ntop1_by_step {' '.join(f'{a:.4f}' for a in vacc)}\n")
    head.save_pretrained(out / "head")
    return head


def _schedule(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """The learning rate at a step: linear warm-up, then cosine decay to a tenth."""
    def lr_at(step):
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    return lr_at


def _epoch_batches(records, train: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """Batches by similar length (little padding), in an order shuffled once per epoch."""
    r = random.Random(cfg.seed + epoch)
    idx = sorted(train, key=lambda i: records[i]["tokens"].numel() + r.random() * 8)
    batches = [idx[i: i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]
    r.shuffle(batches)
    return batches


def _step(head, params, opt, batch, cfg: TrainConfig, lr: float, amp) -> tuple[torch.Tensor, list[float]]:
    """One optimiser step on ``batch``; returns its loss and per-step accuracies."""
    for g in opt.param_groups:
        g["lr"] = lr
    device_type = next(head.parameters()).device.type
    with torch.autocast(device_type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        loss, accs = ttt_loss(head, batch, cfg.ttt_steps)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return loss, accs


def _optimise(head, records, train: list[int], rows, cfg: TrainConfig, ckpt: Path, callback) -> None:
    """Stage 3: ``cfg.epochs`` passes over the ``train`` records, resumed from ``ckpt`` and
    saved there every ``checkpoint_every`` steps and at the end."""
    params = [p for p in head.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    total_steps = max(1, int(steps_per_epoch * cfg.epochs))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    lr_at = _schedule(cfg, total_steps)
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log.info("resuming training at step %d of %d", step, total_steps)
    amp = _autocast_dtype(cfg.dtype, next(head.parameters()).device.type)
    log.info("training in %s (%d steps of %d conversations)", "bf16 autocast" if amp else "float32",
             total_steps, cfg.batch_size)
    head.train()
    t0, tokens_seen = time.time(), 0
    if callback and step < total_steps:
        callback(Progress("train", step, total_steps, {}))  # the bar starts with the work
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        for bidx in _epoch_batches(records, train, cfg, epoch)[within:]:
            if step >= total_steps:
                break
            batch = _collate(records, bidx, rows)
            loss, accs = _step(head, params, opt, batch, cfg, lr_at(step), amp)
            step += 1
            tokens_seen += int(batch["lengths"].sum())
            if callback:
                callback(Progress("train", step, total_steps, {
                    "loss": float(loss.detach()), "acc": accs, "tok/s": tokens_seen / max(time.time() - t0, 1e-9)}))
            if step % cfg.checkpoint_every == 0 or step == total_steps:
                torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                            "config": asdict(cfg)}, ckpt)


def time_train_steps(model, tokenizer, cfg: TrainConfig, records, steps: int = 3) -> float:
    """Seconds one conversation takes through one training epoch here: a throwaway head is
    trained ``steps`` optimiser steps of ``cfg.batch_size`` of ``records`` (after one untimed
    step: the first allocates), as :func:`train_eagle` trains. For sizing a run to a budget."""
    head, rows = _new_head(model, tokenizer, replace(cfg, init=None), records)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    amp = _autocast_dtype(cfg.dtype, next(head.parameters()).device.type)
    idx = sorted(range(len(records)), key=lambda i: records[i]["tokens"].numel())
    batches = [idx[i: i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]
    head.train()
    seconds = conversations = 0.0
    for k in range(steps + 1):
        batch = batches[k % len(batches)]
        t0 = time.perf_counter()
        _step(head, params, opt, _collate(records, batch, rows), cfg, cfg.lr, amp)
        if k:
            seconds += time.perf_counter() - t0
            conversations += len(batch)
    return seconds / conversations
