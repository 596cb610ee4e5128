"""One tokenizer process and one fake scheduler, shared by the HTTP tests of this folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.metrics import MULTIPROC_ENV, prepare_multiprocess_dir

from .fake_scheduler import FakeScheduler
from .harness import TokenizerProcess


@pytest.fixture(scope="session")
def metrics_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A multiprocess metrics directory, exported only while this folder's tests run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MULTIPROC_ENV, "")  # remembers the previous value, restored at the end
        yield prepare_multiprocess_dir(tmp_path_factory.mktemp("metrics"))


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, metrics_dir: Path) -> Iterator[tuple[TokenizerProcess, FakeScheduler]]:
    tp = TokenizerProcess(tmp_path_factory.mktemp("tok"), pids={"scheduler": os.getpid()},
                          admin_timeout_s=1.0)
    fake = FakeScheduler(tp.endpoints)
    tp.start()
    yield tp, fake
    code = tp.stop()
    fake.close()
    assert code == 0, tp.log()


@pytest.fixture
def tok(served: tuple[TokenizerProcess, FakeScheduler]) -> TokenizerProcess:
    return served[0]


@pytest.fixture
def fake(served: tuple[TokenizerProcess, FakeScheduler]) -> Iterator[FakeScheduler]:
    fake = served[1]
    fake.busy = False
    fake.admin_mode = "normal"
    yield fake
    fake.admin_mode = "normal"
