"""The GPUs a plan runs on: peak dense bf16 TFLOP/s, memory, and the bandwidth a rank's collectives get inside
a node (NVLink) and between nodes (its share of the network). Datasheet numbers; what a run reaches of them
is the planner's one calibrated factor (mp.plan.predict.EFFICIENCY), stated in docs/planning.md."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    peak_tflops: float = 989.0     # dense bf16 (fp32 runs: the same cores' tf32 peak is half of it, set by --dtype)
    memory_gb: float = 80.0
    intra_gbps: float = 450.0      # GB/s one GPU sends inside a node (NVLink, one direction)
    inter_gbps: float = 50.0       # GB/s one GPU sends to other nodes (its NIC: 400 Gb/s InfiniBand)
    name: str = "h100"


GPUS = {   # NVIDIA datasheets: A100 SXM 80GB (NVLink 3: 300 GB/s a direction, HDR 200 Gb/s a GPU: 25 GB/s);
    # H100 SXM (NVLink 4: 450 GB/s, NDR 400 Gb/s: 50 GB/s); H200 (141 GB); the Llama 3 paper's H100s ran at 700 W
    "a100": dict(peak_tflops=312.0, memory_gb=80.0, intra_gbps=300.0, inter_gbps=25.0),
    "h100": dict(peak_tflops=989.0, memory_gb=80.0, intra_gbps=450.0, inter_gbps=50.0),
    "h200": dict(peak_tflops=989.0, memory_gb=141.0, intra_gbps=450.0, inter_gbps=50.0),
}


def cluster(gpus, gpu="h100", gpus_per_node=8, **given):
    """A cluster of `gpus` named GPUs, any datasheet number replaced by one given (None: the GPU's)."""
    spec = dict(GPUS[gpu], **{k: v for k, v in given.items() if v is not None})
    return Cluster(gpus, gpus_per_node, name=gpu, **spec)
