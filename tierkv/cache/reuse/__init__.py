"""What the decisions remember about blocks: the use history the policies share
(:mod:`~tierkv.cache.reuse.history`) and the reuse model that learns which blocks come back once they
leave a tier (:mod:`~tierkv.cache.reuse.model`)."""

from tierkv.cache.reuse.history import History, Record
from tierkv.cache.reuse.model import ReuseModel

__all__ = ["History", "Record", "ReuseModel"]
