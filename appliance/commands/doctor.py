"""`dgpp doctor`: the node's health for serving, one line per check with the fix.

Exit status: 0 healthy (every check passed or is unknown), 1 with a warning, 2 with a failure
(`dgpp.appliance.doctor.check.exit_code`). A node without a GPU reports "no GPU" and is healthy.
"""

from __future__ import annotations

import argparse
import os
import sys

from dgpp.appliance.doctor.check import exit_code
from dgpp.appliance.doctor.probe import Probe
from dgpp.appliance.doctor.report import Options, RdmaChecks, render_json, render_text, run_checks


def add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check this node for serving: GPU clocks and power, ptxas, memory, CPU, RDMA, engine",
        description="Exit status: 0 healthy, 1 a warning, 2 a failure.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--url",
        default=None,
        help="the head's base URL (default: this node's, from its deployment)",
    )
    doctor.add_argument(
        "--api-key", default=None, help="the API key for /v1/metrics (default: $DGPP_API_KEY)"
    )
    doctor.add_argument("--interface", default=None, help="the cluster network interface")
    doctor.add_argument(
        "--root", default="/", help="read the node's files under this folder (recorded fixtures)"
    )


def run_doctor(args: argparse.Namespace) -> int:
    options = Options(
        url=args.url,
        api_key=args.api_key or os.environ.get("DGPP_API_KEY") or None,
        interface=args.interface,
    )
    checks = run_checks(Probe(args.root), options, _rdma_checks())
    sys.stdout.write(render_json(checks) if args.json else render_text(checks))
    return exit_code(checks)


def _rdma_checks() -> RdmaChecks | None:
    """The RDMA/NCCL checks, where this install has them."""
    try:
        from dgpp.appliance.doctor.rdma import rdma_checks
    except ImportError:
        return None
    return rdma_checks
