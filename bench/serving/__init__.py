"""The parts of bench/serve_bench.py: servers to start, scenarios to drive them with, the report."""
