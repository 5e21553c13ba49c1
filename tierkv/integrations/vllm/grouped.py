"""The worker side over a model's KV cache groups: one :class:`~.transfer.Transfers` per group (its own
connections, vLLM pages and committer), steps split by group, and what vLLM sees joined again.

A model with one full-attention group keeps the per-block contract: loads inside the step, a block
that does not arrive is reported by its id. With several groups, or a sliding window, vLLM cannot take
block ids back (they are per group, and a window's earlier blocks are null), so every load runs beside
the step and succeeds or fails per request: a request any of whose blocks did not arrive, in any group,
is reported failed and vLLM recomputes it. A store takes slots for every group before it commits any:
a position is stored for all groups or for none.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.integrations.vllm.asyncload import Outcome
from tierkv.integrations.vllm.blockio import BlockIO
from tierkv.integrations.vllm.transfer import Counters, Staged, Transfers

__all__ = ["GroupTransfers"]


def _by_group(ios: Sequence[BlockIO], n: int) -> list[list[BlockIO]]:
    out: list[list[BlockIO]] = [[] for _ in range(n)]
    for io in ios:
        out[io.group].append(io)
    return out


class GroupTransfers:
    """Loads and stores of one vLLM worker, over every KV cache group.

    Args:
        parts: one :class:`Transfers` per group, in vLLM's order (each with an asynchronous link when
            ``whole_requests``).
        whole_requests: loads are asynchronous and fail per request (several groups, or a sliding window).
    """

    def __init__(self, parts: Sequence[Transfers], whole_requests: bool) -> None:
        if not parts:
            raise ValueError("no KV cache groups")
        if whole_requests and any(p.asyncs is None for p in parts):
            raise ValueError("per-request loads need an asynchronous link in every group")
        self.parts = list(parts)
        self.whole_requests = whole_requests
        self._expect: dict[str, int] = {}            # request -> loads out (one per group)
        self._arrived: dict[str, list[Outcome]] = {}
        self._failed: set[str] = set()
        self._counters = Counters()

    def load(self, loads: Sequence[BlockIO]) -> None:
        """Loads inside the step (one full-attention group only: the planner sends no others)."""
        for part, ios in zip(self.parts, _by_group(loads, len(self.parts))):
            part.load(ios)

    def start_async(self, loads: Sequence[BlockIO]) -> None:
        """Start the loads that run beside the forward pass."""
        for io in loads:
            self._expect[io.req_id] = self._expect.get(io.req_id, 0) + 1
        for part, ios in zip(self.parts, _by_group(loads, len(self.parts))):
            part.start_async(ios)

    def store(self, stores: Sequence[BlockIO]) -> None:
        """Stage every group's blocks; commit them all, or give them all back when one group got no slots."""
        staged: list[tuple[Transfers, Staged | None]] = []
        for part, ios in zip(self.parts, _by_group(stores, len(self.parts))):
            if ios:
                staged.append((part, part.stage(ios)))
        if any(s is None for _, s in staged):
            for part, s in staged:
                if s is not None:
                    part.abort(s)
            return
        for part, s in staged:
            assert s is not None
            part.commit(s)

    def take_done(self) -> set[str]:
        """Requests whose loads finished in every group since the last call (failed ones included: see
        :meth:`take_failed`, which vLLM must see in the same step)."""
        if not self.whole_requests:
            self._expect.clear()
            done: set[str] = set()
            for part in self.parts:
                done |= part.take_done()
            return done
        for part in self.parts:
            for o in part.take_outcomes():
                self._arrived.setdefault(o.io.req_id, []).append(o)
        done = set()
        for req, outs in list(self._arrived.items()):
            if len(outs) < self._expect.get(req, 1):
                continue
            del self._arrived[req]
            self._expect.pop(req, None)
            done.add(req)
            self._count(req, outs)
        return done

    def _count(self, req: str, outs: list[Outcome]) -> None:
        c, scratch = self._counters, Counters()
        served = [self.parts[o.io.group].count_load(scratch, o.io, o.arrived) for o in outs]
        c.load_bytes += scratch.load_bytes
        c.async_loads += 1
        c.async_wait_s += max(o.seconds for o in outs)
        if all(o.arrived == len(o.io.block_ids) for o in outs):
            c.window_saved_bytes += scratch.window_saved_bytes
            c.hit_tokens += min(served)
            c.async_hit_tokens += min(served)
        else:
            self._failed.add(req)
            c.load_errors += sum(len(o.io.block_ids) for o in outs)

    def take_failed(self) -> set[str]:
        """Requests reported done whose loads did not all arrive: vLLM recomputes them whole."""
        failed, self._failed = self._failed, set()
        return failed

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed (one full-attention group only)."""
        errors: set[int] = set()
        for part in self.parts:
            errors |= part.take_load_errors()
        return errors

    def take_counters(self) -> Counters:
        """The counters since the last call: tokens once per request, blocks and bytes of every group."""
        out, self._counters = self._counters, Counters()
        for g, part in enumerate(self.parts):
            c = part.take_counters()
            if g:  # the same tokens and steps as the first group's
                c.stored_tokens, c.store_steps = 0, 0
            out.add(c.as_dict())
        return out

    def connect(self) -> None:
        """Connect every link now (each maps the daemon's pools once): no step pays for a connection
        (an absent daemon is tried again at the first step, as always)."""
        for part in self.parts:
            links = [part.link] + ([part.asyncs.link] if part.asyncs is not None else []) + \
                ([part.committer.link] if part.committer is not None else [])
            for link in links:
                link.get()

    def close(self) -> None:
        """Flush the committers and close every connection."""
        for part in self.parts:
            part.link.close()
            if part.asyncs is not None:
                part.asyncs.link.close()
            if part.committer is not None:
                part.committer.flush(5.0)
                part.committer.close()
                part.committer.link.close()
