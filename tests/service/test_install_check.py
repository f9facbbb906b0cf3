"""The refusal to run beside another distribution that installs ``service`` or ``backends``, on real
distribution metadata written to a directory (``importlib.metadata`` reads it as it reads site-packages)."""
from __future__ import annotations

from importlib import metadata

from service.__main__ import main
from service.install_check import import_name_conflict


def write_dist(root, name: str, version: str, *, top_level: str | None = None, record: str | None = None) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)
    if record is not None:
        (info / "RECORD").write_text(record)


def dists(root):
    return list(metadata.distributions(path=[str(root)]))


def test_other_distributions_installing_our_names_are_named(tmp_path):
    write_dist(tmp_path, "mindserve", "0.1.0", top_level="backends\nservice\n")
    write_dist(tmp_path, "acme_service", "1.2", top_level="service\nacme\n")
    write_dist(tmp_path, "flat", "3.0", record="backends/__init__.py,sha256=x,10\nflat.py,sha256=y,5\n")
    write_dist(tmp_path, "fine", "1.0", top_level="servicex\nrequests\n")
    write_dist(tmp_path, "fine2", "1.0", record="service_tools/__init__.py,,\nbackends_extra.py,,\n")
    message = import_name_conflict(dists(tmp_path))
    assert message is not None
    assert "'backends' also by flat 3.0; 'service' also by acme_service 1.2" in message
    assert "mindserve 0.1.0" not in message and "fine" not in message
    assert "own virtual environment" in message


def test_a_single_file_module_of_the_same_name_counts(tmp_path):
    write_dist(tmp_path, "single", "1.0", record="service.py,sha256=x,10\n")
    assert "'service' also by single 1.0" in import_name_conflict(dists(tmp_path))


def test_mindserve_alone_is_fine(tmp_path):
    write_dist(tmp_path, "MindServe", "0.1.0", top_level="backends\nservice\n")  # names compare canonically
    write_dist(tmp_path, "other", "1.0", top_level="other\n")
    assert import_name_conflict(dists(tmp_path)) is None


def test_this_environment_has_no_conflict():
    assert import_name_conflict() is None


def test_the_command_line_refuses_to_start(tmp_path, monkeypatch, capsys):
    write_dist(tmp_path, "acme_service", "1.2", top_level="service\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["validate-config", str(tmp_path / "never-read.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mindserve: error: ") and "acme_service 1.2" in err and "never-read" not in err

