"""Reading a capture folder (:mod:`.capture` writes it): its shards in plan order, each a list of
records (:mod:`.records`), features narrowed to the layout a head trains on.

    records = load_shards("runs/cap-all", eagle3=True, limit=2500)   # what train_eagle(captured=...) reads
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

__all__ = ["MANIFEST", "shard_files", "load_shards"]

log = logging.getLogger(__name__)

MANIFEST = "capture.json"
_SHARD = re.compile(r"^shard-(\d{6})-(\d{6})\.pt$")


def shard_files(out_dir) -> list[Path]:
    """The shards of a capture folder that form its longest prefix of the plan, in order
    (for each start, the longest shard: one written before ``max_examples`` grew is superseded)."""
    best: dict[int, tuple[int, Path]] = {}
    for p in Path(out_dir).glob("shard-*.pt"):
        m = _SHARD.match(p.name)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            if b > best.get(a, (-1, None))[0]:
                best[a] = (b, p)
    out, pos = [], 0
    while pos in best:
        stop, path = best[pos]
        out.append(path)
        pos = stop
    missing = sorted(a for a in best if a >= pos)
    if missing:
        log.warning("%s: shards from %d on are not contiguous with the first %d conversations; they are not read",
                    out_dir, missing[0], pos)
    return out


def load_shards(out_dir, eagle3: bool = True, limit: int | None = None, greedy_only: bool = False,
                mmap: bool = True, source: str | None = None, final: bool = False) -> list[dict]:
    """The records of a capture folder (its contiguous prefix of shards), features narrowed
    to the layout's (EAGLE-3 fusion or EAGLE-1/2 final state; views of memory-mapped
    files, so a capture larger than memory trains).

    ``limit``: the first ``limit`` conversations (in plan order) that pass the filters.
    ``greedy_only``: leave out sampled answers (validation of top-1 agreement).
    ``source``: only conversations from this dataset of the mix (its name in ``data``).
    ``final``: also hand out the final post-norm state as ``record["final"]`` (a view), from
    which the target's logits, hence its whole next-token distribution, are recomputed
    (soft labels); the capture must hold it (``features="both"`` or ``"eagle1"``).
    """
    out = Path(out_dir)
    mpath = out / MANIFEST
    if not mpath.exists():
        raise FileNotFoundError(f"{out} is not a capture folder (no {MANIFEST}): run treespec capture first")
    fids = json.loads(mpath.read_text())["feature_ids"]
    want = [i for i in fids if i != -1] if eagle3 else [-1]
    if not want or any(i not in fids for i in want):
        raise ValueError(f"{out} has features {fids}: none for {'EAGLE-3' if eagle3 else 'EAGLE-1/2'} "
                         f"(capture with features='both')")
    first = fids.index(want[0])
    if fids[first: first + len(want)] != want:
        raise ValueError(f"{out}: the {want} features are not adjacent in {fids}")
    options = json.loads(mpath.read_text()).get("options")
    if final and options:
        raise ValueError(f"{out} was decoded with generation options {options}: soft labels recompute the target's "
                         f"unprocessed distribution, which is not what its answers were chosen from; train on its "
                         f"tokens (without soft labels)")
    if final and -1 not in fids:
        raise ValueError(f"{out} has features {fids}, not the final state that soft labels need "
                         f"(capture with features='both')")
    records = []
    for path in shard_files(out):
        if limit is not None and len(records) >= limit:
            break
        for r in torch.load(path, mmap=mmap, weights_only=True):
            if (greedy_only and r.get("sampled")) or (source is not None and r["source"].rsplit(":", 1)[0] != source):
                continue
            if limit is not None and len(records) >= limit:
                break
            H = r["features"].shape[1] // len(fids)
            if final:
                f = fids.index(-1)
                r["final"] = r["features"][:, f * H: (f + 1) * H]
            r["features"] = r["features"][:, first * H: (first + len(want)) * H]  # a view
            records.append(r)
    if not records:
        raise ValueError(f"{out} holds no captured conversations yet")
    return records
