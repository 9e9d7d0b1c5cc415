"""Service config models: every cluster config loads through them, and a bad config names its field."""

from pathlib import Path

import pytest
import yaml

from serve_app.commands import check_port_free
from serve_app.config import ConfigError, ServiceConfig, load_config_file, parse_service_config
from serve_app.serve_env import SERVE_ENV, serve_env

CONFIGS = Path(__file__).resolve().parents[1] / "cluster_configs"
SERVE_CONFIGS = ["local_cpu.yaml", "agg_gpu.yaml", "disagg_1p1d_gpu.yaml", "disagg_2p1d_gpu.yaml", "disagg_1gpu.yaml"]


def test_every_yaml_in_cluster_configs_parses():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.name for f in files} >= set(SERVE_CONFIGS) | {"ray_cluster_gpu.yaml", "rayservice_disagg.yaml"}
    for f in files:
        assert all(doc for doc in yaml.safe_load_all(f.read_text())), f


@pytest.mark.parametrize("name,mode,prefill,decode", [
    ("local_cpu.yaml", "disaggregated", 1, 1), ("agg_gpu.yaml", "aggregated", None, None),
    ("disagg_1p1d_gpu.yaml", "disaggregated", 1, "auto"), ("disagg_2p1d_gpu.yaml", "disaggregated", 2, 1),
    ("disagg_1gpu.yaml", "disaggregated", 1, 1)])
def test_serve_configs_load_through_the_service_models(name, mode, prefill, decode):
    service, http = load_config_file(CONFIGS / name)
    assert service.mode == mode
    if prefill is not None:
        assert service.prefill.serve_options()["num_replicas"] == prefill
        assert service.decode.serve_options()["num_replicas"] == decode
    if name == "disagg_1gpu.yaml":      # the single-GPU development config: one GPU shared, local only
        assert service.model.device == "cuda" and http.host == "127.0.0.1"
        assert service.prefill.num_gpus + service.decode.num_gpus == 1
    elif "gpu" in name:
        assert service.model.device == "cuda" and http.host == "0.0.0.0"
        assert service.model.kv_cache_dtype == "fp8" and service.model.draft_kv_cache_dtype == "bf16"
    else:
        assert http.host == "127.0.0.1" and http.port == 8000 and service.model.device == "cpu"


def test_decode_autoscaling_reaches_serve_options():
    service, _ = load_config_file(CONFIGS / "disagg_1p1d_gpu.yaml")
    auto = service.decode.serve_options()["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 48)


def test_rayservice_manifest_carries_a_valid_disaggregated_app():
    manifest = yaml.safe_load((CONFIGS / "rayservice_disagg.yaml").read_text())
    assert manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    app = serve_config["applications"][0]
    assert app["import_path"] == "serve_app.app:build_app"
    assert parse_service_config(app["args"]).mode == "disaggregated"


def test_ray_cluster_yaml_has_gpu_workers():
    cluster = yaml.safe_load((CONFIGS / "ray_cluster_gpu.yaml").read_text())
    assert cluster["head_node_type"] in cluster["available_node_types"]
    assert cluster["available_node_types"]["gpu_worker"]["max_workers"] >= 1


def test_cluster_files_start_ray_with_the_serving_environment():
    """Serve reads SERVE_ENV in every process of the cluster: the node start commands and the pods carry it all."""
    cluster = yaml.safe_load((CONFIGS / "ray_cluster_gpu.yaml").read_text())
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        start = next(c for c in commands if "ray start" in c)
        assert dict(w.split("=", 1) for w in start.split() if "=" in w and w.startswith("RAY_SERVE_")) == SERVE_ENV
    manifest = yaml.safe_load((CONFIGS / "rayservice_disagg.yaml").read_text())
    pods = [manifest["spec"]["rayClusterConfig"]["headGroupSpec"]] + manifest["spec"]["rayClusterConfig"][
        "workerGroupSpecs"]
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert {k: v for k, v in env.items() if k.startswith("RAY_SERVE_")} == SERVE_ENV


def test_serve_env_fills_in_what_the_environment_leaves_unset():
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "0", "PATH": "/bin"}
    got = serve_env(environ)
    assert got == {**SERVE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}       # an explicit 0 opts out
    assert environ == {**SERVE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0", "PATH": "/bin"}


@pytest.mark.parametrize("data,field", [
    ({"model": {"page_size": 0}}, "model.page_size"),
    ({"model": {"kv_cache_dtype": "int3"}}, "model.kv_cache_dtype"),
    ({"model": {"overlap": "sometimes"}}, "model.overlap"),
    ({"model": {"tensor_parallel_size": 3}}, "prefill tensor_parallel_size 3"),
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "decode.autoscaling"),
    ({"decode": {"num_replicas": 2, "autoscaling": {"max_replicas": 2}}}, "decode"),
    ({"prefil": {}}, "prefil"),
    ({"mode": "hybrid"}, "mode"),
    ({"kv_transport": "rdma"}, "kv_transport"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"ticket_timeout_s": 0}, "ticket_timeout_s"),
])
def test_a_bad_config_names_the_field(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_service_config(data)


def test_a_bad_serve_config_file_names_the_app_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"applications": [{"name": "dflash", "import_path": "serve_app.app:build_app",
                                                     "args": {"model": {"page_size": -1}}}]}))
    with pytest.raises(ConfigError, match=r"applications\[0\]\.args\.model\.page_size"):
        load_config_file(bad)


def test_cli_up_with_a_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    from serve_app.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: {max_ongoing_requests: 0}\n")
    assert main(["up", "--config", str(bad)]) == 2
    assert "decode.max_ongoing_requests" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("applications: [\n", "not valid YAML"),
    ("- a list\n", "expected a mapping at the top level"),
    ("applications: [just-a-name]\n", "applications must be a list of mappings"),
    ("applications: {name: dflash}\n", "applications must be a list of mappings"),
])
def test_cli_up_with_a_file_that_is_no_config_exits_2_saying_why(tmp_path, capsys, text, message):
    from serve_app.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["up", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_cli_up_refuses_a_port_out_of_range_naming_the_flag(capsys, port):
    from serve_app.cli import main

    assert main(["up", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --port: ") and "Traceback" not in err


def test_cli_up_refuses_a_port_in_use_before_starting_anything(capsys, monkeypatch):
    """As when a killed service's HAProxy still holds the port: a clear error at once, no Ray cluster started."""
    import socket

    import ray

    from serve_app.cli import main

    def no_cluster(*args, **kwargs):
        raise AssertionError("ray.init was called for a port that is taken")

    monkeypatch.setattr(ray, "init", no_cluster)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--port", str(port)]) == 2
    assert f"127.0.0.1:{port} is taken" in capsys.readouterr().err
    check_port_free("127.0.0.1", port)       # free again once its listener closed


def test_defaults_are_the_demo_pair_disaggregated():
    service = ServiceConfig()
    assert service.mode == "disaggregated" and service.model.model.endswith("models/demo/target")
    assert service.engine_roles() == ("prefill", "decode")
    assert (service.model.engine_config().cuda_graphs, service.model.engine_config().overlap) == ("auto", "auto")
    assert service.kv_transport == "auto" and service.stream_interval == 1


def test_the_engine_settings_reach_the_engine_config():
    config = parse_service_config({"model": {"cuda_graphs": "off", "overlap": "off"}}).model.engine_config()
    assert (config.cuda_graphs, config.overlap) == ("off", "off")


@pytest.mark.parametrize("mode,role,gpus,ok", [
    ("disaggregated", "decode", 0.5, True), ("disaggregated", "decode", 0.1, False),   # all of it the KV manager's
    ("disaggregated", "prefill", 0, False), ("disaggregated", "prefill", 2, False),
    ("aggregated", "aggregated", 0.05, True), ("aggregated", "aggregated", 0, False)])
def test_a_gpu_replica_needs_a_share_of_a_gpu_beyond_its_kv_managers(mode, role, gpus, ok):
    data = {"mode": mode, "model": {"device": "cuda"}, "prefill": {"num_gpus": 0.5}, "decode": {"num_gpus": 0.5},
            "aggregated": {"num_gpus": 1}}
    data[role] = {"num_gpus": gpus}
    if ok:
        assert getattr(parse_service_config(data), role).num_gpus == gpus
    else:
        with pytest.raises(ConfigError, match=f"{role}.num_gpus must be"):
            parse_service_config(data)


def test_the_gpu_options_leave_the_replicas_bundle_to_its_engine_and_kv_manager():
    from serve_app.app import _engine_options

    service, _ = load_config_file(CONFIGS / "disagg_1gpu.yaml")
    for settings in (service.prefill, service.decode):
        options = _engine_options(settings, service)
        # One bundle of half a GPU: the replica's process takes none of it, its rank-0 engine and its KV manager
        # share it (``actors.worker._rank0_gpu_share``), so Ray gives both the same device.
        assert options["placement_group_bundles"] == [{"CPU": 2, "GPU": 0.5}]
        assert options["placement_group_strategy"] == "STRICT_PACK"
        assert options["ray_actor_options"]["num_gpus"] == 0
    aggregated = parse_service_config({"mode": "aggregated", "model": {"device": "cuda"},
                                       "aggregated": {"num_gpus": 1}})
    options = _engine_options(aggregated.aggregated, aggregated, tp_size=2)
    assert options["placement_group_bundles"] == [{"CPU": aggregated.aggregated.num_cpus, "GPU": 1}, {"GPU": 1}]
    assert options["ray_actor_options"]["num_gpus"] == 0
