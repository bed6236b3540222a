"""`dgpp cache`: list, verify and remove the per-rank resident weight images.

The image directory is `--dir`, else `default_cache_dir()`, the same default the engine uses when
`resident_cache_dir` is unset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgpp.appliance.common.exit_codes import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from dgpp.appliance.common.paths import resident_dir


def default_cache_dir() -> Path:
    """The engine's default image directory (see `dgpp.appliance.common.paths.resident_dir`)."""
    return resident_dir()


def add_cache_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = commands.add_parser("cache", help="manage resident weight images")
    cache.add_argument("--dir", type=Path, default=None, help="image directory")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    cache_commands.add_parser("list", help="images with their model, rank, dtype and size")
    for name, purpose in (("verify", "check the full checksum of"), ("remove", "delete")):
        command = cache_commands.add_parser(name, help=f"{purpose} images")
        command.add_argument("paths", nargs="*", type=Path, metavar="PATH", help="image files")
        command.add_argument("--all", action="store_true", help=f"{purpose} every image")


def run_cache(args: argparse.Namespace) -> int:
    from dgpp.engine.planning import resident_cache

    root: Path = args.dir if args.dir is not None else default_cache_dir()
    if args.cache_command == "list":
        images = resident_cache.list_images(root)
        if not images:
            print(f"no resident images in {root}")
        for image in images:
            meta = image.metadata
            if image.problem is not None:
                print(f"{image.path}\tunreadable: {image.problem}")
                continue
            rank = f"rank {meta.get('tp_rank', '?')}/{meta.get('tp_size', '?')}"
            size_mb = image.size_bytes / 2**20
            fields = (meta.get("model", "?"), rank, meta.get("dtype", "?"), f"{size_mb:.0f} MiB")
            print("\t".join((str(image.path), *fields, meta.get("created", "?"))))
        return EXIT_OK
    if args.all == bool(args.paths):
        print(f"dgpp cache {args.cache_command}: give --all or image paths", file=sys.stderr)
        return EXIT_USAGE
    if args.cache_command == "remove":
        removed = resident_cache.remove_images(root, None if args.all else args.paths)
        for path in removed:
            print(f"removed\t{path}")
        if not removed:
            print(f"no resident images in {root}")
        return EXIT_OK
    paths = [image.path for image in resident_cache.list_images(root)] if args.all else args.paths
    if not paths:
        print(f"no resident images in {root}")
    corrupt = []
    for path in paths:
        check = resident_cache.verify_image(path)
        print(f"ok\t{path}" if check.is_ok else f"CORRUPT\t{path}\t{check.problem}")
        if not check.is_ok:
            corrupt.append(str(path))
    if corrupt:
        print(f"dgpp: corrupt resident images: {', '.join(corrupt)}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
