"""``frontend_niceness``: the ingress's and the replicas' processes run that much nicer, every thread of them, while
the engines' processes keep Ray's niceness; requests are served as before."""

import os

import httpx
import pytest

pytestmark = pytest.mark.ray

import ray  # noqa: E402


def _threads_niceness(_actor=None) -> set[int]:
    """The niceness values of this process's threads (run in an actor through ``__ray_call__``)."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}


def _niceness(namespace: str, *parts: str) -> list[set[int]]:
    """Per live named actor of ``namespace`` whose name holds every one of ``parts``: its threads' niceness."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == namespace and all(p in a["name"] for p in parts)]
    return ray.get([ray.get_actor(n, namespace=namespace).__ray_call__.remote(_threads_niceness) for n in names])


def test_the_serving_layer_runs_nicer_than_the_engines(ray_cluster, tmp_path):
    from actors.worker import KV_MANAGER_NAMESPACE
    from tests.test_serve_support import tiny_service

    with tiny_service(tmp_path, mode="disaggregated", frontend_niceness=3) as url:
        body = {"model": "tiny", "prompt": "nice", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        frontends = {role: _niceness("serve", "dflash", role) for role in ("Ingress", "PrefillServer", "DecodeServer")}
        engines = _niceness(KV_MANAGER_NAMESPACE, "-rank0-worker")
    assert all(len(found) == 1 for found in frontends.values()) and len(engines) == 2, (frontends, engines)
    # Ray starts a worker's threads at more than one niceness; each of a frontend's is 3 more than it was, so its
    # least nice thread is 3 nicer than an engine process's (which keeps Ray's).
    base = min(engines[0])
    assert min(engines[1]) == base
    for role, (threads,) in frontends.items():
        assert min(threads) == base + 3, (role, threads, engines)
