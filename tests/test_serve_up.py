"""``dflash-serve up`` as a subprocess: health turns ready, a request succeeds, SIGINT stops everything."""

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.test_serve_support import free_port, service_args, wait_healthy, write_tiny_pair

REPO = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: the Ray head, raylet and workers it started)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_until_sigint_and_leaves_no_ray_processes(tmp_path):
    target, drafter = write_tiny_pair(tmp_path / "pair")
    port = free_port()
    config = {"http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "dflash", "route_prefix": "/", "import_path": "serve_app.app:build_app",
                                "args": service_args(target, drafter)}]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "serve_app.cli", "up", "--config", str(path)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_healthy(url, timeout_s=180)
        deadline = time.monotonic() + 30
        # `up` printed its URL and the rest of its banner (the logs' path, then "Ctrl-C to stop"): it is serving.
        while not any("Ctrl-C to stop" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.2)
        assert any(f"at {url}" in line for line in lines), "".join(lines)[-3000:]
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # Where the replicas' log lines went, as `up` says: each replica's line saying it is ready.
        logs = Path(next(line for line in lines if line.strip().startswith("logs:")).split()[1]).parent
        ready = [line for f in logs.glob("worker-*.err") for line in f.read_text(errors="replace").splitlines()
                 if " INFO actors.replica " in line and " ready: " in line]
        assert {line.split(" ready: ")[0].rsplit("] ", 1)[1].split("-")[0] for line in ready} == {"prefill", "decode"}
        ray_processes = descendants(proc.pid)
        assert len(ray_processes) >= 3          # at least the GCS, the raylet and a replica worker
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:      # a failed check: stop it as a user would, so Ray stops HAProxy (killed, `up`
            proc.send_signal(signal.SIGINT)      # would leave it holding the ports the next tests' services need)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    reader.join(timeout=10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    deadline = time.monotonic() + 30
    while any(alive(p) for p in ray_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in ray_processes if alive(p)], "Ray processes outlived `dflash-serve up`"


def test_a_cluster_of_ups_own_has_the_cpus_the_configs_deployments_ask(monkeypatch):
    """On a machine with fewer cores than the config asks (the GPU configs ask 6 and more), ``up``'s own cluster
    still has room for every replica: with 4 logical CPUs the one-GPU config's two ingresses never started."""
    from serve_app.commands import local_cpus
    from serve_app.config import load_config_file, parse_service_config

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    needed = {}
    for path in sorted((REPO / "cluster_configs").glob("*.yaml")):
        if "applications" not in yaml.safe_load(path.read_text()):
            continue        # a Ray cluster's config, not a service's
        service, _ = load_config_file(path)
        needed[path.name] = service.cpus_needed()
        assert local_cpus(service) == max(4, math.ceil(needed[path.name]))
    assert needed["disagg_1gpu.yaml"] == 6.0 and needed["local_cpu.yaml"] < 4
    scaled = parse_service_config({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 5}, "num_cpus": 2}})
    assert scaled.cpus_needed() == scaled.ingress.num_cpus + scaled.prefill.num_cpus + 10     # at its maximum
    assert local_cpus(scaled) == 12         # 11.1 logical CPUs asked: Ray takes whole ones
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert local_cpus(scaled) == 64


def test_up_says_why_it_waits_for_a_replica_that_no_node_can_place(tmp_path):
    """A deployment asking more CPUs than the cluster has: ``up`` passes on what Serve says of it (the resources a
    replica needs) instead of waiting in silence until its timeout, and SIGINT still stops it cleanly."""
    target, drafter = write_tiny_pair(tmp_path / "pair")
    port = free_port()
    args = {**service_args(target, drafter), "ingress": {"num_replicas": 1, "num_cpus": 2}}
    config = {"http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "dflash", "route_prefix": "/", "import_path": "serve_app.app:build_app",
                                "args": args}]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "serve_app.cli", "up", "--config", str(path), "--num-cpus", "1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120     # Serve says so once a replica has waited 30 s to be placed
        while not any("waiting: Ingress:" in line and "CPU" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
