"""activation_mb: the bytes autograd saves for the backward in one step, measured, not estimated.

torch.autograd.graph.saved_tensors_hooks calls pack(t) for every tensor an operation saves for its
backward (a custom autograd.Function's save_for_backward included). SavedActivations adds up the
storages behind them once each (a view saves its base's storage; two ops saving one tensor count it
once), leaving out the parameters (weights a layer saves are held anyway: param_mb). The summary's
activation_mb is the largest step's total, per rank (mp.loop reads model.saved_activations)."""
from contextlib import contextmanager

import torch


class SavedActivations:
    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.peak_bytes = 0

    @contextmanager
    def counting(self):
        """Count what the forward inside saves for the backward; the step's total updates the peak."""
        seen, total = set(), [0]

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total[0] += storage.nbytes()
            return t   # the tensor itself: counting changes nothing that is saved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_bytes = max(self.peak_bytes, total[0])

    def mb(self):
        return self.peak_bytes / 2**20
