"""The files the ``service`` package ships beside its code, found through ``importlib.resources`` so that an
editable install (the source tree) and a wheel (site-packages) read them the same way.

* ``schemas/``: the request/response JSON Schemas. In the source tree ``service/schemas`` is a symlink to
  the top-level ``schemas/`` (the directory client teams read); a wheel carries a copy.
* ``server.yaml``: the default server config, a symlink to ``configs/server.yaml`` likewise.
* ``static/``: the playground page's files.
"""
from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable

PACKAGE = "service"

SCHEMA_DIR: Traversable = resources.files(PACKAGE) / "schemas"
DEFAULT_CONFIG: Traversable = resources.files(PACKAGE) / "server.yaml"
STATIC_DIR: Traversable = resources.files(PACKAGE) / "static"
