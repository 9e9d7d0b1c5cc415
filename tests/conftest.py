"""Shared fixtures: tiny random checkpoints written by transformers, made once per session."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from serve_app.serve_env import serve_env  # noqa: E402

serve_env()       # Serve as `dflash-serve up` runs it, in this process and the clusters it starts

import pytest
import torch

from tests import checkpoints

pytest_plugins = ["tests.ray_cluster"]


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # One thread per process: tests share 2 cores with Ray actors, and oversubscribed OpenMP
    # threads spin (a 2 ms decode step measured 250 ms with 2 threads beside other busy processes).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A 2-layer random Qwen3 (float32, untied embeddings) saved with ``save_pretrained``."""
    return checkpoints.write_tiny_qwen3(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target_tied(tmp_path_factory):
    return checkpoints.write_tiny_qwen3(tmp_path_factory.mktemp("tiny_target_tied"), tie_word_embeddings=True,
                                        num_hidden_layers=3, seed=1)
