"""The decisions, plain code with no threads and no I/O: the block table, placement, admission, policies, cost model."""
