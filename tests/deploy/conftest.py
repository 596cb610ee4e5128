"""Fixtures for the deployment files' tests (``deploy/``): a tiny checkpoint for the configs
that name one, and one real daemon for the tests that need live metrics.

The daemon is started once per test run (pytest session scope) with the end-to-end helpers
(``tests/support/daemon.py``) on the tiny reference model with a file L3; it has served the same
prompt twice when the tests get it (the second time from L1), and must stop with exit 0 at
the end of the run.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.deploy_helpers import (
    OPERATOR_KEY,
    PROMPT,
    CheckConfig,
    LiveDaemon,
    all_check_config_runs,
    check_config_all,
    live_daemon_config,
    write_tiny_llama,
)
from tests.support.daemon import Daemon


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint directory, for the configs that name ``/models/...``."""
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="session")
def config_checks(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckConfig]:
    """Every ``hicache check-config`` run of the deploy tests, done once, in parallel
    (``deploy_helpers.all_check_config_runs`` names them)."""
    return check_config_all(all_check_config_runs(tiny_checkpoint, tmp_path_factory.mktemp("k8s-config")))


@pytest.fixture(scope="session")
def live_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    """A running daemon that has answered the same prompt twice (the second from L1)."""
    base = Path(tempfile.mkdtemp(prefix="hcd", dir="/tmp"))  # short: unix socket paths
    key_file = base / "operator.key"
    key_file.write_text(OPERATOR_KEY + "\n")
    d = Daemon(base, live_daemon_config(base / "l3", key_file), name="d")
    d.bearer = OPERATOR_KEY
    try:
        d.start(timeout_s=120.0)
        first = d.generate(PROMPT, n=4)
        second = d.generate(PROMPT, n=4)
        yield LiveDaemon(d, first, second, key_file)
        code = d.stop(timeout_s=60.0)
        assert code == 0, f"the daemon exited with {code}:\n{d.log()}"
    finally:
        d.kill_all()
        shutil.rmtree(base, ignore_errors=True)


