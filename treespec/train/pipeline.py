"""A head for one's own model in one call: the target writes its own prompts, answers them, and
an EAGLE head is trained on the features of its answers, validated and tuned
(``treespec train-eagle --model M --out DIR``).

    run = OwnRun(model, tokenizer, PipelineConfig("runs/mine", budget=2 * 3600, model="my-model"))
    head_dir = run.run()                          # runs/mine/head, auto-profile.json beside the weights

Stages, in ``DIR``; each is skipped once its output is there and complete, so the same call
resumes a run stopped at any point (``run.json`` records the plan, the rates it came from and
what each stage finished):

1. **prompts**: user turns the target writes itself (:mod:`.magpie`), sampled in seeded chunks
   of 64 into ``prompts/``, then filtered; the first ones kept are held out
   (``prompts-val.jsonl``), the next ``plan.prompts`` train (``prompts.jsonl``).
2. **answers**: the target answers them, its features recorded on the way (:mod:`.capture`):
   ``capture-val`` (greedy) and ``capture`` (a fifth sampled at T=0.8, as the shipped head's).
3. **train**: an EAGLE head on ``capture``, validated on ``capture-val`` (:mod:`.trainer`):
   ``head/``, ``validation.txt``, ``checkpoint.pt``.
4. **tune**: the auto tree's calibrations for the head, alone and with prompt lookup grafted
   on, learned on held-out prompts: ``head/auto-profile.json`` (what ``auto`` starts from).

**Budget.** The first minutes measure this machine on real work: the first chunk of user turns
(kept: it is chunk 0 of stage 1), the held-out answers (kept: they are ``capture-val``), three
training steps of a throwaway head and one short decode. :func:`.budget.size_plan` then sizes
the number of prompts to what the budget leaves (answers of 256 tokens, 2 epochs); the data
stages stop at a chunk or shard once they run a quarter over their share, and the epochs are
fitted to the time left once the answers are in (:func:`.budget.refit_epochs`). Progress goes to
``callback`` as :class:`~.records.Progress` reports: ``info["line"]`` is a line to show (a stage
begun, skipped or done, the plan), ``info["left"]`` the seconds the whole run has left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import magpie
from .budget import STAGES, Plan, Rates, answer_tokens_for, format_duration, refit_epochs, size_plan, tune_size
from .capture import CaptureConfig, capture_shards
from .records import Progress
from .shards import load_shards
from .trainer import TrainConfig, time_train_steps, train_eagle

__all__ = ["PipelineConfig", "OwnRun", "RUN_FILE", "asked_before"]

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
FORMAT = "treespec-own-run/1"
VAL_MAX = 32  # held-out conversations: the trainer validates on at most this many
OVERRUN = 1.25  # a data stage stops (at a chunk or shard) once it has taken this much more than planned


@dataclass
class PipelineConfig:
    out_dir: str
    budget: float | None = 7200.0  # seconds for the whole run; None: the amounts given (or their defaults)
    prompts: int | None = None  # training conversations; None: sized by the budget
    answer_tokens: int | None = None  # the most tokens of an answer; None: by the budget (256 from 10 minutes)
    epochs: float | None = None  # None: 2, refitted to the time left
    train: TrainConfig | None = None  # the head's training settings (layout, vocabulary, lr, ...)
    model: str | None = None  # the target's name, recorded and checked on resume
    dtype: str | None = None  # the target's dtype as asked, recorded by the captures
    sample_share: float = 0.2  # of the training answers, sampled at sample_temperature (validation: greedy)
    sample_temperature: float = 0.8
    seed: int = 0
    chunk_size: int = 64  # user turns sampled together, each chunk from its own seed
    batch_size: int = 64  # answers decoded together (and conversations per shard)

    def __post_init__(self):
        if self.budget is None and self.prompts is None:
            raise ValueError("give a budget (seconds) or a number of prompts")
        for name in ("budget", "prompts", "answer_tokens", "epochs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.train is None:
            self.train = TrainConfig(data="", out_dir=self.out_dir)

    def asked(self) -> dict:
        """What a resumed run must be asked again (the rest may change)."""
        return {"model": self.model, "budget": self.budget, "prompts": self.prompts,
                "answer_tokens": self.answer_tokens, "epochs": self.epochs, "eagle3": self.train.eagle3}


class OwnRun:
    """One run of the pipeline in ``cfg.out_dir`` (see the module docstring). ``packed``: a
    context the target decodes in (the command line's packed weights); ``started``: the
    ``time.perf_counter()`` the budget counts from (the command's start, loading included)."""

    def __init__(self, model, tokenizer, cfg: PipelineConfig, callback: Callable[[Progress], None] | None = None,
                 packed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 started: float | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{cfg.model or 'the model'} has no chat template, so it cannot write its own user "
                             "turns: train on a dataset instead (--data gsm8k-train, or a JSONL of prompts; "
                             "docs/training.md)")
        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.callback, self.packed = callback or (lambda p: None), packed
        self.started = time.perf_counter() if started is None else started
        self.out = Path(cfg.out_dir)
        positions = getattr(model.config, "max_position_embeddings", None) or cfg.train.max_length
        self.max_length = min(cfg.train.max_length, positions)
        self.state: dict = {}
        self._overlap = None
        self._stage_t0 = self._saved_at = 0.0

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> Path:
        """Every stage not done yet, in order; returns the head's directory."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.state = self._load_state()
        if "plan" not in self.state:
            self._measure()
        ran = False
        for stage in STAGES:
            record = self.state["stages"].setdefault(stage, {"done": False, "seconds": 0.0})
            if record["done"]:
                self._say(stage, f"{self._label(stage)}: {record['summary']}: skipped")
                continue
            self._begin(stage)
            getattr(self, f"_{stage}")(record)
            record["done"] = ran = True
            self._end(stage, record)
        self._say("tune", f"every stage done, in {format_duration(self._elapsed())} in all" if ran
                  else "every stage was done already")
        return self.out / "head"

    def _label(self, stage: str) -> str:
        return f"[{STAGES.index(stage) + 1}/{len(STAGES)}] {stage}"

    def _begin(self, stage: str) -> None:
        self._stage_t0 = time.perf_counter()
        planned = self._planned()[stage]
        self._say(stage, f"{self._label(stage)}: {self._what(stage)}, about {format_duration(planned)}"
                  + (f" ({format_duration(self._left(stage, 0.0))} left in all)" if self.cfg.budget else ""))

    def _end(self, stage: str, record: dict) -> None:
        record["seconds"] += time.perf_counter() - self._stage_t0
        self._save_state()
        self._say(stage, f"{self._label(stage)}: {record['summary']} in {format_duration(record['seconds'])}")

    def _what(self, stage: str) -> str:
        p, v = self._plan(), self.state["held_out"]
        if stage == "prompts":
            return f"the target writes {p.prompts + v:,} user turns to keep ({v} held out)"
        if stage == "answers":
            n = self.state["stages"]["prompts"]["kept"]
            return f"it answers {n:,} of them (up to {p.answer_tokens} tokens), features recorded"
        if stage == "train":  # the epochs are fixed here, once the answers are in
            return f"an EAGLE head, {self._epochs():g} epoch(s), validated on {v} held-out conversations"
        return "the auto tree's calibrations for the head, alone and with prompt lookup"

    # ---- measuring and planning ---------------------------------------------------------------

    def _measure(self) -> None:
        """The first minutes: rates measured on real work, then the plan (see the module docstring).
        Each rate is saved as it comes (``measured``), so a run stopped meanwhile measures only
        what it had not."""
        cfg, m = self.cfg, self.state.setdefault("measured", {})
        L = cfg.answer_tokens or answer_tokens_for(cfg.budget)
        self._say("prompts", "measuring this machine first: a chunk of user turns, the held-out answers, "
                             "a few training steps")
        if "keep" not in m:
            m["turn"], m["keep"], kept = self._measure_turns()
            self.state["held_out"] = min(VAL_MAX, max(1, len(kept) // 2))
            magpie.write_prompt_set(self.out / "prompts-val.jsonl", kept[: self.state["held_out"]])
            self._save_state()
        if "answer" not in m:
            shutil.rmtree(self.out / "capture-val", ignore_errors=True)  # a capture whose time was not kept
            t0 = time.perf_counter()
            with self.packed():
                capture_shards(self.model, self.tok, self._capture_cfg(val=True, answer_tokens=L))
            m["answer"] = (time.perf_counter() - t0) / self.state["held_out"]
            self._save_state()
        val = load_shards(self.out / "capture-val", eagle3=cfg.train.eagle3, final=cfg.train.soft_labels)
        m["train"] = time_train_steps(self.model, self.tok, replace(cfg.train, max_length=self.max_length), val)
        m["tune"] = self._tune_estimate(val[0]["tokens"][: val[0]["prompt_len"]].tolist())
        rates = Rates(**m)
        left = (cfg.budget - self._elapsed()) if cfg.budget else 0.0
        plan = size_plan(left, rates, prompts=cfg.prompts, answer_tokens=L, epochs=cfg.epochs)
        self.state.update(rates=rates.to_json(), plan=plan.to_json())
        self._save_state()
        self._say_plan(plan, rates, left)

    def _measure_turns(self) -> tuple[float, float, list[dict]]:
        """Seconds per raw user turn, the share kept, and the turns kept, from the first chunks:
        one, or more while none is kept (four at most) or none was timed (one sampled before a stop)."""
        work, size = self.out / "prompts", self.cfg.chunk_size
        seconds, sampled, c = 0.0, 0, 0
        while True:
            if magpie.chunks_to_sample(work, [c], size):
                t0 = time.perf_counter()
                with self.packed():
                    magpie.sample_chunk(self.model, self.tok, work, c, self.cfg.seed, batch_size=size)
                seconds, sampled = seconds + time.perf_counter() - t0, sampled + size
            kept, why = magpie.kept_turns(magpie.read_chunks(work, range(c + 1)), overlap=self._eval_overlap())
            if kept and sampled:
                return seconds / sampled, len(kept) / ((c + 1) * size), kept
            c += 1
            if not kept and c >= 4:
                raise ValueError(f"the filters kept none of the {c * size} user turns the target wrote "
                                 f"({dict(why.most_common())}): is {self.cfg.model or 'it'} a chat model? Train on "
                                 f"a dataset instead (--data gsm8k-train, or a JSONL of prompts)")

    def _tune_estimate(self, prompt: list[int]) -> float:
        """Seconds of the tune stage: its tokens at the rate of one request decoding here, twice
        (the head alone, then with lookup), and about 10 s to measure the verify costs."""
        from ..engine import generate

        n, new = tune_size(self.cfg.budget)
        t0 = time.perf_counter()
        with self.packed():
            generate(self.model, "none", "chain-1", prompt, max_new_tokens=16)
        return 2 * n * new * (time.perf_counter() - t0) / 16 + 10.0

    def _say_plan(self, plan: Plan, rates: Rates, left: float) -> None:
        total = sum(self._planned().values())
        budget = f"for {format_duration(self.cfg.budget)}" if self.cfg.budget else "as asked"
        self._say("prompts", f"plan {budget}: {plan.prompts:,} conversations to train on "
                  f"(+{self.state['held_out']} held out), answers up to {plan.answer_tokens} tokens, "
                  f"{plan.epochs:g} epochs: about {format_duration(total)} from here (measured: "
                  f"{rates.turn:.2f} s a user turn, {rates.keep:.0%} kept; {rates.answer:.2f} s an answer; "
                  f"{rates.train:.3f} s a conversation-epoch of training)")
        if self.cfg.budget and total > 1.1 * left:
            self._say("prompts", f"the budget leaves {format_duration(max(left, 0))} after measuring: too short "
                      f"for a useful head; the run keeps the least it trains on and takes longer")

    # ---- stages -------------------------------------------------------------------------------

    def _prompts(self, record: dict) -> None:
        """Sample chunks until the filters keep the plan's prompts (or the stage's time is up)."""
        held = self.state["held_out"]
        need = self._plan().prompts + held
        kept, rows = self._sample_until(need, record)
        if [r["prompt"] for r in kept[:held]] != [r["prompt"] for r in _read(self.out / "prompts-val.jsonl")]:
            raise ValueError(f"{self.out / 'prompts'}: its first chunks no longer give the held-out prompts: "
                             f"delete {self.out} and start again")
        train = kept[held:need]
        if not train:
            raise ValueError(f"the filters kept {len(kept)} user turns, none left to train on after {held} held out")
        magpie.write_prompt_set(self.out / "prompts.jsonl", train)
        record.update(kept=len(train), raw=len(rows),
                      summary=f"{len(train):,} prompts kept of {len(rows):,} written (+{held} held out)")

    def _sample_until(self, need: int, record: dict) -> tuple[list[dict], list[dict]]:
        """``(kept, raw)`` turns once ``need`` are kept: as many chunks as the share kept so far
        says, then more while short, chunk by chunk (stopping where the stage's time is up)."""
        work, size = self.out / "prompts", self.cfg.chunk_size
        keep = self._rates().keep
        while True:
            chunks = max(1, math.ceil(need / keep / size))
            todo = magpie.chunks_to_sample(work, range(chunks), size)
            self._progress("prompts", 1 - len(todo) / chunks, 0, len(todo))
            for i, c in enumerate(todo):
                if self._over("prompts", record):
                    break
                with self.packed():
                    magpie.sample_chunk(self.model, self.tok, work, c, self.cfg.seed, batch_size=size)
                self._progress("prompts", 1 - (len(todo) - i - 1) / chunks, i + 1, len(todo))
            present = next(c for c in range(chunks + 1) if c == chunks or magpie.chunks_to_sample(work, [c], size))
            rows = magpie.read_chunks(work, range(present))
            kept, _ = magpie.kept_turns(rows, overlap=self._eval_overlap())
            if len(kept) >= need or present < chunks:  # enough, or the time is up
                return kept, rows
            keep = max(len(kept) / len(rows), 0.01)

    def _answers(self, record: dict) -> None:
        """Capture the training prompts' answers and features, shard by shard."""
        n = self.state["stages"]["prompts"]["kept"]
        report = self._relay("answers", "capture")
        with self.packed():
            s = capture_shards(self.model, self.tok, self._capture_cfg(val=False), callback=report,
                               stop=lambda: self._over("answers", record))
        done = len(load_shards(self.out / "capture", eagle3=self.cfg.train.eagle3))
        record.update(conversations=done, summary=f"{done:,} of {n:,} conversations answered"
                      + (" (stopped at the budget)" if s["stopped"] else ""))

    def _train(self, record: dict) -> None:
        """Train the head on the capture, validated on the held-out one."""
        tcfg = replace(self.cfg.train, data="", out_dir=str(self.out), captured=str(self.out / "capture"),
                       val_captured=str(self.out / "capture-val"), epochs=self._epochs(),
                       max_length=self.max_length, val_examples=self.state["held_out"])
        train_eagle(self.model, self.tok, tcfg, callback=self._relay("train", "train"))
        record["summary"] = f"{self._epochs():g} epoch(s) over {self.state['stages']['answers']['conversations']:,} " \
                            f"conversations; {_validation(self.out / 'validation.txt')}"

    def _tune(self, record: dict) -> None:
        """Learn the calibrations (head alone, then with lookup) and keep them beside the head."""
        from ..auto import HEAD_PROFILE
        from ..drafters import HybridDrafter, load_draft
        from ..tune import tune

        n, new = tune_size(self.cfg.budget)
        prompts = [_prompt_ids(self.tok, r["prompt"]) for r in _read(self.out / "prompts-val.jsonl")[:n]]
        head = load_draft(self.out / "head", self.model)
        results = []
        for k, drafter in enumerate((head, HybridDrafter(head))):
            def step(done, total, k=k):  # two passes: one bar
                self._progress("tune", (k * total + done) / (2 * total), k * total + done, 2 * total)

            with self.packed():
                results.append(tune(self.model, drafter, prompts, "auto", max_new_tokens=new, callback=step))
        taus = [sum(r.accepted_length) / len(prompts) for r in results]
        profile = results[0].profile.calibrations_only()
        profile.sources = results[1].profile.calibrations_only().sources  # lookup's and the agreed nodes'
        profile.keys["note"] = ("calibrations only, learned by treespec train-eagle on held-out self-generated "
                                "prompts: the head's alone, prompt lookup's with it grafted on; the cost curve is "
                                "measured on each machine")
        profile.save(self.out / "head" / HEAD_PROFILE)
        record["summary"] = (f"mean accepted length {taus[0]:.2f} alone, {taus[1]:.2f} with prompt lookup, on "
                             f"{len(prompts)} held-out prompts ({new} tokens each)")

    # ---- helpers ------------------------------------------------------------------------------

    def _capture_cfg(self, val: bool, answer_tokens: int | None = None) -> CaptureConfig:
        cfg, held = self.cfg, self.state["held_out"]
        name = "prompts-val.jsonl" if val else "prompts.jsonl"
        features = "both" if cfg.train.soft_labels else ("eagle3" if cfg.train.eagle3 else "eagle1")
        return CaptureConfig(
            data=str((self.out / name).resolve()), out_dir=str(self.out / ("capture-val" if val else "capture")),
            max_length=self.max_length, max_new_tokens=answer_tokens or self._plan().answer_tokens,
            sample_share=0.0 if val else cfg.sample_share, sample_temperature=cfg.sample_temperature,
            seed=cfg.seed, shard_size=held if val else cfg.batch_size, batch_size=held if val else cfg.batch_size,
            features=features, model=cfg.model, dtype=cfg.dtype)

    def _eval_overlap(self):
        if self._overlap is None:
            self._overlap = magpie.EvalOverlap.packaged()
        return self._overlap

    def _plan(self) -> Plan:
        return Plan(**self.state["plan"])

    def _rates(self) -> Rates:
        return Rates(**self.state["rates"])

    def _epochs(self) -> float:
        """The epochs, fixed when training first starts (a resumed training keeps its steps)."""
        record = self.state["stages"].setdefault("train", {"done": False, "seconds": 0.0})
        if "epochs" not in record:
            conversations = self.state["stages"].get("answers", {}).get("conversations", self._plan().prompts)
            epochs = self._plan().epochs
            if self.cfg.budget and self.cfg.epochs is None:
                left = self.cfg.budget - self._elapsed()
                epochs = refit_epochs(left, self._rates(), conversations, epochs)
            record["epochs"] = epochs
        return record["epochs"]

    def _planned(self) -> dict[str, float]:
        """Seconds each stage should take, from the plan's rates and what the stages before it
        left (the prompts kept, the conversations answered, the epochs fixed)."""
        rates, plan, st = self._rates(), self._plan(), self.state["stages"]
        n = st.get("answers", {}).get("conversations") or st.get("prompts", {}).get("kept") or plan.prompts
        epochs = st.get("train", {}).get("epochs", plan.epochs)
        return {"prompts": (plan.prompts + self.state["held_out"]) / rates.keep * rates.turn,
                "answers": n * rates.answer, "train": n * epochs * rates.train, "tune": rates.tune}

    def _left(self, stage: str, fraction: float) -> float:
        """Seconds the run has left: this stage's rest at the rate it has gone so far (its plan
        until it has run a little), and the later stages' plans."""
        planned = self._planned()
        ran = time.perf_counter() - self._stage_t0
        rest = ran * (1 - fraction) / fraction if fraction > 0.02 and ran > 5 else planned[stage] * (1 - fraction)
        later = STAGES[STAGES.index(stage) + 1:]
        return rest + sum(planned[s] for s in later if not self.state["stages"].get(s, {}).get("done"))

    def _over(self, stage: str, record: dict) -> bool:
        """Whether a data stage has run past its share of the budget (with a minute's slack)."""
        if not self.cfg.budget:
            return False
        spent = record["seconds"] + time.perf_counter() - self._stage_t0
        return spent > OVERRUN * self._planned()[stage] + 60

    def _elapsed(self) -> float:
        """Seconds this run has taken: earlier sessions' stages and this session."""
        earlier = self.state.get("earlier_seconds", 0.0)
        return earlier + time.perf_counter() - self.started

    def _relay(self, stage: str, inner: str) -> Callable[[Progress], None]:
        """A callback for the capture's or the trainer's reports, passed on as ``stage``'s."""
        first = {}

        def report(p: Progress):
            if p.stage != inner or not p.total:
                return
            first.setdefault("done", p.done)
            fraction = (p.done - first["done"]) / max(p.total - first["done"], 1)
            self.callback(Progress(stage, p.done, p.total, {**p.info, "left": self._left(stage, fraction)}))
            self._save_progress(stage)

        return report

    def _progress(self, stage: str, fraction: float, done: int, total: int) -> None:
        self.callback(Progress(stage, done, total, {"left": self._left(stage, fraction)}))
        self._save_progress(stage)

    def _say(self, stage: str, line: str) -> None:
        log.info("%s", line)
        self.callback(Progress(stage, 0, 0, {"line": line}))

    # ---- state --------------------------------------------------------------------------------

    def _load_state(self) -> dict:
        path = self.out / RUN_FILE
        if not path.exists():
            other = [f for f in ("captured.pt", "checkpoint.pt", "head") if (self.out / f).exists()]
            if other:
                raise ValueError(f"{self.out} holds a train-eagle run on other data ({', '.join(other)}): resume it "
                                 "with its --data or --captured, or train into another --out")
            return {"format": FORMAT, "asked": self.cfg.asked(), "stages": {}}
        state = json.loads(path.read_text())
        if state.get("format") != FORMAT:
            raise ValueError(f"{path} is not a treespec train-eagle run: use another --out")
        diff = [k for k, v in self.cfg.asked().items() if state["asked"].get(k) != v]
        if diff:
            raise ValueError(f"{self.out} holds a run asked with other settings ("
                             + ", ".join(f"{k} {state['asked'].get(k)!r} there, {getattr(self.cfg, k, None)!r} here"
                                         if k != "eagle3" else "the head's layout" for k in diff)
                             + "): resume it with the same ones, or train into another --out")
        state["earlier_seconds"] = sum(s.get("seconds", 0.0) for s in state["stages"].values()) \
            + state.get("measure_seconds", 0.0)
        return state

    def _save_progress(self, stage: str) -> None:
        """The stage's time so far, saved at most every half minute (a stopped run's budget
        then counts it)."""
        now = time.perf_counter()
        if now - self._saved_at > 30:
            record = self.state["stages"][stage]
            saved = dict(record, seconds=record["seconds"] + now - self._stage_t0)
            self._save_state({**self.state["stages"], stage: saved})

    def _save_state(self, stages: dict | None = None) -> None:
        self._saved_at = time.perf_counter()
        if "plan" in self.state and "measure_seconds" not in self.state:
            self.state["measure_seconds"] = self._elapsed() - self.state.get("earlier_seconds", 0.0)
        keep = {k: v for k, v in self.state.items() if k != "earlier_seconds"}
        if stages is not None:
            keep["stages"] = stages
        path = self.out / RUN_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(keep, indent=1) + "\n")
        os.replace(tmp, path)


def asked_before(out_dir) -> dict | None:
    """What the run in ``out_dir`` was asked (model, budget, prompts, answer_tokens, epochs,
    eagle3), or None where there is none: a resumed command need not repeat it."""
    path = Path(out_dir) / RUN_FILE
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    return state.get("asked") if state.get("format") == FORMAT else None


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _prompt_ids(tokenizer, text: str) -> list[int]:
    """A user message through the chat template, as the capture tokenized it."""
    from .data import Example, tokenize_example

    ids, plen = tokenize_example(tokenizer, Example(messages=[{"role": "user", "content": text}]), answer="")
    return ids[:plen]


def _validation(path: Path) -> str:
    """The trainer's validation line, as one phrase."""
    if not path.exists():
        return "no validation (no held-out conversation)"
    fields = dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
    accs = " / ".join(f"{float(a):.3f}" for a in fields.get("top1_by_step", "").split())
    return f"held-out top-1 by step {accs} (loss {float(fields.get('loss', 'nan')):.3f})"
