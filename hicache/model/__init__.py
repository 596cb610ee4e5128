"""The model worker (docs/architecture.md §9): reference and Hugging Face decoders on paged KV.

Torch-free entry points: ``hicache.model.spec`` (architecture), ``hicache.model.geometry``
(what the pools must hold). The rest (``loader``, ``runner``, ``pools``, ``sampling``)
imports torch; import those modules directly.
"""
