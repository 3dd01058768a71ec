"""`eagleserve serve`: the ServeConfig from --config and the flags, then the Serve application on
a local Ray (loopback only) or a cluster's, until Ctrl-C or SIGTERM."""

import logging
import os
import socket

from deployments.engine_flags import ENGINE_FLAGS
from deployments.local_ray import local_cpus, local_ray_env


def _check_port_free(host: str, port: int) -> None:
    """One line naming the port, not Serve's proxy failing with a traceback a minute later."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's proxy does
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SystemExit(
                f"error: cannot listen on {host}:{port} ({e.strerror}); "
                "pick another with --port or stop what holds it"
            ) from None


def _serve_config(args):
    from deployments.config import load_config

    overrides = {f"engine.{k}": getattr(args, k) for k in ENGINE_FLAGS}
    if args.no_overlap:
        overrides["engine.overlap"] = False
    cfg = load_config(
        args.config,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        ray_address=args.address,
        num_replicas=args.replicas,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        generation_config=args.generation_config,
        **overrides,
    )
    return cfg


def cmd_serve(args) -> None:
    import signal
    import threading

    cfg = _serve_config(args)
    local = cfg.ray_address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        _check_port_free(cfg.host, cfg.port)
        local_ray_env()  # before anything imports ray
    import ray
    from ray import serve

    from deployments.server import build_app
    from speculative.engine.executor import check_tp_size

    check_tp_size(cfg.engine)

    ray.init(
        address=cfg.ray_address,
        num_cpus=local_cpus(cfg.engine.tp * cfg.num_replicas) if local else None,
        include_dashboard=False if local else None,
        logging_level="WARNING",
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not args.verbose:  # the driver's Serve lines; we print our own (replicas' logs still show)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_app(cfg), name="eagleserve", route_prefix="/")
        url = f"http://{cfg.host}:{cfg.port}/v1"
        print(f"eagleserve: serving {cfg.model_name!r} at {url} (Ctrl-C stops)", flush=True)
        stop.wait()
        print("eagleserve: shutting down", flush=True)
    finally:
        # delete, not serve.shutdown(): the replicas stop gracefully either way, but shutdown()
        # kills the controller while its own graceful_shutdown runs, and Ray logs that as a failure
        serve.delete("eagleserve")
        if local:
            ray.shutdown()
