"""Command-line tools, run from the repository root: python -m mp.tools.plot_curves, python -m mp.tools.schedule."""
