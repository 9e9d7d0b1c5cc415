"""The project's log lines (``actors.logs``): one handler with time, level, logger and process id, at
DFLASH_LOG_LEVEL; in a Ray actor's process and a Serve replica's they land in Ray's worker log file, tracebacks as
plain text. The process-wide set-up runs in a child process each, never in the test process, whose logging is
pytest's."""

import glob
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def run_python(code: str, level: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_LOG_LEVEL"}
    if level is not None:
        env["DFLASH_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def line(level: str, logger: str, pid: int | str, message: str) -> str:
    return rf"{STAMP} {level} {re.escape(logger)} \[pid {pid}\] {re.escape(message)}"


def test_an_info_line_carries_time_level_logger_and_pid():
    out = run_python("import logging, os\n"
                     "from actors.logs import configure_logging\n"
                     "configure_logging()\n"
                     "logging.getLogger('engine.cuda_graphs').info('graphs ready')\n"
                     "print(os.getpid())")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(line("INFO", "engine.cuda_graphs", out.stdout.strip(), "graphs ready") + "\n", out.stderr)


def test_a_second_call_adds_no_second_handler():
    out = run_python("import logging\n"
                     "from actors.logs import PROJECT_LOGGERS, configure_logging\n"
                     "configure_logging(); configure_logging()\n"
                     "print([len(logging.getLogger(n).handlers) for n in PROJECT_LOGGERS])\n"
                     "logging.getLogger('kv.layout').warning('once')")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 1, 1, 1, 1, 1]"
    assert re.fullmatch(line("WARNING", "kv.layout", r"\d+", "once") + "\n", out.stderr)


def test_a_project_record_is_not_printed_again_by_a_root_handler():
    """A driver (or Ray's logging config) with a handler on the root logger: the record comes out once, ours."""
    out = run_python("import logging\n"
                     "logging.basicConfig(level=logging.INFO, format='ROOT %(message)s')\n"
                     "from actors.logs import configure_logging\n"
                     "configure_logging()\n"
                     "logging.getLogger('dflash.ingress').info('only once')")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(line("INFO", "dflash.ingress", r"\d+", "only once") + "\n", out.stderr)


def test_dflash_log_level_warning_drops_info_and_keeps_warnings():
    code = ("import logging\n"
            "from actors.logs import configure_logging\n"
            "configure_logging()\n"
            "log = logging.getLogger('actors.kv_manager')\n"
            "log.info('an info'); log.warning('a warning')")
    quiet, default = run_python(code, level="warning"), run_python(code)
    assert "an info" not in quiet.stderr and re.search(line("WARNING", "actors.kv_manager", r"\d+", "a warning"),
                                                       quiet.stderr), quiet.stderr
    assert re.search(line("INFO", "actors.kv_manager", r"\d+", "an info"), default.stderr), default.stderr


def test_a_bad_dflash_log_level_fails_naming_it():
    out = run_python("from actors.logs import configure_logging\nconfigure_logging()", level="LOUD")
    assert out.returncode != 0 and "DFLASH_LOG_LEVEL='LOUD' is not a logging level" in out.stderr


def test_a_traceback_is_plain_text_under_serves_print():
    """A Serve replica replaces ``print`` with its own, which wrote the stock formatter's traceback as tuples."""
    out = run_python("import builtins, logging\n"
                     "from ray.serve._private.logging_utils import redirected_print\n"
                     "builtins.print = redirected_print      # as Serve does in a replica\n"
                     "from actors.logs import configure_logging\n"
                     "configure_logging()\n"
                     "try:\n"
                     "    1 / 0\n"
                     "except ZeroDivisionError:\n"
                     "    logging.getLogger('serve_app.router').exception('the step failed')")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert re.fullmatch(line("ERROR", "serve_app.router", r"\d+", "the step failed"), lines[0]), out.stderr
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ZeroDivisionError: division by zero"
    assert "('" not in out.stderr


# --- in Ray's processes -----------------------------------------------------------------------------


def _pid(actor_self) -> int:
    return os.getpid()


def _log(actor_self, logger: str, message: str) -> None:
    """Run in an actor's process: an INFO line and an ERROR line with a traceback."""
    log = logging.getLogger(logger)
    log.info("%s info", message)
    try:
        raise ValueError(message)
    except ValueError:
        log.exception("%s error", message)


def worker_log(pid: int, wanted: str, timeout_s: float = 20.0) -> str:
    """The text of the Ray worker log file (stderr) of process ``pid`` once it holds ``wanted``."""
    import ray

    pattern = os.path.join(ray._private.worker._global_node.get_logs_dir_path(), f"worker-*-{pid}.err")
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = "".join(Path(f).read_text(errors="replace") for f in glob.glob(pattern))
        if wanted in text:
            break
        time.sleep(0.2)
    return text


def check_logged(text: str, logger: str, pid: int, message: str) -> None:
    """``_log``'s two records, each once, formatted, the traceback's lines as lines of text."""
    assert re.search(rf"^{line('INFO', logger, pid, message + ' info')}$", text, re.M), text
    error = re.search(rf"^{line('ERROR', logger, pid, message + ' error')}\nTraceback \(most recent call last\):\n"
                      rf"(  .*\n)+ValueError: {message}$", text, re.M)
    assert error, text
    assert text.count(message) == 3, text      # the info line, the error line, the exception's line


@pytest.mark.ray
def test_a_kv_manager_process_logs_to_its_worker_log(ray_cluster):
    from actors.kv_manager import KVManagerActor

    ray = ray_cluster
    kvm = ray.remote(KVManagerActor).options(num_cpus=0).remote(f"logs-{uuid.uuid4().hex[:8]}")
    try:
        pid = ray.get(kvm.__ray_call__.remote(_pid), timeout=60)
        message = f"probe-{uuid.uuid4().hex}"
        ray.get(kvm.__ray_call__.remote(_log, "actors.kv_manager", message), timeout=30)
        check_logged(worker_log(pid, f"{message} error"), "actors.kv_manager", pid, message)
    finally:
        ray.kill(kvm)


@pytest.mark.ray
def test_a_serve_replica_logs_plain_tracebacks_to_its_worker_log(ray_cluster):
    """Serve's redirect of a replica's stderr (throughput mode) neither delays nor splits the project's lines."""
    from ray import serve

    from serve_app.metrics import MetricsHub
    from tests.test_serve_support import free_port

    ray = ray_cluster
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    try:
        serve.run(serve.deployment(MetricsHub, name="MetricsHub").options(ray_actor_options={"num_cpus": 0}).bind(),
                  name="logs", route_prefix="/")
        [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::logs#MetricsHub#")]
        replica = ray.get_actor(name, namespace="serve")
        pid = ray.get(replica.__ray_call__.remote(_pid), timeout=30)
        message = f"probe-{uuid.uuid4().hex}"
        ray.get(replica.__ray_call__.remote(_log, "serve_app.metrics", message), timeout=30)
        check_logged(worker_log(pid, f"{message} error"), "serve_app.metrics", pid, message)
    finally:
        serve.shutdown()
