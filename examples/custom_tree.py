"""A custom static tree: build it from paths, inspect it, draw it, use it, and export it to
vLLM's ``speculative_token_tree``. The picture goes to the system's temporary folder.

    python examples/custom_tree.py
"""

import tempfile
from pathlib import Path

import treespec
from treespec import Tree, TreeConfig
from treespec.models import load
from treespec.viz import save_tree_png

# Two candidates at depth 1, the best one extended to depth 3, the second to depth 2.
paths = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]]
cfg = TreeConfig.static(paths)
tree = Tree.from_paths(paths)
print(cfg.describe(), "parents:", tree.parents.tolist(), "depths:", tree.depth.tolist())
print("ancestor mask:\n", tree.attention_mask().int())
png = Path(tempfile.gettempdir()) / "treespec-custom_tree.png"
save_tree_png(tree, png, title="custom static tree")
print("drew", png)
print("vLLM speculative_token_tree:", cfg.to_vllm())
assert TreeConfig.from_vllm(cfg.to_vllm()) == cfg

model, tok = load("smollm2-135m-instruct")
ids = tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: the cat sat on the mat, "
                                "the cat sat on the mat, the cat sat on the mat."}], add_generation_prompt=True,
                            return_dict=False)
out = treespec.generate(model, "ngram", cfg, ids, max_new_tokens=48)
print(tok.decode(out.sequences[0], skip_special_tokens=True))
print("mean accepted length", round(out.metrics.mean_accepted_length, 2))
