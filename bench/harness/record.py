"""The one result format and its one name: ``bench/results/<scenario>-<date>-<host>.json``.

A record is ``{"format", "scenario", "date", "host", "machine", "results"}``: ``machine`` is
``machine_facts()`` (CPU, kernel variant, bandwidth, commit, command line), ``results`` the scenario's own
numbers. ``read_record`` refuses a file that is not one.
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

FORMAT = "mindserve-bench/1"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
_SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
KEYS = ("format", "scenario", "date", "host", "machine", "results")


class ResultError(ValueError):
    """A scenario or host name that cannot be part of a result name, or a file that is not a record."""


def host_label(hostname: str | None = None) -> str:
    """The host part of a result name: the hostname's first label, lower case, other characters as ``-``."""
    label = (hostname or socket.gethostname()).split(".")[0].lower()
    return re.sub(r"[^a-z0-9]+", "-", label).strip("-") or "host"


def result_name(scenario: str, date: str, host: str) -> str:
    """``<scenario>-<date>-<host>.json``; the scenario and host are lower-case words joined by ``-``."""
    for what, value in (("scenario", scenario), ("host", host)):
        if not _SLUG.fullmatch(value):
            raise ResultError(f"{what} {value!r} must be lower-case letters and digits joined by '-'")
    if not _DATE.fullmatch(date):
        raise ResultError(f"date {date!r} must be YYYY-MM-DD")
    return f"{scenario}-{date}-{host}.json"


def result_path(scenario: str, *, date: str | None = None, host: str | None = None,
                directory: Path = RESULTS_DIR) -> Path:
    return directory / result_name(scenario, date or time.strftime("%Y-%m-%d"), host or host_label())


def record(scenario: str, results: Any, machine: dict[str, Any], *, date: str | None = None) -> dict[str, Any]:
    """A record of ``results`` measured on ``machine`` (``machine_facts()``)."""
    host = host_label(machine.get("host"))
    date = date or time.strftime("%Y-%m-%d")
    result_name(scenario, date, host)  # the name must be writable
    return {"format": FORMAT, "scenario": scenario, "date": date, "host": host, "machine": machine,
            "results": results}


def write_record(rec: dict[str, Any], path: Path | None = None, *, directory: Path = RESULTS_DIR) -> Path:
    """Write ``rec`` to ``path`` (default: its name under ``directory``); the path written."""
    check(rec)
    path = path or directory / result_name(rec["scenario"], rec["date"], rec["host"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return path


def read_record(path: Path) -> dict[str, Any]:
    rec = json.loads(Path(path).read_text())
    check(rec, where=str(path))
    return rec


def check(rec: Any, where: str = "record") -> None:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ResultError(f"{where} is not a {FORMAT} record")
    missing = [k for k in KEYS if k not in rec]
    if missing:
        raise ResultError(f"{where} lacks {', '.join(missing)}")
    result_name(rec["scenario"], rec["date"], rec["host"])


def results_of(data: dict[str, Any]) -> Any:
    """A record's ``results``; a file written before the record format (``bench/results/``' older ones) as is."""
    return data["results"] if isinstance(data, dict) and data.get("format") == FORMAT else data


def add_output_arguments(ap: argparse.ArgumentParser) -> None:
    """``--json PATH`` and ``--save``: where a scenario's record goes (both, either or neither)."""
    ap.add_argument("--json", type=Path, default=None, help="also write the result record to this file")
    ap.add_argument("--save", action="store_true",
                    help="also write the result record to bench/results/<scenario>-<date>-<host>.json")


def save_results(args: argparse.Namespace, scenario: str, results: Any, *, bandwidth: bool = False,
                 machine: dict[str, Any] | None = None) -> list[Path]:
    """The record of ``results`` written where ``--json``/``--save`` say; the paths written."""
    if not (getattr(args, "json", None) or getattr(args, "save", False)):
        return []
    from bench.harness.machine import machine_facts

    rec = record(scenario, results, machine or machine_facts(bandwidth=bandwidth))
    paths = [write_record(rec, args.json)] if args.json else []
    if getattr(args, "save", False):
        paths.append(write_record(rec))
    for path in paths:
        print(f"result record: {path}")
    return paths
