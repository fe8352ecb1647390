"""Memory that a step lets go of and makes again, kept by the C library's allocator between steps (CPU).

glibc (Linux) serves a large request with a mapping of its own (mmap), given back whole when freed, and a
smaller one from its heap. It gives the free memory at the heap's top back to the kernel once that passes
twice the "mmap threshold". The threshold starts at 128 KB and rises to the size of the largest mapped
block freed so far, up to 32 MB (mallopt(3): M_MMAP_THRESHOLD, dynamic). Memory given back is faulted in
again when the next step asks for it, a page (4 KB) at a time, each zeroed by the kernel.

Our data-parallel buckets let their memory go at every zero_grad, as torch's set_to_none lets .grad go
(mp.buckets: the forward, the vit's peak, runs without them), and make it again in the backward. With the
threshold at one bucket's size, glibc gave that memory back in most steps, together with the activations
freed beside it at the heap's top. A rank of the vit at D = 4, alone on a core, then took about 2,900
page faults a step (brk shrank and grew the heap 5 times a step); DistributedDataParallel almost none. DDP's
set-up happens to free a block of the whole model's size (its broadcast of the weights), which lifts the
threshold above what its steps let go.

keep_in_heap does the same on purpose, at set-up: one mapped block, freed at once and never written (no
page is touched, so it costs nothing but the mapping). Its size is twice the bytes a step lets go: once
their size, one run in four still gave them back. The steps then reuse the heap's pages, as DDP's do.
Where the thresholds are fixed, glibc does not adjust them and this changes nothing: the memory
benchmarks fix them (MALLOC_MMAP_THRESHOLD_) so that memory freed is memory given back. On a GPU, torch's
caching allocator keeps the memory itself.
"""
import torch

GLIBC_MAX = 32 * 2**20 - 2**16   # the threshold rises to at most 32 MB: a block a little under that


def keep_in_heap(nbytes, device):
    """Lift glibc's mmap threshold above 2 x nbytes (at most GLIBC_MAX): one block of that size, made and freed."""
    if device.type == "cpu" and nbytes > 0:
        torch.empty(int(min(2 * nbytes, GLIBC_MAX)), dtype=torch.uint8)
