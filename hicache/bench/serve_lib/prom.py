"""``/metrics`` snapshots of the counters ``hicache bench serve`` reports, and their deltas.

A ``CounterSnapshot`` holds ``hicache_cached_tokens_total{tier}`` (tiers ``device``,
``host``, ``storage``), ``hicache_prompt_tokens_total`` and
``hicache_generation_tokens_total`` summed over every series the exposition holds (one
``/metrics`` covers all processes). ``delta(before, after)`` is what the run added, as
long as nothing else used the daemon meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["TIERS", "CounterSnapshot", "parse_counters"]

TIERS = ("device", "host", "storage")


@dataclass(frozen=True)
class CounterSnapshot:
    """Counter values at one moment (or the difference of two snapshots)."""

    cached: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0

    def minus(self, before: CounterSnapshot) -> CounterSnapshot:
        """``self - before``, tier by tier."""
        return CounterSnapshot({t: self.cached.get(t, 0.0) - before.cached.get(t, 0.0) for t in TIERS},
                               self.prompt_tokens - before.prompt_tokens,
                               self.generation_tokens - before.generation_tokens)

    def to_json(self) -> dict[str, int]:
        out = {t: int(round(self.cached.get(t, 0.0))) for t in TIERS}
        out["cached"] = sum(out[t] for t in TIERS)
        out["prompt"] = int(round(self.prompt_tokens))
        out["generation"] = int(round(self.generation_tokens))
        return out


def parse_counters(text: str) -> CounterSnapshot:
    """The counters of a Prometheus text exposition; ``ValueError`` if it does not parse.
    Missing series count as 0; unknown tiers are ignored."""
    cached = dict.fromkeys(TIERS, 0.0)
    prompt = generation = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "hicache_cached_tokens_total":
                tier = sample.labels.get("tier")
                if tier in cached:
                    cached[tier] += sample.value
            elif sample.name == "hicache_prompt_tokens_total":
                prompt += sample.value
            elif sample.name == "hicache_generation_tokens_total":
                generation += sample.value
    return CounterSnapshot(cached, prompt, generation)
