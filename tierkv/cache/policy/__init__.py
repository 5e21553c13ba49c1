"""Eviction policies: one small interface, one module per policy; the simulator reuses them.

``make_policy(name, **settings)`` builds one; ``policy_names()`` lists the built-ins
(``lru``, ``lfu``, ``slru``, ``gdsf``, ``attention``, ``adaptive``; ``opt`` is the simulator's oracle).
"""

from tierkv.cache.policy.base import HeapPolicy, Policy, Setting, make_policy, policy_class, policy_names

DEFAULT_POLICY = "attention"

__all__ = ["DEFAULT_POLICY", "HeapPolicy", "Policy", "Setting", "make_policy", "policy_class", "policy_names"]
