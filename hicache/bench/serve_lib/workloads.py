"""Workloads of ``hicache bench serve``: *what* each request sends, never *when*.

A workload is a tuple of ``Conversation``s, each a tuple of ``Turn``s. A turn holds the
tokens it appends and how many tokens it asks for; the prompt of turn ``k`` is

    turn[0].tokens + answer[0] + turn[1].tokens + answer[1] + ... + turn[k].tokens

where ``answer[i]`` are the output ids the server returned for turn ``i``
(``Conversation.prompt``). A single-turn conversation is one plain request. Multi-turn
prompts therefore depend on the server's answers and are built while the benchmark runs;
everything else is fixed by the generator's arguments and its seed: the same arguments
give the same workload, token for token.

Tokens are drawn uniformly from a ``TokenRange`` (default ids 1..255, valid for every
model preset: the built-in byte-level tokenizer needs a vocabulary of at least 260). A run
of random ids never repeats a page by chance, so cache hits come only from the prefixes a
workload shares on purpose.

Generators (each raises ``WorkloadError`` for an impossible argument):

- ``multi_turn``: ``conversations`` x ``rounds``; each round appends the previous answer and
  a new question to the history (SGLang's ``bench_multiturn.py``, LMCache's multi-round QA),
  optionally after a system prompt shared by all conversations.
- ``shared_prefix``: ``groups`` x ``prompts_per_group`` prompts, each a group's system prompt
  plus its own question, shuffled (SGLang's ``generated-shared-prefix`` dataset).
- ``long_doc_qa``: ``documents`` long documents, each asked ``questions`` questions, one pass
  over all documents per question (LMCache's long-document QA).
- ``trace_workload``: a Mooncake-format file; every hash id becomes a deterministic block of
  tokens, so equal ids at a position mean equal prefixes, as in the trace; arrival times
  come from the records' ``timestamp`` (ms).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hicache.replay_sim.trace import TraceError, infer_block_size, load_trace

__all__ = [
    "Conversation", "TokenRange", "Turn", "Workload", "WorkloadError", "TraceError", "block_tokens",
    "long_doc_qa", "multi_turn", "shared_prefix", "trace_workload",
]


class WorkloadError(ValueError):
    """A workload that cannot be built or cannot be served (the message says which argument)."""


@dataclass(frozen=True)
class TokenRange:
    """Token ids ``low`` .. ``high - 1``; ``0 <= low < high``."""

    low: int = 1
    high: int = 256

    def __post_init__(self) -> None:
        if self.low < 0 or self.high <= self.low:
            raise WorkloadError(f"token range {self.low}..{self.high - 1} is empty or negative")

    def draw(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        """``n`` ids drawn uniformly from the range."""
        return tuple(int(x) for x in rng.integers(self.low, self.high, size=n))


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: the tokens it appends, the tokens it asks for, and
    (trace workloads only) its arrival time in seconds from the start, at speed 1."""

    tokens: tuple[int, ...]
    max_new_tokens: int
    at_s: float | None = None


@dataclass(frozen=True)
class Conversation:
    """A sequence of turns; turn ``k+1`` is sent after turn ``k`` was answered."""

    cid: int
    turns: tuple[Turn, ...]

    def prompt(self, k: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """The prompt of turn ``k`` given the answers to turns ``0 .. k-1``.

        ``IndexError`` unless ``0 <= k < len(turns)`` and ``len(answers) >= k``.
        """
        if not 0 <= k < len(self.turns):
            raise IndexError(f"conversation {self.cid} has no turn {k}")
        if len(answers) < k:
            raise IndexError(f"turn {k} of conversation {self.cid} needs {k} answers, got {len(answers)}")
        out: list[int] = []
        for i in range(k):
            out.extend(self.turns[i].tokens)
            out.extend(answers[i])
        out.extend(self.turns[k].tokens)
        return out

    def max_prompt_tokens(self) -> int:
        """The longest prompt of this conversation when every answer has its full length."""
        total = 0
        for t in self.turns:
            total += len(t.tokens) + t.max_new_tokens
        return total - self.turns[-1].max_new_tokens if self.turns else 0


@dataclass(frozen=True)
class Workload:
    """Conversations, the generator's name and parameters (for the report), and whether the
    turns carry arrival times (``timed``)."""

    name: str
    conversations: tuple[Conversation, ...]
    params: dict[str, Any] = field(default_factory=dict)
    timed: bool = False

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def max_context_needed(self) -> int:
        """The most tokens one request can occupy: its longest prompt plus its answer."""
        return max((c.max_prompt_tokens() + c.turns[-1].max_new_tokens for c in self.conversations if c.turns),
                   default=0)

    @property
    def working_set_tokens(self) -> int:
        """Distinct prompt tokens of the whole run at full answer length: what a cache must
        hold to serve every shared prefix from the cache (the generator's estimate)."""
        return int(self.params.get("working_set_tokens", 0))

    def check_fits(self, max_context: int) -> None:
        """``WorkloadError`` if some request would not fit a context of ``max_context`` tokens."""
        need = self.max_context_needed()
        if need > max_context:
            raise WorkloadError(
                f"the {self.name} workload needs up to {need} tokens per request (prompt plus answer), "
                f"but the model's context is {max_context}; use fewer rounds or shorter texts")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise WorkloadError(f"{name} must be >= 1, got {value}")


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise WorkloadError(f"{name} must be >= 0, got {value}")


def multi_turn(conversations: int, rounds: int, question_len: int, output_len: int, *, system_len: int = 0,
               seed: int = 0, tokens: TokenRange = TokenRange()) -> Workload:
    """``conversations`` chats of ``rounds`` rounds each; round ``r`` sends the history (system
    prompt, every earlier question and answer) plus a new question of ``question_len`` tokens
    and asks for ``output_len`` tokens. The system prompt (``system_len`` tokens) is shared by
    all conversations."""
    _positive("conversations", conversations)
    _positive("rounds", rounds)
    _positive("question_len", question_len)
    _positive("output_len", output_len)
    _non_negative("system_len", system_len)
    rng = np.random.default_rng(seed)
    system = tokens.draw(rng, system_len)
    convs = []
    for c in range(conversations):
        turns = []
        for r in range(rounds):
            q = tokens.draw(rng, question_len)
            turns.append(Turn(system + q if r == 0 else q, output_len))
        convs.append(Conversation(c, tuple(turns)))
    working = system_len + conversations * rounds * (question_len + output_len)
    return Workload("multi_turn", tuple(convs), dict(
        conversations=conversations, rounds=rounds, question_len=question_len, output_len=output_len,
        system_len=system_len, seed=seed, token_range=[tokens.low, tokens.high - 1],
        working_set_tokens=working))


def shared_prefix(groups: int, prompts_per_group: int, system_len: int, question_len: int, output_len: int, *,
                  seed: int = 0, tokens: TokenRange = TokenRange(), shuffle: bool = True) -> Workload:
    """``groups`` system prompts of ``system_len`` tokens, each followed by
    ``prompts_per_group`` questions of ``question_len`` tokens: one single-turn request per
    question, in a seeded random order unless ``shuffle`` is false (then group by group)."""
    _positive("groups", groups)
    _positive("prompts_per_group", prompts_per_group)
    _positive("system_len", system_len)
    _positive("question_len", question_len)
    _positive("output_len", output_len)
    rng = np.random.default_rng(seed)
    prompts: list[tuple[int, ...]] = []
    for _ in range(groups):
        system = tokens.draw(rng, system_len)
        prompts.extend(system + tokens.draw(rng, question_len) for _ in range(prompts_per_group))
    order = rng.permutation(len(prompts)) if shuffle else np.arange(len(prompts))
    convs = tuple(Conversation(i, (Turn(prompts[int(j)], output_len),)) for i, j in enumerate(order))
    return Workload("shared_prefix", convs, dict(
        groups=groups, prompts_per_group=prompts_per_group, system_len=system_len, question_len=question_len,
        output_len=output_len, seed=seed, shuffle=shuffle, token_range=[tokens.low, tokens.high - 1],
        working_set_tokens=groups * (system_len + prompts_per_group * question_len)))


def long_doc_qa(documents: int, doc_len: int, questions: int, question_len: int, output_len: int, *,
                seed: int = 0, tokens: TokenRange = TokenRange(), shuffle: bool = True) -> Workload:
    """``documents`` documents of ``doc_len`` tokens; ``questions`` passes, each asking every
    document one new question of ``question_len`` tokens (documents in a seeded random order
    per pass unless ``shuffle`` is false). Every request is single-turn: document + question."""
    _positive("documents", documents)
    _positive("doc_len", doc_len)
    _positive("questions", questions)
    _positive("question_len", question_len)
    _positive("output_len", output_len)
    rng = np.random.default_rng(seed)
    docs = [tokens.draw(rng, doc_len) for _ in range(documents)]
    convs: list[Conversation] = []
    for _ in range(questions):
        order = rng.permutation(documents) if shuffle else np.arange(documents)
        for d in order:
            convs.append(Conversation(len(convs), (Turn(docs[int(d)] + tokens.draw(rng, question_len), output_len),)))
    return Workload("long_doc_qa", tuple(convs), dict(
        documents=documents, doc_len=doc_len, questions=questions, question_len=question_len,
        output_len=output_len, seed=seed, shuffle=shuffle, token_range=[tokens.low, tokens.high - 1],
        working_set_tokens=documents * doc_len + documents * questions * question_len))


def block_tokens(block_id: int, n: int, seed: int = 0, tokens: TokenRange = TokenRange()) -> tuple[int, ...]:
    """The ``n`` deterministic tokens of trace block ``block_id`` (a function of the id, ``n``'s
    prefix property aside: ``block_tokens(b, k)`` is a prefix of ``block_tokens(b, n)`` for
    ``k <= n``)."""
    return tokens.draw(np.random.default_rng([seed, block_id]), n)


def _output_lengths(path: str | Path, count: int) -> list[int | None]:
    """``output_length`` of the first ``count`` records (None where absent); ``TraceError``
    naming ``path:line`` for a value that is not a non-negative integer."""
    out: list[int | None] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if len(out) >= count:
                break
            line = line.strip()
            if not line:
                continue
            n = json.loads(line).get("output_length")  # load_trace has checked it is a JSON object
            if n is not None and (type(n) is not int or n < 0):
                raise TraceError(f"{path}:{lineno}: 'output_length' must be a non-negative integer, got {n!r}")
            out.append(n)
    return out


def trace_workload(path: str | Path, *, block_tokens_n: int | None = None, limit: int | None = None,
                   output_len: int | None = None, max_output_len: int | None = None,
                   max_prompt_len: int | None = None, seed: int = 0,
                   tokens: TokenRange = TokenRange()) -> Workload:
    """Requests of a Mooncake-format trace, one single-turn conversation each.

    Every hash id ``b`` becomes ``block_tokens(b, B)`` where ``B`` is ``block_tokens_n`` or the
    trace's block size (inferred from ``input_length``; 512 if it cannot be). A record's
    prompt is its blocks' tokens, the last block cut so that the prompt has
    ``input_length * B / B_trace`` tokens when ``input_length`` is given, then cut to
    ``max_prompt_len``. It asks for ``output_len`` tokens, else the record's
    ``output_length`` (at least 1, at most ``max_output_len`` when given). ``at_s`` is ``timestamp / 1000`` from the first record
    (the workload is ``timed`` when every record has one). ``limit`` keeps the first records.

    Raises ``TraceError`` naming ``path:line`` for a bad record, ``OSError`` if unreadable,
    ``WorkloadError`` for bad arguments or an empty trace.
    """
    if limit is not None:
        _positive("limit", limit)
    if block_tokens_n is not None:
        _positive("block_tokens", block_tokens_n)
    if output_len is not None:
        _positive("output_len", output_len)
    if max_output_len is not None:
        _positive("max_output_len", max_output_len)
    if max_prompt_len is not None:
        _positive("max_prompt_len", max_prompt_len)
    trace = load_trace(path)
    n = trace.requests if limit is None else min(limit, trace.requests)
    if n == 0:
        raise WorkloadError(f"{path}: the trace has no records")
    trace_b = infer_block_size(trace) or 512
    b = block_tokens_n or trace_b
    outs = _output_lengths(path, n)
    cache: dict[int, tuple[int, ...]] = {}
    stamps = trace.timestamps[:n]
    timed = all(t is not None for t in stamps)
    t0 = min((t for t in stamps if t is not None), default=0.0)
    convs = []
    truncated = 0
    unique: set[int] = set()
    for i in range(n):
        ids = trace.blocks[i]
        prompt: list[int] = []
        for h in ids:
            blk = cache.get(h)
            if blk is None:
                blk = cache[h] = block_tokens(h, b, seed, tokens)
            prompt.extend(blk)
            unique.add(h)
        length = trace.input_lengths[i]
        if length is not None:
            prompt = prompt[:max(1, -(-length * b // trace_b))]
        if max_prompt_len is not None and len(prompt) > max_prompt_len:
            prompt = prompt[:max_prompt_len]
            truncated += 1
        if not prompt:  # a record without blocks still sends one token
            prompt = [tokens.low]
        want = output_len if output_len is not None else max(1, outs[i] or 1)
        if output_len is None and max_output_len is not None:
            want = min(want, max_output_len)
        stamp = stamps[i]
        at = (stamp - t0) / 1000.0 if timed and stamp is not None else None
        convs.append(Conversation(i, (Turn(tuple(prompt), want, at),)))
    return Workload("trace", tuple(convs), dict(
        trace=str(path), records=n, trace_block_size=trace_b, block_tokens=b, output_len=output_len,
        max_output_len=max_output_len, max_prompt_len=max_prompt_len, truncated=truncated, seed=seed, token_range=[tokens.low, tokens.high - 1],
        working_set_tokens=len(unique) * b), timed=timed)
