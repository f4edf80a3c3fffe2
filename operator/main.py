"""`pagedinfer operator`: run the InferenceService operator.

kopf runs the handlers of handlers.py with the settings below. kopf is imported in
`run` (and `operate`), so that the CLI's other commands never load it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import kopf


def _default_image() -> str:
    try:
        return f"pagedinfer:{metadata.version('pagedinfer')}"
    except metadata.PackageNotFoundError:
        return "pagedinfer:latest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        metavar="NS",
        help="watch InferenceServices in this namespace (repeatable, globs allowed)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch all namespaces (the default when no --namespace is given)",
    )
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone",
        action="store_true",
        help="act without peering (the default): run exactly one operator replica",
    )
    peering.add_argument(
        "--peering",
        metavar="NAME",
        help="coordinate replicas through this (Cluster)KopfPeering object, so that one "
        "acts at a time (needs kopf's peering CRDs)",
    )
    parser.add_argument(
        "--priority", type=int, default=0, help="peering priority: the highest one acts"
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--default-image",
        default=_default_image(),
        help="server image of InferenceServices that set none (default: %(default)s)",
    )
    parser.add_argument(
        "--scrape-concurrency",
        type=int,
        default=16,
        help="most /metrics requests in flight per InferenceService (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every step")
    parser.add_argument("--debug", action="store_true", help="log kopf's internals too")


def settings(args: argparse.Namespace) -> kopf.OperatorSettings:
    """kopf's settings for this operator."""
    import kopf

    from pagedinfer.operator.spec import GROUP

    s = kopf.OperatorSettings()
    # Handler progress and the last-handled spec go to annotations: a status field of
    # kopf's own would be pruned by the CRD's schema.
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only autoscaled objects get it (kopf stops their daemon before they go).
    s.persistence.finalizer = f"{GROUP}/autoscaler"
    # Events are for scaling decisions and warnings, not for every log line.
    s.posting.level = logging.WARNING
    # Renew watches now and then, so that a silently dropped connection cannot stall us.
    s.watching.server_timeout = 300
    s.watching.client_timeout = 330
    s.watching.connect_timeout = 30
    s.posting.reporting_component = "pagedinfer-operator"
    s.posting.reporting_instance = os.environ.get("POD_NAME") or socket.gethostname()
    s.posting.event_name_prefix = "pagedinfer-"
    # Replicas that were asked to peer must not all act when the peering object is missing.
    s.peering.mandatory = bool(args.peering)
    return s


def kopf_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The scope, peering and memo arguments of kopf.operator()."""
    import kopf

    from pagedinfer.operator.controller import Options

    memo = kopf.Memo(
        options=Options(
            default_image=args.default_image, scrape_concurrency=args.scrape_concurrency
        )
    )
    kwargs: dict[str, Any] = {
        "settings": settings(args),
        "memo": memo,
        "standalone": not args.peering,
        "priority": args.priority,
        "liveness_endpoint": args.liveness,
    }
    if args.peering:
        kwargs["peering_name"] = args.peering
    if args.namespaces:
        kwargs["namespaces"] = args.namespaces
    else:
        kwargs["clusterwide"] = True
    return kwargs


async def operate(
    args: argparse.Namespace,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    """Run the operator until `stop_flag` is set (or the process is signalled)."""
    import kopf

    import pagedinfer.operator.handlers  # noqa: F401  (registers the handlers)

    await kopf.operator(stop_flag=stop_flag, ready_flag=ready_flag, **kopf_kwargs(args))


def run(args: argparse.Namespace) -> int:
    import kopf

    if args.scrape_concurrency < 1:
        raise ValueError("--scrape-concurrency must be at least 1")
    kopf.configure(verbose=args.verbose, debug=args.debug)
    asyncio.run(operate(args))
    return 0
