"""Helpers for the serve tests (no tests here): a tiny checkpoint with a tokenizer, a free port, a Serve app."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests import checkpoints

CHUNK = 64      # the tiny service's prefill chunk (max_num_batched_tokens): long prompts take several steps
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_char_tokenizer(model_dir: Path) -> None:
    """A character-level tokenizer (specials, newline, printable ASCII: 100 ids, below the drafter's mask 127)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHATML}))


def write_tiny_pair(root: Path) -> tuple[Path, Path]:
    target = checkpoints.write_tiny_qwen3(root / "target")
    write_char_tokenizer(target)
    drafter = checkpoints.write_tiny_drafter(root / "drafter")
    return target, drafter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_args(target: Path, drafter: Path, mode: str = "disaggregated", **overrides) -> dict:
    """A ServiceConfig dict for the tiny pair: small CPU shares, fast metric reports."""
    engine = {"num_cpus": 0.25}
    args = {"mode": mode, "model": {"model": str(target), "draft": str(drafter), "served_model_name": "tiny",
                                    "num_pages": 64, "max_model_len": 512, "max_num_batched_tokens": CHUNK},
            "ingress": {"num_replicas": 1, "num_cpus": 0.1, "max_ongoing_requests": 256},
            "aggregated": dict(engine), "prefill": dict(engine), "decode": dict(engine),
            "metrics_report_interval_s": 0.2}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    return args


@contextlib.contextmanager
def tiny_service(root: Path, **overrides) -> Iterator[str]:
    """The tiny pair (written under ``root``) served by the application of ``service_args(**overrides)`` on a free
    port, ready; yields its URL and shuts Serve down after."""
    from ray import serve

    from serve_app.app import build_app

    target, drafter = write_tiny_pair(root)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(service_args(target, drafter, **overrides)), name="dflash", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield url
    finally:
        serve.shutdown()


def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200 and r.json()["status"] == "ok":     # not "degraded": every role is up
                return
            last = r.text
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health never turned ready: {last}")


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page parsed by prometheus_client: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric_sum(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == v2
                                                                          for k, v2 in labels.items()))


def greedy_completion(url: str, prompt: str, max_tokens: int = 40, model: str = "demo") -> tuple[list[int], list[int]]:
    """Greedy token ids and per-step acceptance lengths of one request (from the response's ``usage``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    if r.status_code != 200:
        raise AssertionError(f"{url}: HTTP {r.status_code}: {r.text}")
    data = r.json()
    if data["usage"]["completion_tokens"] != max_tokens:
        raise AssertionError(f"{url}: {data['usage']['completion_tokens']} tokens, not {max_tokens}")
    return data["choices"][0]["token_ids"], data["usage"]["spec_decode"]["acceptance_lengths"][0]


def pages_in_use(url: str) -> float:
    """KV pages in use over every engine replica of the application at ``url`` (its /metrics)."""
    return metric_sum(metric_samples(httpx.get(f"{url}/metrics", timeout=30).text), "dflash_kv_pages_in_use")


def wait_pages_free(urls: list[str], timeout_s: float = 10.0) -> list[float]:
    """Pages in use per application once they are all 0, or when ``timeout_s`` ran out (metrics lag a report)."""
    deadline = time.monotonic() + timeout_s
    while any(pages_in_use(u) for u in urls) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pages_in_use(u) for u in urls]
