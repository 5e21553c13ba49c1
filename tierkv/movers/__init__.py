"""The only daemon code that moves bytes or runs codecs: transfer jobs, copy streams, bandwidth budgets."""
