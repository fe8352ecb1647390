"""Context parallelism's plumbing: the flags' checks (context_parallel.py holds the lesson)."""
