"""Helpers shared by more than one test folder (import them as ``tests.support.<module>``).

- ``daemon``: a real ``hicache serve`` subprocess (``Daemon``) and the clean-stop check.
- ``redis_servers``: where ``redis-server`` is and the skip reason without it.
- ``vllm_engines``: engine mode's daemon config, vLLM engines and a model's stack.
- ``rigs``: in-process scheduler rigs (a scheduler and its controller without processes).
- ``tree``: small builders of radix trees and allocators.
- ``hybrid_machine``: the random operation machine over a hybrid cache with L2.
- ``advise_trace``: the closed-form workload of ``hicache advise`` and its trace file.

Fixtures stay in each folder's ``conftest.py``; a test never imports a ``conftest``.
"""
