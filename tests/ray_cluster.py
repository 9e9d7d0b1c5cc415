"""The session's one local Ray cluster (started on first use, shared by every test that needs it)."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the whole session; actors take fractions of its 4 logical CPUs."""
    import ray
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    if started:
        ray.shutdown()
