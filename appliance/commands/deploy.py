"""`dgpp deploy validate|resolve|templates|plan` and `dgpp support-bundle`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dgpp.appliance.common.exit_codes import EXIT_OK
from dgpp.appliance.deployments.files import (
    deployment_id,
    deployment_json,
    list_templates,
    resolve,
)


def add_deploy_parsers(commands: Any) -> None:
    deploy = commands.add_parser("deploy", help="validate and resolve deployment files")
    actions = deploy.add_subparsers(dest="deploy_command", required=True)
    validate = actions.add_parser("validate", help="check a deployment file; print its id")
    validate.add_argument("file", type=Path)
    resolve_parser = actions.add_parser(
        "resolve", help="print the effective deployment: template + file + inventory + --set"
    )
    resolve_parser.add_argument("file", type=Path, nargs="?")
    resolve_parser.add_argument("--inventory", type=Path, default=None, help="Ansible inventory")
    resolve_parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY.PATH=VALUE",
        help="override one key, e.g. engine.kv_capacity=8192 (repeatable)",
    )
    actions.add_parser("templates", help="list the shipped deployment templates")
    plan = actions.add_parser(
        "plan", help="each rank's memory plan: weights, KV per token, largest context, fit"
    )
    plan.add_argument("file", type=Path, nargs="?", help="a deployment file")
    plan.add_argument("--template", default=None, help="a shipped template instead of a file")
    plan.add_argument(
        "--memory-gb", type=float, default=None, help="each node's memory (default: 128, a Spark)"
    )
    bundle = commands.add_parser(
        "support-bundle", help="pack a deployment's logs and resolved config (no secrets)"
    )
    bundle.add_argument("--id", default=None, help="deployment id (default: the newest)")
    bundle.add_argument("--output", "-o", type=Path, default=None, help="the .tar.gz to write")


def run_deploy(args: argparse.Namespace) -> int:
    if args.deploy_command == "templates":
        for template in list_templates():
            raw = template.load()
            print(f"{template.name}\t{raw.get('model')}\tworld {raw.get('world_size', 1)}")
        return EXIT_OK
    if args.deploy_command == "plan":
        return _run_plan(args)
    if args.deploy_command == "validate":
        deployment = resolve(args.file)
        print(f"{args.file}: valid, deployment id {deployment_id(deployment)}")
        return EXIT_OK
    deployment = resolve(args.file, args.inventory, args.overrides)
    sys.stdout.write(deployment_json(deployment))
    print(f"deployment id {deployment_id(deployment)}", file=sys.stderr)
    return EXIT_OK


def _run_plan(args: argparse.Namespace) -> int:
    """Print the plan; exit non-zero (naming the numbers) when a rank does not fit."""
    from dgpp.appliance.deployments.deployment import parse_deployment
    from dgpp.appliance.deployments.files import find_template
    from dgpp.appliance.deployments.kv_dtypes import describe_kv_dtypes, kv_dtype_rows
    from dgpp.appliance.deployments.plan import (
        SPARK_BYTES,
        describe_plans,
        largest_context,
        model_config_of,
        plan_deployment,
        refuse_unfit,
        resolve_deployment,
        spark_memory,
    )
    from dgpp.appliance.deployments.side_plan import (
        describe_side_plans,
        plan_side_models,
        refuse_unfit_sides,
    )

    if args.template is not None:
        deployment = parse_deployment(find_template(args.template).load(), args.template)
    else:
        deployment = resolve(args.file)
    model, source = model_config_of(deployment)
    total = int(args.memory_gb * 1e9) if args.memory_gb else SPARK_BYTES
    memory = spark_memory(total)
    plans = plan_deployment(resolve_deployment(deployment, model, memory), memory)
    print(f"{deployment.model} ({model.quant_method}, from its {source}), world {len(plans)}:")
    print(describe_plans(plans))
    resolved = resolve_deployment(deployment, model, memory)
    weights = plans[0].plan.weights_bytes

    def longest(config: object) -> int:
        return largest_context(config, model, len(plans), 0, memory, weights)  # type: ignore[arg-type]

    context = resolved.engine.max_model_len or model.max_position_embeddings
    chosen = resolved.engine.kv_cache_dtype
    print(f"\nKV-cache dtypes on rank 0 (engine.kv_cache_dtype; this plan: {chosen}):")
    print(describe_kv_dtypes(kv_dtype_rows(resolved, memory, longest), context))
    sides = plan_side_models(deployment, plans, memory)
    if sides:
        print("\nSide models on each node (the main model, every `always` one, the largest "
              "on-demand one):")  # fmt: skip
        print(describe_side_plans(sides))
    refuse_unfit(plans)
    refuse_unfit_sides(sides)
    return EXIT_OK


def run_support_bundle(args: argparse.Namespace) -> int:
    from dgpp.appliance.deployments.support_bundle import write_bundle

    path = write_bundle(args.id, args.output)
    print(path)
    return EXIT_OK
