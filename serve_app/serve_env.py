"""The environment Ray Serve's processes need, apart from the config models: importable where pydantic is not (the
GPU test runs import it through the tests' conftest)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Ray Serve's high-throughput mode (Ray >= 2.56): HAProxy (bundled with ray[serve] on Linux) takes HTTP straight to
# the ingress replicas instead of Serve's Python proxy, deployments call each other over gRPC, and each replica runs
# its code and its handles' routing on its main event loop. Every Serve process reads these when it imports Serve,
# so they must be in the environment of the cluster's processes (``ray start``, a pod's env) and of the process
# that starts Serve. Exported as 0 they keep Serve's defaults. An ingress replica that stops waits out a draining
# period before it closes (for load balancers in front to let go of it; 30 s by default); HAProxy here retries a
# refused connection on another replica, so 2 s.
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def serve_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """``SERVE_ENV`` as this environment has it: each variable the environment sets wins (an opt-out), the rest
    are set in it. Call it before Ray or Serve is imported or started; pass the result on to the cluster's
    processes (a job's ``runtime_env``)."""
    for name, value in SERVE_ENV.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in SERVE_ENV}
