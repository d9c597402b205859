"""`inferd serve --ray --num-replicas N`: the Ray Serve application (inferd.router.ray_serve) on
this machine's Ray (or the cluster RAY_ADDRESS names), served until SIGTERM/SIGINT.

The replicas run the command's own config tree; Serve's proxy takes its --host/--port.
"""

from __future__ import annotations

import logging
import signal
import threading

from ray import serve

from inferd.config import ServeConfig
from inferd.router.ray_serve import RayServeOptions, build_app

logger = logging.getLogger("inferd.router.ray")


def serve_on_ray(config: ServeConfig, num_replicas: int) -> int:
    """Joins or starts Ray, serves `num_replicas` replicas of `config` on its host:port until
    SIGTERM/SIGINT, then shuts Serve down (the replicas drain)."""
    import ray

    application = build_app(RayServeOptions(config=config, num_replicas=num_replicas))
    host, port = config.server.host, config.server.port
    ray.init()
    stop = threading.Event()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name="inferd", route_prefix="/")
        # Installed last: ray.init and serve.start install handlers of their own.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        logger.info("ready on Ray Serve: http://%s:%d (%d replicas)", host, port, num_replicas)
        while not stop.wait(1.0):
            pass
        logger.info("stopping: Serve drains the replicas")
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0
