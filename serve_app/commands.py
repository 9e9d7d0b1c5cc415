"""The service subcommands of ``dflash-serve`` (``up``, ``bench``), registered on the CLI's parser."""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable


def add_service_commands(sub: argparse._SubParsersAction, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the service subcommands; ``engine_args`` adds the engine flags shared with ``generate``."""
    up = sub.add_parser("up", help="start (or join) a Ray cluster, deploy the service, serve until interrupted")
    up.add_argument("--config", help="a Serve config YAML (cluster_configs/*.yaml) or a bare service config YAML; "
                                     "default: the demo pair on CPU, 1 prefill + 1 decode")
    up.add_argument("--host", default=None, help="default: the config's http_options, else 127.0.0.1")
    up.add_argument("--port", type=int, default=None, help="default: the config's http_options, else 8000")
    up.add_argument("--mode", choices=["aggregated", "disaggregated"], default=None, help="override the config")
    up.add_argument("--model", default=None, help="override the target model directory")
    up.add_argument("--draft", default=None, help="override the drafter directory")
    up.add_argument("--no-draft", action="store_true", help="serve the target alone")
    up.add_argument("--num-cpus", type=int, default=None,
                    help="logical CPUs of a local cluster (default: the machine's, at least 4 and at least what the "
                         "config's deployments ask)")
    up.add_argument("--ready-timeout", type=float, default=600.0)
    up.set_defaults(func=cmd_up)

    bench = sub.add_parser("bench", help="load an OpenAI-compatible server and report latency percentiles")
    from serve_app.bench import add_bench_args

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)


def _service_from_args(args: argparse.Namespace):
    from pydantic import ValidationError

    from serve_app.config import LOCAL_DEFAULT_CONFIG, HttpSettings, load_config_file, parse_service_config

    if args.config:
        service, http = load_config_file(args.config)
    elif LOCAL_DEFAULT_CONFIG.is_file():
        service, http = load_config_file(LOCAL_DEFAULT_CONFIG)
    else:
        service, http = parse_service_config({}), HttpSettings()
    data = service.model_dump()
    if args.mode:
        data["mode"] = args.mode
    if args.model:
        data["model"]["model"] = args.model
        data["model"]["draft"] = None if args.draft is None else args.draft
    elif args.draft:
        data["model"]["draft"] = args.draft
    if args.no_draft:
        data["model"]["draft"] = None
    service = parse_service_config(data)
    try:      # the command line's --host / --port meet the config's own rules
        http = HttpSettings(host=args.host or http.host, port=args.port if args.port is not None else http.port)
    except ValidationError as e:
        raise ValueError("; ".join(f"--{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) \
            from None
    return service, http.host, http.port


def _check_checkpoints(service) -> None:
    from pathlib import Path

    m = service.model
    for field, path in (("model.model", m.resolved(m.model)), ("model.draft", m.resolved(m.draft))):
        if path is not None and not Path(path).is_dir():
            raise FileNotFoundError(f"{field}: {path} is not a directory (the demo pair lives in models/demo; "
                                    "train it or pass --config / --model)")


class PortInUse(ValueError):
    """The service's HTTP port is taken on this machine."""


def check_port_free(host: str, port: int) -> None:
    """Refuse at once a port that something listens on already (another service, or the HAProxy of a dflash-serve
    whose processes were killed rather than stopped): Serve would start the whole cluster first, then fail to bind
    it with a message about HAProxy."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as servers do: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUse(f"{host}:{port} is taken ({e.strerror}): another process listens there (a HAProxy left "
                            "behind by a dflash-serve that was killed, not stopped, is one); stop it or pass "
                            "--port") from e


def cmd_up(args: argparse.Namespace) -> int:
    from serve_app.serve_env import serve_env

    serving = serve_env()       # before Serve is imported here, and passed on to every process of the cluster
    import httpx
    import ray
    from ray import serve

    from actors.logs import log_env
    from serve_app.app import DEFAULT_APP_NAME, build_service

    service, host, port = _service_from_args(args)
    _check_checkpoints(service)
    address = os.environ.get("RAY_ADDRESS")
    if not address:       # a cluster of its own: nothing of it can hold the port yet
        check_port_free(host, port)
    # SIGINT and SIGTERM both shut down cleanly, also when started from a shell that ignores SIGINT in
    # background jobs (Python keeps an inherited SIG_IGN, so Ctrl-C's signal would do nothing).
    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    # A cluster joined by its address sees DFLASH_LOG_LEVEL only through the job's runtime_env.
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **serving, **log_env()}}
    if address:
        ray.init(address=address, runtime_env=env, configure_logging=False)
    else:
        # "local": a fresh cluster owned by this process, even if another one runs on the machine.
        ray.init(address="local", num_cpus=args.num_cpus or local_cpus(service), include_dashboard=False,
                 runtime_env=env, configure_logging=False, log_to_driver=False)
    url = f"http://{host}:{port}"
    up = threading.Event()
    try:
        serve.start(http_options={"host": host, "port": port})
        # serve.run returns once every replica has started: meanwhile say what Serve says keeps one waiting.
        threading.Thread(target=_tell_waits, args=(DEFAULT_APP_NAME, up), daemon=True).start()
        serve.run(build_service(service), name=DEFAULT_APP_NAME, route_prefix="/",
                  blocking=False)
        deadline = time.monotonic() + args.ready_timeout
        while True:
            try:        # every role up ("degraded": one serves while the other's replicas still start)
                r = httpx.get(f"{url}/health", timeout=5)
                if r.status_code == 200 and r.json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not turn ready in {args.ready_timeout:.0f} s")
            time.sleep(0.5)
        up.set()
        roles = "1 aggregated deployment" if service.mode == "aggregated" else "prefill + decode deployments"
        print(f"dflash-serve: serving {service.model.name!r} ({service.mode}: {roles}) at {url}", flush=True)
        print(f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{service.model.name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'", flush=True)
        if not address:     # its actors' and replicas' log lines stay in the cluster's files, not here
            node = getattr(ray._private.worker, "_global_node", None)     # no public accessor for the path
            logs = node.get_logs_dir_path() if node is not None else "/tmp/ray/session_latest/logs"
            print(f"  logs: {logs}/worker-*.err (this project's lines), {logs}/serve/ (Serve's)", flush=True)
        print("  Ctrl-C to stop", flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("dflash-serve: shutting down", file=sys.stderr, flush=True)
    finally:
        up.set()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def local_cpus(service) -> int:
    """Logical CPUs for a cluster of ``up``'s own (Ray wants a whole number): the machine's, at least 4 (a 2-core box
    runs the demo service's processes side by side) and at least what the config's deployments ask (else some replica
    never starts)."""
    return max(4, os.cpu_count() or 1, math.ceil(service.cpus_needed() - 1e-9))


def _tell_waits(app_name: str, up: threading.Event, every_s: float = 2.0) -> None:
    """Until ``up`` is set, print each new thing Serve says of a deployment that is not up yet (a replica that no
    node has the resources for waits in silence otherwise: serve.run does not return until it starts)."""
    told: set[str] = set()
    while not up.wait(every_s):
        for line in _not_ready(app_name):
            if line not in told:
                told.add(line)
                print(f"dflash-serve: waiting: {line}", file=sys.stderr, flush=True)


def _not_ready(app_name: str) -> list[str]:
    """What Serve says of the application's deployments that are not up yet (such as a replica that no node has
    the resources for), one line each; nothing when it says nothing."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
    except Exception:       # the controller is still starting
        return []
    if app is None:
        return []
    return [f"{name}: {d.message}" for name, d in app.deployments.items()
            if d.message and str(getattr(d.status, "value", d.status)) != "HEALTHY"]


def cmd_bench(args: argparse.Namespace) -> int:
    from serve_app.bench import run_bench

    return run_bench(args)
