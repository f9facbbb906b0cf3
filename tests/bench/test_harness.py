"""bench/harness and ``python -m bench``: the result format and its name, the machine facts, the command table
and its argument errors. Nothing here measures or starts anything."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from bench import harness
from bench.__main__ import COMMANDS
from bench.__main__ import main as bench_main
from bench.harness import machine
from bench.harness.record import ResultError, check
from tests.support.paths import REPO


# --- the name --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario, date, host, name", [
    ("serve", "2026-12-07", "zen3", "serve-2026-12-07-zen3.json"),
    ("engine-speed", "2026-01-31", "vm", "engine-speed-2026-01-31-vm.json"),
    ("kv-cache-dtype", "2027-02-03", "box-2", "kv-cache-dtype-2027-02-03-box-2.json"),
])
def test_result_name_is_scenario_date_host(scenario: str, date: str, host: str, name: str) -> None:
    assert harness.result_name(scenario, date, host) == name


@pytest.mark.parametrize("scenario, date, host, word", [
    ("Serve", "2026-12-07", "zen3", "scenario"),
    ("serve_bench", "2026-12-07", "zen3", "scenario"),
    ("serve-", "2026-12-07", "zen3", "scenario"),
    ("", "2026-12-07", "zen3", "scenario"),
    ("serve", "07-12-2026", "zen3", "date"),
    ("serve", "2026-12-7", "zen3", "date"),
    ("serve", "2026-12-07", "zen3.lan", "host"),
    ("serve", "2026-12-07", "", "host"),
])
def test_result_name_refuses_what_would_break_the_scheme(scenario: str, date: str, host: str, word: str) -> None:
    with pytest.raises(ResultError, match=word):
        harness.result_name(scenario, date, host)


@pytest.mark.parametrize("hostname, label", [
    ("zen3", "zen3"), ("Build-Box.example.com", "build-box"), ("my_vm 2", "my-vm-2"), ("___", "host"),
])
def test_host_label_makes_a_name_part(hostname: str, label: str) -> None:
    assert harness.host_label(hostname) == label
    harness.result_name("serve", "2026-12-07", label)


def test_result_path_defaults_to_bench_results_today_here() -> None:
    path = harness.result_path("soak")
    assert path.parent == REPO / "bench" / "results" == harness.RESULTS_DIR
    assert re.fullmatch(r"soak-\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.json", path.name), path.name


# --- the record ------------------------------------------------------------------------------------------

FACTS = {"host": "Zen3.lan", "cpu_model": "AMD Ryzen 5 5600X", "kernel_variant": "x86-64-v3", "commit": "abc"}


def test_a_record_round_trips_under_its_name(tmp_path: Path) -> None:
    rec = harness.record("engine-speed", {"tok_s": [1.5, 2.5]}, FACTS, date="2026-12-07")
    assert rec["host"] == "zen3" and rec["machine"] == FACTS and rec["format"] == harness.FORMAT
    path = harness.write_record(rec, directory=tmp_path)
    assert path == tmp_path / "engine-speed-2026-12-07-zen3.json"
    assert harness.read_record(path) == rec
    other = harness.write_record(rec, tmp_path / "sub" / "mine.json")
    assert json.loads(other.read_text()) == rec


def test_a_file_that_is_not_a_record_is_refused(tmp_path: Path) -> None:
    rec = harness.record("soak", {}, FACTS, date="2026-12-07")
    cases = {"old.json": {"date": "2026-11-29", "servers": {}},
             "lacks.json": {k: v for k, v in rec.items() if k != "machine"},
             "renamed.json": {**rec, "scenario": "Soak Test"}}
    for name, data in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(ResultError):
            harness.read_record(tmp_path / name)
    with pytest.raises(ResultError, match="lacks machine"):
        check(cases["lacks.json"])


def test_results_of_reads_a_record_and_an_older_file() -> None:
    rec = harness.record("serve", {"scenarios": {"c1": {}}}, FACTS, date="2026-12-07")
    assert harness.results_of(rec) == {"scenarios": {"c1": {}}}
    older = {"date": "2026-11-29", "scenarios": {"c16": {}}}
    assert harness.results_of(older) is older


def test_save_results_writes_only_where_asked(tmp_path: Path, capsys) -> None:
    ap = argparse.ArgumentParser()
    harness.add_output_arguments(ap)
    assert harness.save_results(ap.parse_args([]), "lora-step", {"x": 1}, machine=FACTS) == []
    target = tmp_path / "out.json"
    written = harness.save_results(ap.parse_args(["--json", str(target)]), "lora-step", {"x": 1}, machine=FACTS)
    assert written == [target] and str(target) in capsys.readouterr().out
    rec = harness.read_record(target)
    assert (rec["scenario"], rec["results"], rec["machine"]) == ("lora-step", {"x": 1}, FACTS)


# --- the machine -----------------------------------------------------------------------------------------

def test_machine_facts_name_the_cpu_variant_commit_and_command() -> None:
    facts = harness.machine_facts(bandwidth=False, argv=["python -m bench serve", "--quick", "--json", "a b.json"])
    assert facts["command"] == "python -m bench serve --quick --json 'a b.json'"
    assert isinstance(facts["cpus"], int) and facts["cpus"] >= 1
    assert facts["cpu_model"] and facts["os_kernel"] and facts["machine"]
    from backends.mindspore.kernels.build import VARIANTS

    assert facts["kernel_variant"] in {v.name for v in VARIANTS} | {None}
    assert facts["commit"] is None or re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", facts["commit"]), facts["commit"]
    assert len(facts["load_avg"]) == 3 and "memory_bandwidth" not in facts


def test_a_script_run_is_recorded_with_its_path() -> None:
    assert machine.command_line(["bench/serve_bench.py", "--quick"]).endswith("bench/serve_bench.py --quick")


@pytest.mark.parametrize("cpuinfo, model", [
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD Ryzen 5 5600X 6-Core Processor\n",
     "AMD Ryzen 5 5600X 6-Core Processor"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n", "0xd0c"),
    ("Hardware\t: BCM2835\nCPU part\t: 0xd08\n", "BCM2835"),
])
def test_cpu_model_from_cpuinfo(cpuinfo: str, model: str) -> None:
    assert machine.cpu_model(cpuinfo) == model


def test_memory_bandwidth_is_measured() -> None:
    bw = machine.memory_bandwidth(reps=2, nbytes=1 << 20)
    assert bw["read_gbs"] > 0 and bw["copy_gbs"] > 0 and len(bw["read_all"]) == 2
    assert bw["read_gbs"] == max(bw["read_all"])


# --- python -m bench -------------------------------------------------------------------------------------

def test_every_command_is_a_module_with_a_main() -> None:
    for name, (module, doc) in COMMANDS.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) and doc
        assert callable(importlib.import_module(module).main), module


def test_no_command_or_help_prints_the_table(capsys) -> None:
    assert bench_main([]) == 2
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_an_unknown_command_is_refused_with_the_table(capsys) -> None:
    assert bench_main(["engine_speed"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'engine_speed'" in err and "engine-speed" in err


@pytest.mark.parametrize("argv, words", [
    (["capped-start"], "the following arguments are required: config"),
    (["capped-start", "x.yaml", "--cap-gib", "many"], "invalid float value"),
    (["engine-speed", "--kernels", "ms"], "invalid choice: 'ms'"),
    (["structured", "--clients"], "expected at least one argument"),
])
def test_argument_errors_exit_2_naming_the_command(argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        bench_main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert words in err and f"python -m bench {argv[0]}" in err


SHIMS = ("backends.mindspore.model", "backends.mindspore.runner")


def test_bench_imports_the_backends_real_names() -> None:
    """No shim module and no ``load_model_spec``: bench imports what the backend calls its names."""
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in SHIMS, f"{path}:{node.lineno} imports {node.module}"
                assert all(a.name != "load_model_spec" for a in node.names), f"{path}:{node.lineno}"
            elif isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & set(SHIMS), f"{path}:{node.lineno}"


def test_a_server_is_this_checkouts_however_the_venv_was_installed(monkeypatch) -> None:
    from bench.harness.server import serve_command, serve_env

    cmd = serve_command(Path("/tmp/s.yaml"), 1234, "gemma3-270m", python="/venv/bin/python")
    assert cmd == ["/venv/bin/python", "-m", "service", "serve", "--config", "/tmp/s.yaml", "--port", "1234",
                   "gemma3-270m"]
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = serve_env(Path("/other/checkout"), {"PYTHONUNBUFFERED": "1"})
    assert env["PYTHONPATH"].split(":") == ["/other/checkout", "/elsewhere"] and env["PYTHONUNBUFFERED"] == "1"
    assert serve_env()["PYTHONPATH"].split(":")[0] == str(REPO)
