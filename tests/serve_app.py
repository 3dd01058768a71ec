"""The eagleserve Serve app on a free loopback port, for the Serve test modules (one per module)."""

import ray
from ray import serve

from deployments.server import build_app
from workers.distributed import free_port


def run_app(cfg, **serve_options) -> str:
    """Serve on 127.0.0.1 and the app from `cfg` on the connected Ray cluster -> its base URL."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **serve_options)
    serve.run(build_app(cfg), name="eagleserve", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def start_app(cfg, num_cpus: int) -> str:
    """A local Ray with `num_cpus` CPUs, then `run_app`."""
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    return run_app(cfg)


def stop_app() -> None:
    serve.shutdown()
    ray.shutdown()
