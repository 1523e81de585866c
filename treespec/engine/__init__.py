"""Tree-speculative decoding: ``stream`` (the one loop, a generator of per-step commits) and
``generate`` (``stream`` run to the end, its tokens and metrics collected).

Reading order: ``options.py`` (the keywords of both, declared once), ``request.py`` (a call's
arguments checked and resolved into one :class:`~treespec.engine.request.Run`), ``loop.py``
(the loop: one step, stage by stage, top to bottom), ``outputs.py`` (what comes back).
"""

from __future__ import annotations

from typing import Iterator

import torch

from .loop import decode
from .options import GenerationOptions, declares_options
from .outputs import GenerateOutput, RequestMetrics, SpecMetrics, StepOutput
from .request import describe_run

__all__ = ["generate", "stream", "GenerationOptions", "GenerateOutput", "SpecMetrics", "RequestMetrics",
           "StepOutput"]


@declares_options
def stream(model, draft, tree_cfg, input_ids, **options) -> Iterator[StepOutput]:
    """Decode with tree speculation, yielding the tokens each step commits.

    The output is what ``model`` alone produces: identical tokens under greedy decoding
    (``temperature=0``), the same distribution under sampling (temperature, top_k, top_p,
    min_p, applied at every tree node). Exactly the options given are applied: unlike
    ``model.generate(do_sample=True)``, nothing is taken from the model's generation
    config but the EOS id, and there is no implicit ``top_k=50``; pass ``top_k=50`` to
    sample as transformers does by default. ``stream`` gives what ``generate`` gives, step by
    step: step 0 holds each request's first token (from prefill), each later step the tokens
    one verify forward committed.

    Returns:
        an iterator of :class:`StepOutput`.
    """
    ours, fields = GenerationOptions.split("stream", options)
    yield from decode(describe_run(model, draft, tree_cfg, input_ids, ours, fields))


@declares_options
def generate(model, draft, tree_cfg, input_ids, **options) -> GenerateOutput:
    """Generate with tree speculation; same output as ``model`` alone (:func:`stream`, run to
    the end).

    Returns:
        :class:`GenerateOutput` with ``sequences`` and ``metrics`` (and ``scores`` with
        ``output_scores``).
    """
    GenerationOptions.split("generate", options)  # an unknown keyword names generate, not stream
    sequences, scores, metrics = None, None, None
    for out in stream(model, draft, tree_cfg, input_ids, **options):
        if sequences is None:
            sequences, scores = [[] for _ in out.tokens], [[] for _ in out.tokens]
        for s, t in zip(sequences, out.tokens):
            s.extend(t)
        for s, x in zip(scores, out.scores or []):
            s.append(x)
        metrics = out.metrics
    return GenerateOutput(sequences, metrics, [torch.cat(x) for x in scores] if any(scores) else None)
