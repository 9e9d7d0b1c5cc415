"""The Serve applications: aggregated (ingress + one engine deployment) and disaggregated (ingress/router +
prefill + decode). ``build_app`` is the Serve config's ``import_path`` (``serve run cluster_configs/x.yaml``)."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from actors.logs import log_env
from serve_app.config import DeploymentSettings, ServiceConfig, parse_service_config

DEFAULT_APP_NAME = "dflash"


def _engine_options(settings: DeploymentSettings, service: ServiceConfig, tp_size: int = 1,
                    prefix_affinity: bool = False) -> dict[str, Any]:
    options = settings.serve_options()
    if prefix_affinity:
        # Replicas that compute prompts keep a prefix cache: prompts that begin alike go to the same one.
        from ray.serve.config import RequestRouterConfig

        from serve_app.routing import PrefixAffinityRouter

        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    if settings.num_gpus > 0:
        # The replica's process only streams; its rank 0 engine (``actors.engine_host``) and, when pages move, its
        # KVManagerActor share its bundle's GPU (the pool lives on it). Each further tensor-parallel rank (and its
        # KV manager) gets a bundle with a GPU of its own on the same node.
        options["placement_group_bundles"] = [{"CPU": settings.num_cpus, "GPU": settings.num_gpus}] + \
            [{"GPU": 1}] * (tp_size - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
        options["ray_actor_options"]["num_gpus"] = 0
    # (The engine processes and KV managers a replica starts inherit its environment.)
    options["ray_actor_options"]["runtime_env"] = {"env_vars": {
        "OMP_NUM_THREADS": str(service.model.num_threads), "TOKENIZERS_PARALLELISM": "false", **log_env(),
        **service.process_env()}}
    # Streams outlive Serve's default graceful-shutdown wait; let replicas finish them when scaling down.
    options["graceful_shutdown_timeout_s"] = 20.0
    options["graceful_shutdown_wait_loop_s"] = 0.5
    return options


def build_service(service: ServiceConfig) -> Application:
    """The bound application for a validated config."""
    from serve_app.ingress import Ingress
    from serve_app.metrics import MetricsHub
    from serve_app.replicas import AggregatedServer, DecodeServer, PrefillServer

    args = service.model_dump(mode="json")
    ingress_options = service.ingress.serve_options()
    # The level set where the app is built, also on a cluster started without it (env_vars add to the job's).
    env = {**log_env(), **service.process_env()}
    passed = {"runtime_env": {"env_vars": env}} if env else {}
    ingress_options["ray_actor_options"].update(passed)
    # Part of the application: it is deleted with it (nothing outlives `serve shutdown`).
    hub = serve.deployment(MetricsHub, name="MetricsHub").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0, **passed}, max_ongoing_requests=10_000).bind()
    if service.mode == "aggregated":
        backends = {"aggregated": serve.deployment(AggregatedServer, name="AggregatedServer").options(
            **_engine_options(service.aggregated, service, tp_size=service.tp_size("aggregated"),
                              prefix_affinity=True)).bind(args, hub)}
    else:
        backends = {
            "prefill": serve.deployment(PrefillServer, name="PrefillServer").options(
                **_engine_options(service.prefill, service, tp_size=service.tp_size("prefill"),
                                  prefix_affinity=True)).bind(args, hub),
            "decode": serve.deployment(DecodeServer, name="DecodeServer").options(
                **_engine_options(service.decode, service, tp_size=service.tp_size("decode"))).bind(args, hub),
        }
    return serve.deployment(Ingress, name="Ingress").options(**ingress_options).bind(args, hub, **backends)


def build_app(args: dict | None = None) -> Application:
    """Serve's app builder: ``args`` is a ServiceConfig dict (a bad field raises, naming it)."""
    return build_service(parse_service_config(args or {}))
