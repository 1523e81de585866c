"""What several test files share (a package, so that no installed ``helpers`` shadows it):
tiny models, references from HF ``generate``, a chi-square test, random trees, EAGLE heads
written by hand, target/drafter pairs, synthetic cost curves, a small capture, command-line
runs and the rejection-sampling reference. Fixtures are in ``tests/conftest.py``."""
