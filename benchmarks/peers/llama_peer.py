"""llama.cpp's side of `run.py`: run by the peer environment's own python (llama-cpp-python
and numpy; no torch, no treespec), one process per turn of the prompts:

    python llama_peer.py REQUEST.json RESULT.json

REQUEST.json (`peer_rows.llama_request`): the GGUF, threads, max_new_tokens, the EOS ids HF
generate stops at, whether llama.cpp may repack the weights, the configurations (plain; prompt
lookup of K tokens), an optional warm-up and per prompt the token ids each configuration is
given. RESULT.json: ``engine``, ``version``, ``system_info``, ``repack`` and, per
configuration, one ``{"index", "tokens", "seconds"}`` a prompt.

Every configuration runs prompt i before any runs prompt i+1, as in `treespec bench`. Greedy
(temperature 0: llama.cpp's greedy sampler), the prompt given as token ids, no cache kept
between prompts (each pays its own prefill), stopping after an EOS id (kept, as HF generate
keeps it) or max_new_tokens. The time is the wall time of one generate, prompt processing
included, the model loaded before. Progress goes to stderr, one line a prompt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def allow_repack(on: bool) -> str:
    """Whether llama.cpp may repack the weights into its extra buffer types (its AMX/repacked
    kernels: on an Intel Sapphire Rapids they crashed in decode on any batch of more than one
    token). The Llama constructor drops unknown keywords silently, so the model parameters'
    defaults are patched instead. Returns what was set: ``on``, ``off`` or why neither."""
    from llama_cpp import llama_cpp as lc

    if "use_extra_bufts" not in dict(lc.llama_model_params._fields_):
        return "not settable in this version (its default)"
    defaults = lc.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = on
        return p

    lc.llama_model_default_params = params  # what Llama.__init__ calls
    return "on" if on else "off"


def context_size(req: dict) -> int:
    """Room for the longest prompt, its answer and a draft past it."""
    longest = max([len(ids) for p in req["prompts"] for ids in p["ids"].values()]
                  + [len((req.get("warmup") or {}).get("ids", []))])
    lookup = max((c["lookup_tokens"] or 0) for c in req["configs"])
    return longest + req["max_new_tokens"] + lookup + 8


def load(req: dict, config: dict):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = config["lookup_tokens"]
    # With a draft model llama-cpp-python keeps every position's logits but sizes their array by
    # ``logits_all`` as given (else n_batch, 512 rows): a prompt longer than that crashed its
    # lookup row (0.3.36, a Spec-Bench summarization prompt); asking for them sizes it by n_ctx.
    return Llama(model_path=req["gguf"], n_ctx=context_size(req), n_threads=req["threads"],
                 n_threads_batch=req["threads"], verbose=False, logits_all=bool(k),
                 draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None)


def generate(llm, ids: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy tokens after ``ids`` and the wall seconds of the call."""
    llm.reset()  # no prefix reused from the previous prompt: HF generate reuses none either
    out = []
    t0 = time.perf_counter()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if token in eos or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python llama_peer.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(Path(argv[0]).read_text())
    import llama_cpp

    repack = allow_repack(req["repack"])
    llms = {c["name"]: load(req, c) for c in req["configs"]}
    eos = set(req["eos_token_ids"])
    if req.get("warmup"):
        for llm in llms.values():  # first calls run slower (allocations, thread pools)
            generate(llm, req["warmup"]["ids"], req["warmup"]["max_new_tokens"], eos)
    runs = {name: [] for name in llms}
    for k, p in enumerate(req["prompts"]):
        line = []
        for name, llm in llms.items():
            tokens, seconds = generate(llm, p["ids"][name], req["max_new_tokens"], eos)
            runs[name].append({"index": p["index"], "tokens": tokens, "seconds": seconds})
            line.append(f"{name} {len(tokens) / seconds if seconds > 0 else 0:.1f} tok/s")
        print(f"llama.cpp: prompt {k + 1}/{len(req['prompts'])}: " + ", ".join(line), file=sys.stderr, flush=True)
    result = {"engine": "llama.cpp", "version": f"llama-cpp-python {llama_cpp.__version__}",
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
              "repack": repack, "threads": req["threads"], "runs": runs}
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
