"""Training and evaluation prompts that treespec generates itself, reproducibly.

Two sources, both free of hub downloads and of the sets treespec measures on (HumanEval,
GSM8K test):

* **Code** (``stdlib-code``): the docstrings and short sources of Python's standard
  library (PSF licence), read with :mod:`inspect` over a fixed list of modules and turned
  into "write a function that ...", "explain this function" and "how do I use ..." prompts.
  Python's own text, so the output depends on the Python version (recorded in each row's
  ``python`` field); the shipped file was made with the version in ``treespec/data/README.md``.
* **Chat** (``chat-train``, ``chat-eval``): self-instruct style, topics x task templates
  written for treespec (no third-party text). The evaluation set uses topics *and*
  templates that the training set never uses, so it measures generalisation to unseen chat.

Every list is in a fixed order (a seeded shuffle), so that any prefix is a balanced sample
(a capture of the first N prompts covers every module and topic kind).

Regenerate the shipped files (from the repository root)::

    treespec make-prompts --templated --out treespec/data
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import io
import json
import random
import re
import sys
import textwrap
import warnings
from pathlib import Path

__all__ = ["stdlib_code_prompts", "chat_prompts", "write_jsonl_gz", "write_templated_sets", "STDLIB_MODULES",
           "CHAT_TOPICS", "CHAT_TEMPLATES", "EVAL_TOPICS", "EVAL_TEMPLATES"]

# Pure-Python or ubiquitous modules, present on every platform: the output does not depend
# on the operating system, only on the Python version.
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "cmd",
    "codecs", "collections", "collections.abc", "colorsys", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email.utils", "enum", "filecmp",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib",
    "heapq", "hmac", "html", "html.parser", "http.cookies", "inspect", "io", "ipaddress", "itertools",
    "json", "keyword", "linecache", "locale", "logging", "math", "mimetypes", "numbers", "operator",
    "os.path", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "posixpath", "pprint",
    "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "sqlite3",
    "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "types", "typing", "unicodedata", "urllib.parse", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zlib",
)

_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)", re.S)
# A first sentence worth asking about: it says what the object does, in plain words.
_GOOD_START = re.compile(r"^[A-Z][a-z]+s?\b")
_BAD = re.compile(r">>>|\bDeprecated\b|\bdeprecated\b|\bSee\b|\bXXX\b|\bInternal\b|\binternal\b|\bhelper\b|"
                  r"\bundocumented\b|\bbackward|\bcompat|^Same as|^Alias|^This method|^Abstract|^Implementation")


def _first_sentence(doc: str) -> str | None:
    para = doc.strip().split("\n\n", 1)[0]
    para = " ".join(para.split())
    m = _SENTENCE.match(para)
    if not m:
        return None
    s = m.group(1)
    if not (25 <= len(s) <= 160) or not _GOOD_START.match(s) or _BAD.search(s):
        return None
    if "(" in s.split(" ", 1)[0] or s.count("`") % 2 or s.count("(") != s.count(")"):
        return None  # a signature line (builtins) or unbalanced markup
    return s


class _Source(str):
    """A default written as the expression it came from (``sys.executable``), not its value."""

    def __repr__(self):
        return str(self)


def _machine_values() -> dict[str, str]:
    """Values that name this machine's folders, each with the expression a signature shows
    instead: ``platform.architecture(executable=sys.executable)`` must not ship the path of
    the interpreter that built the prompts (issue 31)."""
    import os
    import tempfile

    named = {"sys.executable": [sys.executable, getattr(sys, "_base_executable", None)],
             "sys.prefix": [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix],
             "os.getcwd()": [os.getcwd()], "tempfile.gettempdir()": [tempfile.gettempdir()],
             "os.path.expanduser('~')": [os.path.expanduser("~")]}
    return {v: expr for expr, values in named.items() for v in values if v}


# An absolute path of two components or more (POSIX or Windows), a home folder: machine-specific.
_PATH = re.compile(r"^(/[^/\s]+/|~/|[A-Za-z]:\\)")


def _portable_default(default):
    """``default`` as a signature may ship it: a value naming this machine's folders becomes
    the expression it came from, any other absolute path ``...``."""
    if not isinstance(default, str):
        return default
    expr = _machine_values().get(default)
    if expr is not None:
        return _Source(expr)
    return _Source("...") if _PATH.match(default) else default


def _signature(obj) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    sig = sig.replace(parameters=[p.replace(default=_portable_default(p.default)) for p in sig.parameters.values()])
    text = str(sig)
    # A default shown as ``<object at 0x...>`` changes every run and reads as noise.
    return text if len(text) <= 80 and "<" not in text else None


def _objects(modname: str):
    """``(qualified name, object)`` of the public functions, classes and methods defined in
    module ``modname`` (not re-exported from elsewhere), by name."""
    mod = importlib.import_module(modname)
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) is None:
            continue
        if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
            continue
        owner = obj.__module__
        if owner != modname and owner.lstrip("_") != modname.rsplit(".", 1)[-1]:
            continue
        yield name, obj
        if inspect.isclass(obj):
            for mname, meth in sorted(vars(obj).items()):
                if mname.startswith("_") or not (inspect.isfunction(meth) or inspect.ismethoddescriptor(meth)):
                    continue
                yield f"{name}.{mname}", meth


def _short_source(obj) -> str | None:
    if not inspect.isfunction(obj):
        return None
    try:
        src = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None
    lines = src.strip("\n").splitlines()
    if not (4 <= len(lines) <= 30) or len(src) > 1200 or any(len(line) > 100 for line in lines):
        return None
    return "\n".join(lines)


def stdlib_code_prompts(modules=STDLIB_MODULES, seed: int = 0) -> list[dict]:
    """Code prompts from the standard library's docstrings and sources, deduplicated,
    in a seeded order. Each row: ``{"prompt", "kind", "source", "python"}``."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    rows, seen_sentences, seen_prompts = [], set(), set()
    for modname in modules:
        try:
            with warnings.catch_warnings():  # typing.io and the like warn when their docstrings are read
                warnings.simplefilter("ignore", DeprecationWarning)
                _objects_list = [(q, o, inspect.getdoc(o)) for q, o in _objects(modname)]
        except ImportError:
            continue
        for qual, obj, doc in _objects_list:
            sentence = _first_sentence(doc) if doc else None
            if sentence is None or sentence in seen_sentences:
                continue
            seen_sentences.add(sentence)
            short = qual.rsplit(".", 1)[-1]
            sig = _signature(obj)
            src = _short_source(obj)
            where = f"{modname}.{qual}"
            cands = []
            if inspect.isclass(obj):
                cands.append(("write", f"Implement a small Python class named `{short}`. Its purpose: {sentence} "
                                       f"Keep it simple and show how to use it."))
            elif sig is not None and "." in qual and sig.startswith("(self"):
                cands.append(("write", f"Write a method `{short}{sig}` for a Python class `{qual.split('.')[0]}`. "
                                       f"What it should do: {sentence} Include a docstring."))
            elif sig is not None:
                cands.append(("write", f"Write a Python function `{short}{sig}`. What it should do: {sentence} "
                                       f"Include a docstring and a short usage example."))
            cands.append(("howto", f"How do I use `{where}` in Python? Its documentation says: \"{sentence}\" "
                                   f"Give a short example with an explanation."))
            if src is not None:
                cands.append(("explain", f"Explain what this Python function does, step by step.\n\n```python\n"
                                         f"{src}\n```"))
            # Every task per object: writing, using and reading code are different replies.
            for kind, prompt in cands:
                if prompt not in seen_prompts:
                    seen_prompts.add(prompt)
                    rows.append({"prompt": prompt, "kind": kind, "source": where, "python": py})
    random.Random(seed).shuffle(rows)
    return rows


# ---- chat (self-instruct style) -----------------------------------------------------------

# Topics for training prompts: everyday knowledge, science, history, work, hobbies,
# technology, written for treespec.
CHAT_TOPICS = (
    "the water cycle", "photosynthesis", "the phases of the moon", "how vaccines work", "black holes",
    "plate tectonics", "the greenhouse effect", "how rainbows form", "the human immune system",
    "DNA and genes", "the solar system", "volcanoes", "ocean tides", "how bees make honey",
    "the life cycle of a butterfly", "electric circuits", "magnets", "the speed of light", "sound waves",
    "how airplanes fly", "the Roman Empire", "the printing press", "the Industrial Revolution",
    "ancient Egypt", "the Silk Road", "the Renaissance", "the history of the internet",
    "the invention of the telephone", "the first moon landing", "the history of chocolate",
    "compound interest", "making a monthly budget", "saving for retirement", "index funds",
    "credit scores", "paying off debt", "inflation", "supply and demand", "starting a small business",
    "negotiating a salary", "preparing for a job interview", "writing a resume", "working from home",
    "time management", "running effective meetings", "giving constructive feedback",
    "learning a new language", "studying for exams", "taking good notes", "public speaking",
    "writing a persuasive essay", "reading more books", "keeping a journal", "learning to play guitar",
    "learning to draw", "photography for beginners", "gardening on a balcony", "growing tomatoes",
    "composting at home", "keeping houseplants alive", "baking sourdough bread", "making fresh pasta",
    "cooking rice perfectly", "meal prepping for a week", "vegetarian protein sources", "brewing coffee",
    "making a healthy breakfast", "food safety in the kitchen", "knife skills", "baking chocolate chip cookies",
    "running a first 5k", "stretching before exercise", "strength training for beginners",
    "getting better sleep", "staying hydrated", "managing stress", "mindfulness meditation",
    "good posture at a desk", "walking for health", "yoga for beginners", "cycling to work",
    "planning a road trip", "packing light for travel", "visiting Japan", "camping for the first time",
    "hiking safety", "travelling on a budget", "dealing with jet lag", "learning to swim",
    "adopting a dog", "training a puppy", "caring for a cat", "keeping backyard chickens",
    "setting up a fish tank", "bird watching", "recycling", "reducing food waste", "saving energy at home",
    "solar panels", "electric cars", "wind power", "water conservation", "protecting bees",
    "how search engines work", "how email works", "password security", "two-factor authentication",
    "backing up your files", "cloud storage", "how Wi-Fi works", "how GPS works", "machine learning",
    "how a computer's CPU works", "the difference between RAM and storage", "open source software",
    "version control with git", "learning to code", "how websites are built", "spreadsheets",
    "phishing emails", "online privacy", "smartphone battery life", "video calls",
    "chess strategy", "solving a Rubik's cube", "board games for families", "writing a short story",
    "writing poetry", "painting with watercolours", "knitting", "woodworking", "building a birdhouse",
    "organising a closet", "moving to a new city", "making friends as an adult", "planning a wedding",
    "hosting a dinner party", "writing a thank-you note", "apologising well", "active listening",
    "resolving a conflict with a roommate", "raising a toddler", "teaching kids about money",
    "helping a child with homework", "caring for elderly parents", "volunteering", "voting in an election",
    "how a bill becomes law", "the water supply of a city", "how bridges stay up", "skyscrapers",
    "trains and railways", "the history of the bicycle", "how a refrigerator works", "how microwaves heat food",
    "why the sky is blue", "why leaves change colour in autumn", "earthquakes", "hurricanes",
    "snowflakes", "the northern lights", "dinosaurs", "evolution", "the human heart", "the human brain",
    "sleep and dreams", "the sense of smell", "allergies", "the common cold", "first aid for burns",
    "healthy eating habits", "sugar and teeth", "reading food labels", "the Olympic Games",
    "the rules of football", "the history of jazz", "how an orchestra works", "learning to sing",
    "film making on a phone", "starting a podcast", "writing a blog", "social media habits",
    "customer service", "selling things online", "marketing a local shop", "pricing a product",
    "writing a business plan", "project management", "remote teams", "leadership", "mentoring",
    "asking for a raise", "changing careers", "studying abroad", "choosing a university",
    "applying for a scholarship", "the scientific method", "statistics in everyday life", "probability",
    "prime numbers", "fractions", "geometry in architecture", "the Pythagorean theorem",
    "measuring time", "calendars", "maps and navigation", "world capitals", "the Amazon rainforest",
    "deserts", "coral reefs", "glaciers", "rivers", "mountains", "islands", "national parks",
    "museums", "libraries", "architecture styles", "fashion history", "recycling clothes",
    "repairing a bicycle tyre", "fixing a leaking tap", "painting a room", "home insulation",
    "choosing a laptop", "setting up a home network", "keyboard shortcuts", "writing clear emails",
    "summarising a long article", "critical thinking", "spotting misinformation", "making decisions",
    "setting goals", "building habits", "motivation", "procrastination", "gratitude", "kindness",
)

# Task templates for training prompts ({topic} is filled in).
CHAT_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Explain {topic} to a ten-year-old.",
    "What are the most important things to know about {topic}?",
    "Give me five practical tips about {topic}.",
    "Write a short blog post about {topic}.",
    "What are common mistakes people make with {topic}, and how can they avoid them?",
    "Write a short poem about {topic}.",
    "Summarise {topic} in three bullet points.",
    "What are the pros and cons of {topic}?",
    "Write a friendly email to a colleague recommending they learn about {topic}.",
    "Create a simple step-by-step guide to {topic}.",
    "What questions should a beginner ask about {topic}?",
    "Tell me an interesting fact about {topic} and explain why it is true.",
    "Write a short dialogue between a teacher and a student about {topic}.",
    "How would you explain {topic} to someone who has never heard of it?",
    "Give a one-paragraph overview of {topic}.",
)

# Held out: topics and templates that no training prompt uses.
EVAL_TOPICS = (
    "the history of tea", "how submarines dive", "the life of honeybee queens", "urban farming",
    "how elevators work", "the Great Wall of China", "learning sign language", "choosing running shoes",
    "how glass is made", "migrating birds", "making soap at home", "the history of the piano",
    "how paper is recycled", "lighthouses", "the science of baking powder", "caring for a bonsai tree",
    "how noise-cancelling headphones work", "the Mars rovers", "writing a eulogy", "planning a garden party",
    "how lightning forms", "the history of maps", "tidying a garage", "how cheese is made",
)
EVAL_TEMPLATES = (
    "I am curious about {topic}. Can you tell me how it works?",
    "Write a brief newsletter paragraph on {topic} for a general audience.",
)


def chat_prompts(split: str = "train", seed: int = 0) -> list[dict]:
    """Self-instruct style chat prompts: ``split="train"`` combines every training topic
    with every training template; ``"eval"`` the held-out topics with the held-out
    templates. Rows ``{"prompt", "topic", "template"}`` in a seeded order."""
    topics, templates = {"train": (CHAT_TOPICS, CHAT_TEMPLATES), "eval": (EVAL_TOPICS, EVAL_TEMPLATES)}[split]
    rows = [{"prompt": tpl.format(topic=t), "topic": t, "template": i}
            for t in topics for i, tpl in enumerate(templates)]
    random.Random(seed).shuffle(rows)
    return rows


def write_jsonl_gz(rows: list[dict], path) -> Path:
    """Byte-reproducible gzip JSONL (no timestamp in the gzip header)."""
    path = Path(path)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as g:
        for r in rows:
            g.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    path.write_bytes(buf.getvalue())
    return path


def write_templated_sets(out) -> list[tuple[Path, int]]:
    """Write the shipped templated sets (``stdlib_code``, ``chat_train``, ``chat_eval``, gzip
    JSONL) into the folder ``out``: ``treespec make-prompts --templated --out treespec/data``.
    Returns each file and its number of prompts."""
    out = Path(out)
    written = []
    for fname, rows in (("stdlib_code.jsonl.gz", stdlib_code_prompts()),
                        ("chat_train.jsonl.gz", chat_prompts("train")),
                        ("chat_eval.jsonl.gz", chat_prompts("eval"))):
        written.append((write_jsonl_gz(rows, out / fname), len(rows)))
    return written
