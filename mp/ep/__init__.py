"""Expert parallelism's plumbing: its flags (no torch) and the evaluation over the ranks' slices."""
