"""One sample of every wire message, used by the golden-frame and round-trip tests."""

from __future__ import annotations

import protos as p

SAMPLES: dict[str, p.Message] = {
    "generate": p.GenerateRequest(
        "req-1", [1, 2, 3, 70000], p.SamplingParams(max_new_tokens=8, temperature=0.5, top_p=0.9, top_k=40,
                                                     seed=7, stop_token_ids=[2], presence_penalty=0.5,
                                                     frequency_penalty=-0.25, repetition_penalty=1.5, min_p=0.05,
                                                     logprobs=2), True, "tenant-a"),
    "abort": p.AbortRequest("req-1"),
    "admin": p.AdminRequest("adm-1", "storage_attach", {"backend": "file", "dir": "/tmp/x"}),
    "op_done": p.OpDone(12, "failed", 3, "timeout", {"swa": [True, False], "mamba": [True]}),
    "prefetch_hits": p.PrefetchHits(13, 5, {"swa": [0, 1, 4], "mamba": [4]}),
    "storage_status": p.StorageStatus(-1, "redis", False, {"errors": 2}, "connection refused"),
    "token_output": p.TokenOutput("req-1", [5, 6], True, "stop", p.Usage(4, 2, 2, 1, 0), None,
                                  [-0.5, -1.25], [[5, 3], [6, 5]], [[-0.5, -2.0], [-1.25, -1.5]]),
    "admin_reply": p.AdminReply("adm-1", True, {"flushed_tokens": 128}),
    "write_to_host": p.WriteToHost(1, {"full": [0, 1], "swa": [4]}, {"full": [9, 8], "swa": [3]}),
    "load_to_device": p.LoadToDevice(2, {"full": [9]}, {"full": [0]}),
    "backup": p.BackupToStorage(3, [7, 8], ["a" * 64, "b" * 64], "full", {"swa": [1, 2], "mamba": [9]},
                                {"swa": ["d" * 64, "e" * 64], "mamba": ["f" * 64]}),
    "prefetch_query": p.PrefetchQuery(4, ["c" * 64], "full", {"swa": ["d" * 64]}),
    "prefetch_fetch": p.PrefetchFetch(5, ["c" * 64], [11], "full", {"mamba": ["f" * 64]}, {"mamba": [3]}),
    "cancel": p.Cancel(5),
    "storage_admin": p.StorageAdmin(6, "clear"),
    "ready": p.Ready("controller", 4242),
    "shutdown": p.Shutdown("SIGTERM", 5.0),
    "error": p.ErrorReply("unknown message tag 'x'", "req-9"),
    "process_event": p.ProcessEvent("controller", "died", 4242, "exit code -9"),
    "engine_register": p.EngineRegister(1, "vllm-a", 4242, "d" * 64, "bfloat16", 32, 2, 2, 32, "LBHNC", 16384,
                                        "e" * 64, "pid:[4026531836]", 123456, 2),
    "engine_lookup": p.Lookup(2, 7, 99, "req-1", p.pack_tokens([3, 4]), "tenant-a", True, 2),
    "engine_reserve": p.Reserve(3, 7, 99, [p.SaveRange("req-1", p.pack_tokens([1, 2, 3, 4]), 1, "tenant-a", 32),
                                                p.SaveRange("req-2", p.pack_tokens([5, 6]), 0)]),
    "engine_finished": p.Finished(7, 99, "req-1"),
    "engine_commit": p.Commit(7, 99, 12, False, 1),
    "engine_release": p.Release(7, 99, 11, 3, p.ALL_RANKS),
    "engine_worker": p.EngineWorker(99, 4242, 123456, "pid:[4026531836]", 1, 4250, 123470),
    "engine_heartbeat": p.Heartbeat(7, 99),
    "engine_registered": p.EngineRegistered(1, 7, 99, "hicache-1-ab", "hicache-1-ab-full-l2-0", "/dev/shm", 64,
                                            16384, 10.0),
    "engine_lookup_result": p.LookupResult(2, 11, [5, 6], 1, False),
    "engine_reserve_result": p.ReserveResult(3, [p.Reservation(12, 2, [9, 10]),
                                                          p.Reservation(code="unknown_request", reason="send all")]),
    "engine_error": p.EngineError(4, "unknown_session", "session 7 is not open"),
}
