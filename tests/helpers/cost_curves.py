"""Synthetic cost curves, in units of one decode step: a curve measured on a shared machine is
noise, and the rules that read one must be pinned on known inputs."""

from treespec.costs import CostCurve

FLAT = CostCurve((1, 128), (1.0, 1.0))  # a GPU-like verify: any tree costs one step
STEEP = CostCurve((1, 2, 128), (1.0, 2.0, 128.0))  # every extra token costs a whole step
MID = CostCurve((1, 2, 128), (1.0, 1.25, 32.75))  # every extra token costs a quarter step
