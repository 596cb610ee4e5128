"""Capacity strings of the replay command: tokens or blocks, with SI-like suffixes."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BYTES_PER_TOKEN = 131072  # an 8B-class model: 32 layers x 8 KV heads x 128 dims x K,V x fp16
_MULT = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


@dataclass(frozen=True)
class Size:
    """A capacity as given: ``amount`` of ``unit`` (``tokens`` or ``blocks``); ``amount``
    None means unbounded."""

    amount: int | None
    unit: str = "tokens"

    def pages(self, block_size: int, page_size: int) -> int | None:
        """The capacity in pages (rounded down; None when unbounded)."""
        if self.amount is None:
            return None
        tokens = self.amount * block_size if self.unit == "blocks" else self.amount
        return tokens // page_size


def parse_size(text: str) -> Size:
    """``"3M"`` / ``"65536"`` / ``"512k"`` tokens, ``"5859b"`` / ``"5859blocks"`` blocks,
    ``"inf"`` unbounded. ``ValueError`` with the reason otherwise."""
    s = text.strip().lower().replace("_", "").replace(",", "")
    if s in ("inf", "infinite", "unbounded"):
        return Size(None)
    unit = "tokens"
    for suffix in ("blocks", "block", "b"):
        if s.endswith(suffix):
            s, unit = s[: -len(suffix)], "blocks"
            break
    else:
        if s.endswith("tokens"):
            s = s[:-6]
    mult = 1
    if s and s[-1] in _MULT:
        mult, s = _MULT[s[-1]], s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"not a capacity: {text!r} (e.g. 3M, 65536, 5859b, inf)") from None
    amount = int(value * mult)
    if amount < 0 or value != value:
        raise ValueError(f"capacity must be >= 0: {text!r}")
    return Size(amount, unit)


def fmt_tokens(n: int | None) -> str:
    """``3.00M``, ``512k``, ``64``; ``unbounded`` for None."""
    if n is None:
        return "unbounded"
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def fmt_bytes(n: int) -> str:
    """Binary units: ``1.50 GiB``."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"

