"""`dgpp nccl-env`: NCCL's and Gloo's environment for a node's cluster interface.

Standard output holds the variables (`NAME=value` lines, or one JSON object with `--json`): the
interface for the sockets, and with ACTIVE RDMA ports behind it every one of them (both twins on
a DGX Spark) in `NCCL_IB_HCA` with the RoCE v2 `NCCL_IB_GID_INDEX`. Standard error holds the
link's findings (`status name: detail (fix)`), for the playbook to report. The `dgpp_rdma` role
runs it on every node and renders the result into the ranks' environment files.
"""

from __future__ import annotations

import argparse
import json
import sys

from dgpp.appliance.common.exit_codes import EXIT_OK, EXIT_USAGE

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-@")


def add_nccl_env_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    nccl_env = commands.add_parser(
        "nccl-env", help="NCCL's environment (NCCL_IB_HCA, GID index, socket interface)"
    )
    nccl_env.add_argument("--interface", required=True, help="the cluster interface")
    nccl_env.add_argument(
        "--root",
        default="/",
        help="read /sys and /etc under this folder instead (tools then are not run)",
    )
    nccl_env.add_argument("--json", action="store_true", help="one JSON object")


def run_nccl_env(args: argparse.Namespace) -> int:
    from dgpp.appliance.doctor.probe import Probe
    from dgpp.appliance.doctor.rdma import nccl_env, rdma_checks
    from dgpp.appliance.doctor.rdma_discovery import SYS_NET, discover_link

    interface: str = args.interface
    # A root other than / is another node's files: this machine's tools would describe this one.
    probe = Probe(args.root) if args.root in ("/", "") else Probe(args.root, env={"PATH": ""})
    known = probe.glob(f"{SYS_NET}/{interface}") or probe.run("ip", "link", "show", interface).text
    if not interface or not set(interface) <= NAME_CHARS or not known:
        print(f"dgpp: error: no network interface {interface!r} on this node", file=sys.stderr)
        return EXIT_USAGE
    env = nccl_env(discover_link(probe, interface))
    for check in rdma_checks(probe, interface, environ={}):
        fix = f" ({check.fix})" if check.fix else ""
        print(f"{check.status} {check.name}: {check.detail}{fix}", file=sys.stderr)
    if args.json:
        print(json.dumps(env, sort_keys=True))
    else:
        print("\n".join(f"{name}={value}" for name, value in sorted(env.items())))
    return EXIT_OK
