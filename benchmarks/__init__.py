"""The benchmark scripts behind the figures in docs/ (map: benchmarks/README.md).

A package only so that the scripts share :mod:`benchmarks.timing`; it is not part of the
installed library (pyproject.toml packages ``treespec*`` only).
"""
