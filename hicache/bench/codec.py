"""``hicache bench codec``: the wire codec against raw msgpack, page hashing against raw hashlib.

Codec: encode+decode of the scheduler<->controller messages, each a realistic size, against
``msgpack.packb`` / ``msgpack.unpackb`` of the very same dicts (the reference does no
validation and builds no objects). Hashing: ``PageHasher.hash_pages`` over token lists
against bare chained ``hashlib.sha256`` over the same bytes already packed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protos import Message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions (median reported)")
    parser.add_argument("--messages", type=int, default=20000, help="messages per repetition")
    parser.add_argument("--pages", type=int, default=64, help="pages per transfer message")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens hashed per repetition")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page for hashing")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def _sample_messages(pages: int) -> list[Message]:
    import protos as p

    hashes = [f"{i:064x}" for i in range(pages)]
    idx = list(range(1000, 1000 + pages))
    return [
        p.WriteToHost(1, {"full": idx}, {"full": idx[::-1]}),
        p.LoadToDevice(2, {"full": idx}, {"full": idx[::-1]}),
        p.BackupToStorage(3, idx, hashes),
        p.PrefetchQuery(4, hashes),
        p.PrefetchFetch(5, hashes, idx),
        p.OpDone(6, "ok", pages),
        p.PrefetchHits(7, pages),
    ]


def run(args: argparse.Namespace) -> int:
    import hashlib
    import random

    import msgpack

    import protos
    from hicache.bench.report import Figure, interleaved_rates, print_table, write_json
    from hicache.hashing import HashNamespace, PageHasher, tokens_to_bytes

    figures: list[Figure] = []
    msgs = _sample_messages(args.pages)
    dicts = [msgpack.unpackb(protos.encode(m)) for m in msgs]  # the same maps, as plain dicts
    n: int = args.messages
    per = n // len(msgs)

    def ours() -> int:
        encode, decode = protos.encode, protos.decode
        for m in msgs:
            for _ in range(per):
                decode(encode(m))
        return per * len(msgs)

    def raw() -> int:
        packb, unpackb = msgpack.packb, msgpack.unpackb
        for d in dicts:
            for _ in range(per):
                unpackb(packb(d))
        return per * len(dicts)

    mine, ref = interleaved_rates([ours, raw], args.repeats)
    figures.append(Figure(f"codec encode+decode ({args.pages}-page msgs)", "msg/s", mine,
                          "raw msgpack packb+unpackb", ref, goal=0.5))

    from array import array

    rng = random.Random(0)
    token_list = [rng.randrange(32000) for _ in range(args.tokens)]
    tokens = array("I", token_list)  # the tree's key type
    hasher = PageHasher(HashNamespace("bench-model", "float32", args.page_size))
    packed = tokens_to_bytes(tokens)
    step = 4 * args.page_size
    seed = hasher.seed

    def hash_ours() -> int:
        return len(hasher.hash_pages(tokens))

    def hash_ours_list() -> int:
        return len(hasher.hash_pages(token_list))

    def hash_raw() -> int:
        sha256 = hashlib.sha256
        prev = seed
        count = 0
        for off in range(0, len(packed), step):
            prev = sha256(prev + packed[off : off + step]).digest()
            count += 1
        return count

    mine, mine_list, ref = interleaved_rates([hash_ours, hash_ours_list, hash_raw], args.repeats)
    figures.append(Figure(f"page hashes, array('I') keys (page_size {args.page_size})", "pages/s", mine,
                          "bare hashlib sha256 chain", ref, goal=0.7))
    figures.append(Figure(f"page hashes, list[int] tokens (page_size {args.page_size})", "pages/s", mine_list,
                          "bare hashlib sha256 chain", ref))
    print_table("hicache bench codec (medians of interleaved runs)", figures)
    if args.json:
        write_json(args.json, "codec", figures)
    return 0
