"""KV cache events in vLLM's wire format: what the tiers hold, published for routers and
other subscribers (``format``: the messages and their msgpack encoding; ``publisher``: the
ZeroMQ PUB socket and its replay socket; ``tracker``: the tree's tier changes as events)."""
