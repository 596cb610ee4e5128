"""The generation routes of a daemon in engine mode: the engines generate, so each route
answers 501 with the engine-mode message and sends nothing to the scheduler."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hicache.config import ENGINE_MODE_ERROR

from .fake_scheduler import FakeScheduler
from .harness import TokenizerProcess

BODIES = {
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
}


def test_generation_routes_answer_501_in_engine_mode(tmp_path: Path) -> None:
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tp = TokenizerProcess(tmp_path, {"engine.kind": "vllm", "engine.model": str(checkpoint),
                                     "ipc.dir": str(tmp_path / "run")}, pids={"scheduler": os.getpid()})
    fake = FakeScheduler(tp.endpoints)
    try:
        tp.start()
        for path, body in BODIES.items():
            r = tp.post(path, body)
            assert r.status == 501, (path, r.status, r.body[:300])
            error = r.json()["error"]
            assert error["message"] == ENGINE_MODE_ERROR and error["code"] == 501, (path, error)
        assert tp.get("/v1/models").status == 200  # the rest of the API still answers
        assert fake.generate_requests() == []
    finally:
        code = tp.stop()
        fake.close()
    assert code == 0, tp.log()
