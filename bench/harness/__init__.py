"""The one way a measurement starts: build an engine or start a server (``engine``, ``server``), note the machine
(``machine_facts``), write one result record under one name (``record``, ``write_record``).

Every scenario of ``python -m bench`` goes through here; this package is also bench's one door into the backend
(``engine.py``), so a move inside ``backends/`` is fixed in one file.
"""
from bench.harness.engine import DEFAULT_MODELS, default_model_dir, engine, runner
from bench.harness.machine import machine_facts
from bench.harness.record import (FORMAT, RESULTS_DIR, ResultError, add_output_arguments, host_label, read_record,
                                  record, result_name, result_path, results_of, save_results, write_record)
from bench.harness.server import server

__all__ = ["DEFAULT_MODELS", "FORMAT", "RESULTS_DIR", "ResultError", "add_output_arguments", "default_model_dir",
           "engine", "host_label", "machine_facts", "read_record", "record", "result_name", "result_path",
           "results_of", "runner", "save_results", "server", "write_record"]
