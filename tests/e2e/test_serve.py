"""End to end: a real ``hicache serve`` (three processes, real sockets, shared memory, L3).

The correctness oracle is the model itself: greedy outputs must be identical whether a
prompt's prefix came from L1, L2, L3 or was recomputed on a cold daemon.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import Daemon, alive, check_served_from_l3_after_restart, segments_of, shm_segments


def _config(tmp: Path, **cache: object) -> dict:
    base = {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 2048}, "l2": {"tokens": 8192},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}, **cache},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }
    return base


def _owned(d: Daemon) -> set[str]:
    """The shared-memory segments of this daemon (named after its launcher's pid)."""
    assert d.proc is not None
    return shm_segments(f"hicache-{d.proc.pid}-")



@pytest.fixture
def daemon(tmp_path: Path):
    d = Daemon(tmp_path, _config(tmp_path))
    d.start()
    assert _owned(d), "the daemon's pools are not where expected"
    try:
        yield d
    finally:
        code = d.stop()
    assert code == 0, d.log()
    leaked = _owned(d)
    assert not leaked, f"shared memory left behind: {leaked}"


def test_cached_prefix_gives_the_same_output_and_reports_hits(daemon: Daemon, tmp_path: Path) -> None:
    rng = random.Random(0)
    system = [rng.randrange(1, 250) for _ in range(64)]
    prompts = [system + [rng.randrange(1, 250) for _ in range(20)] for _ in range(3)]
    first = [daemon.generate(p) for p in prompts]
    again = [daemon.generate(p) for p in prompts]
    for a, b in zip(first, again, strict=True):
        assert a["output_ids"] == b["output_ids"]
    assert first[1]["meta_info"]["cached_tokens"] >= 64
    assert again[0]["meta_info"]["cached_tokens_details"]["device"] >= 80
    assert set(again[0]["meta_info"]["timings_ms"]) == {"queue", "load", "prefill"}
    assert again[0]["meta_info"]["timings_ms"]["prefill"] > 0  # the scheduler's figures reach the client
    cold = Daemon(tmp_path, _config(tmp_path / "cold", l2={"enabled": False}, l3={"backend": "none"}), "cold")
    cold.start()
    try:
        for p, a in zip(prompts, first, strict=True):
            assert cold.generate(p)["output_ids"] == a["output_ids"]
    finally:
        assert cold.stop() == 0


def test_seed_split_bug_end_to_end(tmp_path: Path) -> None:
    d = Daemon(tmp_path, _config(tmp_path, page_size=1))
    d.start()
    try:
        enc = lambda s: list(s.encode())  # noqa: E731 - the byte-level tokenizer's ids
        d.generate(enc("Hello_L.A.!"), 2)
        d.generate(enc("Hello_L.A.!world"), 2)
        hit = d.generate(enc("Hello_world"), 4)
        assert hit["meta_info"]["cached_tokens"] == 6
        d.request("POST", "/cache/flush")
        miss = d.generate(enc("Hello_world"), 4)
        assert miss["output_ids"] == hit["output_ids"]
    finally:
        assert d.stop() == 0


def test_l3_round_trip_after_flush_and_after_restart(tmp_path: Path) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(1, 250) for _ in range(768)]
    d = Daemon(tmp_path, _config(tmp_path))
    d.start()
    try:
        first = d.generate(prompt, 4)
        for i in range(3):
            d.generate([rng.randrange(1, 250) for _ in range(100 + i)], 2)
        d.wait_tiers_idle("write-through and backups done")
        status, _ = d.request("POST", "/cache/flush")
        assert status == 200
        again = d.generate(prompt, 4)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens_details"]["storage"] >= 700, again["meta_info"]
    finally:
        assert d.stop() == 0
    check_served_from_l3_after_restart(tmp_path, _config(tmp_path), prompt, first["output_ids"], 700)


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as fh:
        return "libtorch" in fh.read()


def test_the_launcher_never_loads_torch_and_its_children_do(daemon: Daemon) -> None:
    """The launcher creates the pools' segments and spawns the children without torch (its
    import is seconds of CPU per start and per restart); the children that copy load it."""
    assert daemon.proc is not None
    pids = daemon.pids()
    assert not _maps_torch(daemon.proc.pid)
    assert _maps_torch(pids["controller"]) and _maps_torch(pids["scheduler"])
    assert daemon.generate([5, 6, 7, 8, 9], 2)["output_ids"]


def test_controller_killed_during_traffic_is_restarted(daemon: Daemon) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 250) for _ in range(120)] for _ in range(6)]
    expected = [daemon.generate(p, 6)["output_ids"] for p in prompts]
    controller = daemon.pids()["controller"]
    os.kill(controller, signal.SIGKILL)
    outs = [daemon.generate(p, 6)["output_ids"] for p in prompts]
    assert outs == expected
    assert daemon.wait_replaced("controller", controller, 60) is not None
    metrics = {s.name: s.value for f in text_string_to_metric_families(daemon.get_text("/metrics"))
               for s in f.samples if s.name == "hicache_process_restarts_total"}
    assert metrics.get("hicache_process_restarts_total", 0) >= 1
    assert [daemon.generate(p, 6)["output_ids"] for p in prompts] == expected
    stats = daemon.get("/cache/stats")
    assert stats is not None


def test_sigterm_leaves_nothing_behind(tmp_path: Path) -> None:
    d = Daemon(tmp_path, _config(tmp_path))
    d.start()
    pids = d.pids()
    assert _owned(d)
    d.generate([5] * 40, 4)
    assert d.stop() == 0
    for name, pid in pids.items():
        assert not alive(pid), f"{name} (pid {pid}) still running"
    assert not _owned(d)


@pytest.mark.parametrize("existing", [True, False], ids=["dir-existed", "dir-created"])
def test_a_configured_ipc_dir_keeps_only_what_was_there_before(tmp_path: Path, existing: bool) -> None:
    """With ``ipc.dir`` set, a clean stop removes the daemon's sockets, heartbeat files and
    metrics files there (also a stale socket of a daemon that was killed), keeps what anyone
    else put there (before the start or while it ran), and removes the directory itself only
    if the daemon created it."""
    run = Path(tempfile.mkdtemp(prefix="hc", dir="/tmp")) / "run"  # unix socket paths stay short
    try:
        if existing:
            run.mkdir(mode=0o700)
            (run / "operator-notes.txt").write_text("kept")
            (run / "scheduler.sock").write_text("")  # a stale socket of a daemon that was killed
        d = Daemon(tmp_path, {**_config(tmp_path), "ipc": {"dir": str(run)}})
        d.start()
        made = set(os.listdir(run))
        assert {"heartbeat", "metrics", "scheduler.sock", "tokenizer.sock", "controller.sock"} <= made, made
        d.generate([5] * 40, 4)
        if existing:
            (run / "other-service.sock").write_text("")  # another process's file, made meanwhile
        assert d.stop() == 0, d.log()
        if existing:
            assert sorted(os.listdir(run)) == ["operator-notes.txt", "other-service.sock"]
            assert (run / "operator-notes.txt").read_text() == "kept"
        else:
            assert not run.exists()
    finally:
        shutil.rmtree(run.parent, ignore_errors=True)


def test_killed_launcher_leaves_no_orphans_and_next_start_cleans_up(tmp_path: Path) -> None:
    d = Daemon(tmp_path, _config(tmp_path))
    d.start()
    pids = d.pids()
    stale = _owned(d)  # the killed launcher will not unlink its pools ...
    assert stale
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGKILL)  # only the launcher: its children must follow it
    d.proc.wait(10)
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids.values()), pids
    d2 = Daemon(tmp_path, _config(tmp_path), "next")
    d2.start()
    try:
        # ... the next start removed them (under two test workers another worker's daemon
        # may have started first and removed them: every start removes a dead launcher's)
        assert not (stale & shm_segments())
        assert _owned(d2)
    finally:
        assert d2.stop() == 0


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Another server holds the HTTP port: a clear error and exit 1 at once, before any
    process or shared-memory pool exists (not seconds later, from the tokenizer)."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        d = Daemon(tmp_path, _config(tmp_path))
        cfg_text = d.config_path.read_text().replace(f"port: {d.port}", f"port: {holder.getsockname()[1]}")
        d.config_path.write_text(cfg_text)
        d.launch()
        assert d.proc is not None
        code = d.proc.wait(60)
        assert code == 1, d.log()
        assert f"cannot listen on 127.0.0.1:{holder.getsockname()[1]}" in d.log()
        assert "controller ready" not in d.log()  # no process was started
        assert not segments_of(d.proc.pid)
    finally:
        holder.close()
