"""One sample of every wire message, used by the golden-frame and round-trip tests."""

from __future__ import annotations

import protos as p

SAMPLES: dict[str, p.Message] = {
    "generate": p.GenerateRequest(
        "req-1", [1, 2, 3, 70000], p.SamplingParams(max_new_tokens=8, temperature=0.5, top_p=0.9, top_k=40,
                                                     seed=7, stop_token_ids=[2]), True, "tenant-a"),
    "abort": p.AbortRequest("req-1"),
    "admin": p.AdminRequest("adm-1", "storage_attach", {"backend": "file", "dir": "/tmp/x"}),
    "op_done": p.OpDone(12, "failed", 3, "timeout"),
    "prefetch_hits": p.PrefetchHits(13, 5),
    "storage_status": p.StorageStatus(-1, "redis", False, {"errors": 2}, "connection refused"),
    "token_output": p.TokenOutput("req-1", [5, 6], True, "stop", p.Usage(4, 2, 2, 1, 0)),
    "admin_reply": p.AdminReply("adm-1", True, {"flushed_tokens": 128}),
    "write_to_host": p.WriteToHost(1, {"full": [0, 1], "swa": [4]}, {"full": [9, 8], "swa": [3]}),
    "load_to_device": p.LoadToDevice(2, {"full": [9]}, {"full": [0]}),
    "backup": p.BackupToStorage(3, [7, 8], ["a" * 64, "b" * 64]),
    "prefetch_query": p.PrefetchQuery(4, ["c" * 64]),
    "prefetch_fetch": p.PrefetchFetch(5, ["c" * 64], [11]),
    "cancel": p.Cancel(5),
    "storage_admin": p.StorageAdmin(6, "clear"),
    "ready": p.Ready("controller", 4242),
    "shutdown": p.Shutdown("SIGTERM", 5.0),
    "error": p.ErrorReply("unknown message tag 'x'", "req-9"),
    "process_event": p.ProcessEvent("controller", "died", 4242, "exit code -9"),
}
