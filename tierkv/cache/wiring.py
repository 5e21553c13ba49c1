"""The policy wiring of a tier stack: which model weighs which tier's order, which history the policies
share, and the admission rule of the colder tier. The daemon (:mod:`tierkv.daemon.startup`, from its
settings) and ``tierkv replay`` (:class:`tierkv.sim.simulator.Simulator`, from the replayed tiers)
build their decisions here, so replay grades what the daemon runs.

- :func:`host_reuse`: the host tier's reuse model (which host victims come back).
- :func:`admission_rule`: the colder tier's :class:`~tierkv.cache.admission.Admission`.
- :func:`host_policy`: the host order, weighted by the host's reuse model.
- :func:`colder_policy`: the colder tier's order, weighted by the admission rule's eviction model under
  ``predicted`` admission, its shadow fed by that tier's references.

Plain code, no threads and no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping

from tierkv.cache.admission import Admission
from tierkv.cache.policy import Policy, make_policy, policy_class
from tierkv.cache.reuse import History, ReuseModel

Clock = Callable[[], float]


def host_reuse(max_records: int) -> ReuseModel:
    """The host tier's reuse model. The host policy scores a block while its request runs, before the
    generated-token count is known, so that count is not one of its classes."""
    return ReuseModel(max_records=max_records, output_edges="")


def admission_rule(mode: str, settings: Mapping[str, object], *, ghost_entries: int, max_records: int,
                   unit: Callable[[Hashable], Hashable]) -> Admission:
    """The colder tier's admission rule.

    Args:
        mode: ``predicted``, ``reused``, ``all`` or ``pinned``.
        settings: the rule's and its models' settings (those given override the two below).
        ghost_entries: departures the admission model remembers.
        max_records: blocks its models remember.
        unit: a key's sampling unit for the admission shadow (the history's branch).
    """
    rule = Admission(mode, **{"ghost_entries": ghost_entries, "max_records": max_records, **settings})
    rule.unit = unit
    return rule


def tier_policy(name: str, settings: Mapping[str, object], overrides: Mapping[str, object] | None = None, *,
                clock: Clock = time.monotonic, history: History | None = None,
                reuse: ReuseModel | None = None, **hooks: object) -> Policy:
    """One tier's policy.

    Args:
        name: a registered policy.
        settings: the run's settings for ``name``.
        overrides: the tier's own settings, over ``settings`` (those the policy has).
        clock: the policy's clock (the daemon's monotonic clock, the trace's in replay).
        history: the use history the tiers share, where the policy keeps one.
        reuse: a model whose chance of a return weighs each block, where the policy takes one.
        **hooks: passed as they are (``cost_fn``, ``next_use``).
    """
    cls = policy_class(name)
    kwargs: dict[str, object] = dict(settings)
    kwargs.update({k: v for k, v in (overrides or {}).items() if k in cls.SETTINGS})
    if history is not None and "history" in cls.HOOKS:
        kwargs["history"] = history
    if reuse is not None and "reuse" in cls.HOOKS:
        kwargs["reuse"] = reuse.predictor(clock)
    return make_policy(name, clock=clock, **kwargs, **hooks)


def host_policy(name: str, settings: Mapping[str, object], overrides: Mapping[str, object] | None = None, *,
                clock: Clock = time.monotonic, history: History | None = None,
                reuse: ReuseModel | None = None, **hooks: object) -> Policy:
    """The host tier's policy, weighted by the host's reuse model (:func:`host_reuse`); arguments as
    :func:`tier_policy`."""
    return tier_policy(name, settings, overrides, clock=clock, history=history, reuse=reuse, **hooks)


def colder_policy(name: str, settings: Mapping[str, object], overrides: Mapping[str, object] | None = None, *,
                  evict_model: ReuseModel, mode: str, clock: Clock = time.monotonic,
                  history: History | None = None, **hooks: object) -> Policy:
    """The colder tier's policy: weighted by the admission rule's eviction model
    (:attr:`Admission.evict_model <tierkv.cache.admission.Admission.evict_model>`) under ``predicted``
    admission (``mode``), with its LRU shadow fed by the tier's references (the blocks a request uses
    that the faster tier does not hold); other arguments as :func:`tier_policy`."""
    policy = tier_policy(name, settings, overrides, clock=clock, history=history,
                         reuse=evict_model if mode == "predicted" else None, **hooks)
    policy.shadow_on_requests = True  # read by the policies with a recency shadow only
    return policy
