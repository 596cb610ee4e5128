"""Fault isolation in the scheduler: an exception while serving one request fails that
request alone.

The failed request gets a final ``TokenOutput`` with finish_reason ``error`` and the
exception in its message; the requests running beside it finish with exactly the tokens
they produce on a cold scheduler; everything the failed one held goes back
(``check_integrity(exact=True)`` and no reservation left, checked by every ``Rig.run``);
and the scheduler serves later requests as before, from a cache that holds nothing the
failure corrupted.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import hicache.scheduler.forward_pass as forward_pass_module
import hicache.scheduler.scheduler as scheduler_module
import protos
from hicache.config import HicacheConfig, config_from_dict
from hicache.model.sampling import PenaltyState, sample_next
from hicache.model.sampling_params import SamplingParams
from tests.support.rigs import Rig, cold_tokens, gen

VICTIM_SEED = 666
PATTERNS = {"full": ("full",), "swa": ("full", "swa"), "mamba": ("full", "mamba")}


def _cfg(layers: tuple[str, ...] = ("full",), page_size: int = 4, **sched: object) -> HicacheConfig:
    return config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": list(layers), "sliding_window": 16}},
        "cache": {"page_size": page_size, "l1": {"tokens": 512 * page_size, "state_slots": 64},
                  "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"chunked_prefill_tokens": 8 * page_size, "max_prefill_tokens": 16 * page_size, **sched},
    })


def _prompts(seed: int, n: int, length: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(length)] for _ in range(n)]


def _assert_failed(rig: Rig, rid: str, needle: str) -> None:
    final = rig.final(rid)
    assert final.finish_reason == "error", final
    assert final.error is not None and final.error.startswith("internal error while "), final.error
    assert needle in final.error, final.error
    assert rid not in rig.sched.by_rid


def _served_again(rig: Rig, cfg: HicacheConfig, prompts: dict[str, list[int]], n: int = 6) -> None:
    """Later requests (these prompts again) give exactly their cold-cache tokens."""
    rig.run([gen(f"again-{rid}", ids, n) for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        assert rig.tokens(f"again-{rid}") == cold_tokens(cfg, rid, ids, n), rid
        assert rig.final(f"again-{rid}").finish_reason == "length"


def test_a_sampler_exception_fails_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg()
    victim_ids, other_ids = _prompts(1, 2)
    expected = cold_tokens(cfg, "other", other_ids, 8)
    calls: list[int] = []

    def sampler(logits: torch.Tensor, params: SamplingParams, seed: int, step: int,
                penalties: PenaltyState | None = None) -> int:
        if seed == VICTIM_SEED and step == 2:  # after two tokens went out
            calls.append(step)
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return sample_next(logits, params, seed, step, penalties)

    monkeypatch.setattr(forward_pass_module, "sample_next", sampler)
    rig = Rig(cfg)
    rig.run([gen("victim", victim_ids, 8, stream=True, seed=VICTIM_SEED), gen("other", other_ids, 8, stream=True)])
    assert calls == [2]
    _assert_failed(rig, "victim", "sampling")
    assert "RuntimeError: probability tensor" in rig.final("victim").error  # type: ignore[operator]
    assert rig.tokens("victim") == cold_tokens(cfg, "victim", victim_ids, 2)  # what it had was right
    assert rig.tokens("other") == expected and rig.final("other").finish_reason == "length"
    assert rig.sched.counters.requests_error == 1 and rig.sched.counters.requests_ok == 1
    _served_again(rig, cfg, {"victim": victim_ids, "other": other_ids})


def test_an_admission_exception_fails_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg()
    victim_ids, other_ids = _prompts(2, 2)
    rig = Rig(cfg)
    real_match = rig.cache.match_prefix

    def match_prefix(key: Any, *args: Any, **kwargs: Any) -> Any:
        if list(key[:5]) == victim_ids[:5]:
            raise KeyError("a broken tree")
        return real_match(key, *args, **kwargs)

    monkeypatch.setattr(rig.cache, "match_prefix", match_prefix)
    rig.run([gen("victim", victim_ids), gen("other", other_ids)])
    _assert_failed(rig, "victim", "admitting the request")
    assert rig.tokens("victim") == []
    assert rig.tokens("other") == cold_tokens(cfg, "other", other_ids)
    monkeypatch.undo()
    _served_again(rig, cfg, {"victim": victim_ids, "other": other_ids})


@pytest.mark.parametrize("kind", ["full", "mamba"])
def test_an_exception_late_in_admission_gives_back_the_lock_and_slots(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request had its match locked, its reservations and (Mamba) its state slot when
    the exception came: all go back."""
    cfg = _cfg(PATTERNS[kind])
    shared = _prompts(3, 1, 40)[0]
    victim_ids, other_ids = shared + [7, 8, 9], shared + [10, 11]
    rig = Rig(cfg)
    rig.run([gen("warm", shared)])  # so that the victim matches a cached prefix (and its state)
    real = rig.sched.admission.account_hits

    def account_hits(req: Any, prefix: int) -> None:
        if req.rid == "victim":
            assert prefix > 0 and req.tree is not None and req.tree.lock is not None
            raise RuntimeError("accounting failed")
        real(req, prefix)

    monkeypatch.setattr(rig.sched.admission, "account_hits", account_hits)
    if kind == "mamba":
        copy = rig.sched.mamba.copy_state  # type: ignore[union-attr]
        copied: list[int] = []
        monkeypatch.setattr(rig.sched.mamba, "copy_state", lambda src, dst: (copied.append(dst), copy(src, dst)))
    rig.run([gen("victim", victim_ids), gen("other", other_ids)])
    _assert_failed(rig, "victim", "admitting the request")
    assert rig.tokens("other") == cold_tokens(cfg, "other", other_ids)
    if kind == "mamba":
        assert len(copied) == 2  # the victim's slot got its state before the failure, and was freed
    monkeypatch.undo()
    _served_again(rig, cfg, {"victim": victim_ids, "other": other_ids})


def test_an_exception_right_after_locking_the_match_releases_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg()
    shared = _prompts(10, 1, 40)[0]
    rig = Rig(cfg)
    rig.run([gen("warm", shared)])
    real = rig.sched.finisher.release_hold
    raised: list[str] = []

    def release_hold(req: Any) -> None:
        if req.rid == "victim" and not raised:  # its first call: in admission, the match locked
            raised.append(req.rid)
            raise RuntimeError("hold bookkeeping failed")
        real(req)

    monkeypatch.setattr(rig.sched.finisher, "release_hold", release_hold)
    rig.run([gen("victim", shared + [3, 4])])  # ``run`` checks the cache is exact afterwards
    assert raised == ["victim"]
    _assert_failed(rig, "victim", "admitting the request")
    assert rig.cache.evictable_size() == rig.cache.total_size()  # nothing is left locked
    monkeypatch.undo()
    _served_again(rig, cfg, {"victim": shared + [3, 4]})


def test_a_mamba_state_copy_exception_frees_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(PATTERNS["mamba"])
    shared = _prompts(4, 1, 40)[0]
    rig = Rig(cfg)
    rig.run([gen("warm", shared)])

    def broken_copy(src: int, dst: int) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(rig.sched.mamba, "copy_state", broken_copy)
    rig.run([gen("victim", shared + [1, 2])])  # ``run`` checks the cache is exact afterwards
    _assert_failed(rig, "victim", "admitting the request")
    monkeypatch.undo()
    _served_again(rig, cfg, {"victim": shared + [1, 2]})


def test_an_exception_preparing_a_forward_fails_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the middle of decoding, with pages of its own: they go back."""
    cfg = _cfg()
    victim_ids, other_ids = _prompts(5, 2, 45)
    rig = Rig(cfg)
    real = rig.sched.forward_pass.ensure_pages
    seen: list[int] = []

    def ensure_pages(req: Any, upto: int) -> bool:
        if req.rid == "victim" and len(req.output_ids) == 3:
            seen.append(upto)
            raise MemoryError("no pages")
        return real(req, upto)

    monkeypatch.setattr(rig.sched.forward_pass, "ensure_pages", ensure_pages)
    rig.run([gen("victim", victim_ids, 8), gen("other", other_ids, 8)])
    assert seen == [len(victim_ids) + 3]
    _assert_failed(rig, "victim", "preparing its forward pass")
    assert "MemoryError: no pages" in rig.final("victim").error  # type: ignore[operator]
    assert rig.tokens("victim") == cold_tokens(cfg, "victim", victim_ids, 8)[:3]  # sent with the error
    assert rig.tokens("other") == cold_tokens(cfg, "other", other_ids, 8)
    monkeypatch.undo()
    _served_again(rig, cfg, {"victim": victim_ids, "other": other_ids})


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_a_forward_pass_exception_fails_its_batch_and_corrupts_nothing(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model raises after it has written KV and state (the worst case): every request of
    that pass fails; one that had not been admitted yet is served; what the failed ones had
    computed before that pass may be cached, and repeats of their prompts still give the
    cold tokens (a snapshot the failed pass overwrote is never handed to the tree)."""
    cfg = _cfg(PATTERNS[kind])
    a_ids, b_ids, late_ids = _prompts(6, 3, 80)  # three prefill chunks of 32 tokens each
    rig = Rig(cfg)
    real_forward = rig.sched.runner.forward
    calls = [0]

    def forward(items: list[Any]) -> Any:
        calls[0] += 1
        out = real_forward(items)
        if calls[0] == 2:  # the second prefill chunk of a and b
            assert len(items) == 2
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return out

    monkeypatch.setattr(rig.sched.runner, "forward", forward)
    rig.sched.submit(gen("a", a_ids))
    rig.sched.submit(gen("b", b_ids))
    rig.sched.step()
    rig.sched.step()  # fails
    assert calls[0] == 2
    for rid in ("a", "b"):
        _assert_failed(rig, rid, "running the forward pass")
        assert "CUDA error" in rig.final(rid).error  # type: ignore[operator]
    assert rig.sched.running == [] and rig.sched.counters.requests_error == 2
    rig.run([gen("late", late_ids)])  # the scheduler goes on
    assert rig.tokens("late") == cold_tokens(cfg, "late", late_ids)
    monkeypatch.undo()
    for rid, ids in (("a", a_ids), ("b", b_ids)):
        again = _logits(rig, gen(f"again-{rid}", ids))
        cold = _logits(Rig(cfg), gen(rid, ids))
        assert len(again) == len(cold) == 6
        assert all(torch.equal(x, y) for x, y in zip(again, cold, strict=True)), rid  # bit for bit
    if kind != "mamba":  # the chunk computed before the failure was cached and is reused
        assert rig.final("again-a").usage.cached_device >= 32  # type: ignore[union-attr]


def _logits(rig: Rig, req: protos.GenerateRequest) -> list[torch.Tensor]:
    """The logits of every token ``req`` generates, run alone on ``rig``."""
    real = rig.sched.runner.forward
    seen: list[torch.Tensor] = []

    def forward(items: list[Any]) -> Any:
        out = real(items)
        seen.extend(o.clone() for o in out if o is not None)
        return out

    rig.sched.runner.forward = forward  # type: ignore[method-assign]
    try:
        rig.run([req])
    finally:
        del rig.sched.runner.forward
    return seen


def test_an_unexpected_exception_checking_a_request_answers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg()
    rig = Rig(cfg)
    real = scheduler_module.resolve_seed

    def resolve_seed(params: SamplingParams) -> int:
        if params.seed == VICTIM_SEED:
            raise OverflowError("seed out of range")
        return real(params)

    monkeypatch.setattr(scheduler_module, "resolve_seed", resolve_seed)
    ids = _prompts(7, 1)[0]
    rig.run([gen("victim", ids, seed=VICTIM_SEED), gen("other", ids)])
    _assert_failed(rig, "victim", "checking the request")
    assert rig.tokens("other") == cold_tokens(cfg, "other", ids)


@pytest.mark.parametrize("sampling", [
    {"temperature": 1e-300}, {"temperature": 5e-324}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"temperature": 1e300}, {"top_p": 0.0}, {"top_p": float("nan")}, {"top_k": 2**40}, {"seed": 2**63},
])
def test_values_the_sampler_cannot_honour_are_refused_at_submit(sampling: dict[str, Any]) -> None:
    """A message that bypassed the HTTP validation is refused by the scheduler, naming the field."""
    cfg = _cfg()
    rig = Rig(cfg)
    ids = _prompts(8, 1)[0]
    rig.run([gen("bad", ids, **{"temperature": 1.0, **sampling}), gen("ok", ids)])
    final = rig.final("bad")
    name = next(iter(sampling))
    assert final.finish_reason == "error" and final.error is not None and final.error.startswith(name + " ")
    assert rig.tokens("ok") == cold_tokens(cfg, "ok", ids)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.01, "seed": 1}, {"temperature": 100.0, "seed": 2}, {"temperature": 1.0, "top_p": 5e-324},
    {"temperature": 1.0, "top_k": 512, "top_p": 1e-300}, {"temperature": 0.01, "top_k": 1},
])
def test_extreme_accepted_values_are_served(sampling: dict[str, Any]) -> None:
    cfg = _cfg()
    rig = Rig(cfg)
    ids = _prompts(9, 1)[0]
    rig.run([gen("x", ids, 8, **sampling)])
    assert rig.final("x").finish_reason == "length" and len(rig.tokens("x")) == 8
    if sampling.get("top_k") == 1 or sampling.get("top_p", 1.0) < 1e-100:
        assert rig.tokens("x") == cold_tokens(cfg, "x", ids, 8)  # these are greedy
