"""Pydantic models of the whole service, validated once at the edge (Serve config YAML or CLI flags)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "models" / "demo" / "target"
DEMO_DRAFTER = REPO / "models" / "demo" / "drafter"
APP_IMPORT_PATH = "serve_app.app:build_app"
LOCAL_DEFAULT_CONFIG = REPO / "cluster_configs" / "local_cpu.yaml"     # what `dflash-serve up` serves by default

class ConfigError(ValueError):
    """A service config that does not validate; the message names the offending field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelSettings(_Strict):
    """The target, its drafter, and every engine knob that shapes the KV cache."""

    model: str = str(DEMO_TARGET)
    draft: str | None = str(DEMO_DRAFTER)
    served_model_name: str | None = None           # default: the model directory's name
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "float32"
    kv_cache_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    draft_kv_cache_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    page_size: int = Field(16, ge=1)
    num_pages: int | None = Field(None, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)
    shared_draft_kv: Literal["auto", "on", "off"] = "auto"
    block_size: int | None = Field(None, ge=2)       # DFlash block width; drafts per step = block_size - 1
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    attention_backend: Literal["torch", "triton"] | None = None
    # auto: on for CUDA with the triton backend and no TP; decode: auto for decode-shaped steps only
    cuda_graphs: Literal["auto", "on", "decode", "off"] = "auto"
    overlap: Literal["auto", "on", "off"] = "auto"       # decode steps launched ahead of the host; auto: CUDA, no TP
    tensor_parallel_size: int = Field(1, ge=1)        # every role's, unless its deployment sets its own
    pipeline_parallel_size: int = Field(1, ge=1)
    num_threads: int = Field(1, ge=1)                 # torch threads per replica process

    @model_validator(mode="after")
    def _parallel_sizes(self):
        # The engine has no pipeline stages: refuse at load, not at the first request. (A TP size that does not
        # split the model's heads is refused when the replica reads the checkpoint, before any rank starts.)
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size}: pipeline parallelism "
                             "is not supported (and it disables the unified draft KV)")
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def resolved(self, path: str | None) -> str | None:
        """A relative checkpoint path means the working directory, else the repository root."""
        if path is None or Path(path).is_absolute() or Path(path).exists():
            return path
        return str(REPO / path) if (REPO / path).exists() else path

    def engine_config(self):
        from engine.llm import EngineConfig

        kwargs: dict[str, Any] = dict(
            model=self.resolved(self.model), draft=self.resolved(self.draft), device=self.device,
            dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, draft_kv_cache_dtype=self.draft_kv_cache_dtype,
            page_size=self.page_size, num_pages=self.num_pages, shared_draft_kv=self.shared_draft_kv,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, attention_backend=self.attention_backend, cuda_graphs=self.cuda_graphs,
            overlap=self.overlap, num_spec_tokens=None if self.block_size is None else self.block_size - 1)
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_bytes"] = self.kv_cache_bytes
        return EngineConfig(**kwargs)


class AutoscalingSettings(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    metrics_interval_s: float = Field(10.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class DeploymentSettings(_Strict):
    """One Serve deployment: a fixed replica count or an autoscaling range, and each replica's resources."""

    num_replicas: int | None = Field(None, ge=1)
    autoscaling: AutoscalingSettings | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    tensor_parallel_size: int | None = Field(None, ge=1)     # ranks per replica of this role; None: the model's
    max_queued_requests: int = Field(-1, ge=-1)     # -1: unbounded; beyond it the handle refuses (503)
    # Serve calls each replica's health check this often and replaces a replica after 3 failures in a row
    # (an engine replica fails it when a rank's KV manager or engine thread is dead).
    health_check_period_s: float = Field(2.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _one_scaling_mode(self):
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("give num_replicas or autoscaling, not both")
        return self

    def serve_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
            options["num_replicas"] = "auto"
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


def _ingress_default() -> DeploymentSettings:
    return DeploymentSettings(num_replicas=1, num_cpus=0.1, max_ongoing_requests=1024)


class ServiceConfig(_Strict):
    """The service: which application, which model, and each deployment's scaling."""

    mode: Literal["aggregated", "disaggregated"] = "disaggregated"
    model: ModelSettings = Field(default_factory=ModelSettings)
    ingress: DeploymentSettings = Field(default_factory=_ingress_default)
    aggregated: DeploymentSettings = Field(default_factory=DeploymentSettings)
    prefill: DeploymentSettings = Field(default_factory=DeploymentSettings)
    decode: DeploymentSettings = Field(default_factory=DeploymentSettings)
    transfer_draft_kv: bool = True                   # False: the ablation (decode drafts from an empty context)
    # How a decode rank moves a prefill rank's pages: "auto" copies them from its CUDA IPC mapping of the prefill
    # pools when both share a GPU, and READs them with NIXL otherwise; "nixl" always READs with NIXL.
    kv_transport: Literal["auto", "nixl"] = "auto"
    # Prefill pages wait this long for their READ; the ingress restarts the wait every third of it while the
    # request's decode call is queued or waits for pages, so only a request nobody serves any more loses them.
    hold_timeout_s: float = Field(30.0, gt=0)
    # Once a request's ticket has reached its decode replica, the request waits this long for decode pages (behind
    # older requests while the pool is full); then it fails with a 503 mid-stream and its pages are freed.
    reserve_timeout_s: float = Field(300.0, gt=0)
    # A decode replica reserves a request's pages as its prefill starts and waits this long for the prefill's ticket
    # (a queue and the prefill itself included); then the request fails with a 504 and the pages are freed.
    ticket_timeout_s: float = Field(300.0, gt=0)
    # Engine steps per streamed chunk after a request's first (the first and the last go at once). Every chunk is
    # an item through Serve's streams (replica, ingress, proxy); at 1 each step's tokens go out at once, at k a
    # request's tokens go out every k steps, for k times fewer items (vLLM's --stream-interval does likewise).
    stream_interval: int = Field(1, ge=1, le=64)
    # Token chunks from an engine's process straight to the ingress on its node, one message per engine step for all
    # of that ingress's requests (``actors/sink.py``); off, or across nodes, each chunk goes through its replica's
    # Serve stream. Serve still routes, counts and cancels every request either way.
    direct_chunks: bool = True
    # Cores of their own for the engine processes, per node: each binds to one of these that no other engine
    # process there holds, and every other process of the service binds to the node's other cores
    # (``actors/cpus.py``; ``benchmarks/cpu_interference.py`` shows which cores slow each other). None: no binding.
    engine_cpus: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    max_concurrent_requests: int = Field(256, ge=1)  # choices (prompts x n) per ingress replica; beyond: 429
    max_request_bytes: int = Field(1 << 20, ge=1024)  # a larger request body is refused (413) unread
    # Clients must send "Authorization: Bearer <key>" on /v1/* when a key is set (here or, better, kept out of
    # the config in the ingress's DFLASH_API_KEY environment variable); /health and /metrics stay open.
    api_key: str | None = Field(None, min_length=1)
    enable_docs: bool = False                        # FastAPI's /docs and /openapi.json
    # Replicas and ingresses report to the MetricsHub this often (each report is a Serve call: at 1 s an idle
    # service spends a few percent of a core on them); /health notices a silent replica after 3 missed reports.
    metrics_report_interval_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _distinct_engine_cpus(self):
        if self.engine_cpus is not None and len(set(self.engine_cpus)) != len(self.engine_cpus):
            raise ValueError(f"engine_cpus names a core twice: {self.engine_cpus}")
        return self

    def process_env(self) -> dict[str, str]:
        """Environment variables every process of the service gets (beside the logging ones)."""
        from actors.cpus import ENV, format_cpus

        return {ENV: format_cpus(self.engine_cpus)} if self.engine_cpus else {}

    def engine_roles(self) -> tuple[str, ...]:
        return ("aggregated",) if self.mode == "aggregated" else ("prefill", "decode")

    def cpus_needed(self) -> float:
        """Logical CPUs the deployments ask of Ray at their largest: every replica up to the autoscaling maximum
        (the metrics hub, engine processes and KV managers ask none)."""
        def most(d: DeploymentSettings) -> int:
            return d.autoscaling.max_replicas if d.autoscaling is not None else d.num_replicas or 1
        return sum(most(d) * d.num_cpus for d in (self.ingress, *(getattr(self, r) for r in self.engine_roles())))

    def tp_size(self, role: str) -> int:
        """Tensor-parallel ranks per replica of ``role``: its deployment's setting, else the model's."""
        return getattr(self, role).tensor_parallel_size or self.model.tensor_parallel_size

    @model_validator(mode="after")
    def _gpu_shares(self):
        # A replica on a GPU needs a share of one; beside it, a replica whose pages move (or whose ranks are more
        # than one) runs a KV manager per rank that takes KV_MANAGER_GPU_SHARE of that share. Several replicas
        # may share one GPU (e.g. 0.5 each for a prefill and a decode replica on a single GPU).
        if not self.model.device.startswith("cuda"):
            return self
        from actors.worker import KV_MANAGER_GPU_SHARE

        for role in self.engine_roles():
            gpus = getattr(self, role).num_gpus
            managed = self.mode == "disaggregated" or self.tp_size(role) > 1
            if gpus <= (KV_MANAGER_GPU_SHARE if managed else 0) or gpus > 1:
                least = f"more than {KV_MANAGER_GPU_SHARE} (its KV manager takes that share)" if managed else "above 0"
                raise ValueError(f"model.device is {self.model.device}: {role}.num_gpus must be {least} and at most "
                                 f"1 (a replica's rank 0 runs on one GPU), got {gpus}")
        return self

    @model_validator(mode="after")
    def _tp_splits(self):
        # Every role's TP size must split the checkpoints' heads; a decode rank then READs its kv-head slices from
        # whichever prefill ranks hold them, for any pair of such sizes. Checked here when the checkpoints are
        # readable (else when a replica reads them, before any rank starts), naming the role and the split.
        from engine.parallel import check_tp_size

        models = []
        for who, path in (("the target model", self.model.resolved(self.model.model)),
                          ("the DFlash drafter", self.model.resolved(self.model.draft))):
            if path is not None and (Path(path) / "config.json").is_file():
                models.append((who, path, json.loads((Path(path) / "config.json").read_text())))
        split = " -> ".join(f"{role} {self.tp_size(role)}" for role in self.engine_roles())
        for role in self.engine_roles():
            for who, path, c in models:
                heads = c.get("num_attention_heads", 0)
                try:
                    check_tp_size(self.tp_size(role), heads=heads, kv_heads=c.get("num_key_value_heads", heads),
                                  intermediate=c.get("intermediate_size", 0), who=f"{who} {path}")
                except ValueError as e:
                    raise ValueError(f"{role} tensor_parallel_size {self.tp_size(role)} (split {split}) cannot be "
                                     f"mapped: {e}") from None
        return self


class HttpSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


def _format(error: ValidationError, where: str) -> str:
    lines = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"{where}{field}: {e['msg']}")
    return "invalid service config: " + "; ".join(lines)


def parse_service_config(data: dict | None, where: str = "") -> ServiceConfig:
    """Validate a dict into a ServiceConfig; a ConfigError names every bad field by its dotted path."""
    try:
        return ServiceConfig.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(_format(e, where)) from None


def load_config_file(path: str | Path) -> tuple[ServiceConfig, HttpSettings]:
    """A Serve config YAML (``applications[0].args`` and ``http_options``) or a bare ServiceConfig YAML."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if "applications" in data:
        apps = data["applications"] or []
        if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
            raise ConfigError(f"{path}: applications must be a list of mappings")
        ours = [a for a in apps if a.get("import_path") == APP_IMPORT_PATH]
        if len(ours) != 1:
            raise ConfigError(f"{path}: expected one application with import_path {APP_IMPORT_PATH}")
        service = parse_service_config(ours[0].get("args"), f"applications[{apps.index(ours[0])}].args.")
        http = data.get("http_options") or {}
        try:
            http_settings = HttpSettings(**{k: http[k] for k in ("host", "port") if k in http})
        except ValidationError as e:
            raise ConfigError(_format(e, "http_options.")) from None
        return service, http_settings
    return parse_service_config(data), HttpSettings()
