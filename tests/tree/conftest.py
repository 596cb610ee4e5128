"""Shared helpers for the tree suite, and hypothesis profiles sized for a 2-core machine.

``HYPOTHESIS_PROFILE=thorough`` runs many more examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "tree-default", max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=1000, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "tree-default"))
