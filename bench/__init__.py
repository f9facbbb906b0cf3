"""mindserve's benchmarks: ``python -m bench COMMAND`` (``bench/__main__.py``), built on ``bench/harness``."""
