"""The analytic model at any scale: a layout's memory per rank, bytes per group, and step time.

Memory (the largest rank: the first stage, which holds the embedding and, under 1F1B, the most microbatches):
    weights, gradients, optimizer state   bytes per parameter (bf16: 2 + 2 + 12 for Adam's fp32 master and two
                                          moments; fp32: 4 + 4 + 8), ZeRO dividing them over dp x cp
    activations                           Korthikanti et al. 2022: s b h (34 + 5 a s / h) bytes a layer and
                                          microbatch, /tp with sequence parallelism, s/cp under cp; selective
                                          recompute keeps s b h 34/t, full keeps the layer's input (2 s b h)
    held microbatches                     GPipe m, 1F1B p on stage 0, interleaved p (1 + (p-1)/(p v)), zb p
Time, one step:
    compute      hardware FLOPs (6N + attention, + a forward again under recompute) / (peak x EFFICIENCY)
    bubble       (p - 1) / v microbatch-times (zb: a third of it, zbv: none)
    tp           4 all-reduces of [b, s, h] a layer a microbatch (6 under full recompute), not overlapped
    cp           the ring's K/V blocks, hidden behind attention where it is longer
    ep           4 all-to-alls of the routed tokens a MoE layer a microbatch
    pp           each microbatch's activation and gradient across a cut
    dp           the gradient reduce-scatter/all-reduce once a step after the flush (not overlapped)
Each group's bytes go at its link's bandwidth: inside a node when its ranks fit one (the mesh numbers tp
innermost, then cp, pp, dp: mp/mesh.py), else at the network's.
"""
from dataclasses import dataclass, asdict

from mp.plan.model import layer_params, matmul_flops_per_token

EFFICIENCY = 0.54   # what a transformer's GEMMs reach of the datasheet peak: calibrated ONCE, docs/planning.md


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatch: int = 1           # sequences in one microbatch
    global_batch: int = 512       # sequences in one optimizer step
    recompute: str = "none"       # none, selective, full
    sequence_parallel: bool = True
    dtype: str = "bf16"
    flash_attention: bool = True

    @property
    def world(self):
        return self.dp * self.tp * self.pp * self.cp

    @property
    def microbatches(self):
        return self.global_batch // (self.dp * self.microbatch)


def params_per_rank(m, lay):
    """(first stage's parameters on one rank, of which experts' share): the layers of a stage over tp (experts over
    ep, whole), the vocabulary-parallel embedding on the first stage (and an untied output layer on the last)."""
    active, total = layer_params(m)
    h, f = m.hidden, m.ffn_width
    per_expert = (3 if m.gated else 2) * h * f
    experts = m.experts * per_expert if m.experts else 0
    dense = total - experts
    layers = -(-m.layers // lay.pp)
    embed = m.vocab * h + (0 if m.kind == "gpt" and m.name.startswith(("Llama", "Mixtral")) else m.tokens * h)
    per_rank = layers * (dense / lay.tp + experts / lay.ep) + embed / lay.tp
    return per_rank, layers * experts / lay.ep


def memory(m, lay, c):
    """{part: bytes} of the largest rank, and the total."""
    n, n_expert = params_per_rank(m, lay)
    shards = lay.dp * lay.cp
    w, g, o = (2, 2, 12) if lay.dtype == "bf16" else (4, 4, 8)
    dense = n - n_expert
    expert_shards = max(shards * lay.tp // lay.ep, 1)
    def split(x, level):   # ZeRO at this level or above divides it over the ranks holding the same weights
        on = lay.zero >= level
        return dense * x / (shards if on else 1) + n_expert * x / (expert_shards if on else 1)
    parts = {"weights": split(w, 3), "gradients": split(g, 2), "optimizer": split(o, 1)}
    s, b, h, a, t = m.tokens // lay.cp, lay.microbatch, m.hidden, m.heads, lay.tp
    bytes_ = 2 if lay.dtype == "bf16" else 4
    # flash attention (every fused kernel since 2022) keeps no [a, s, s] scores: the 5 a s / h term goes
    scores = 0 if lay.flash_attention else 5 * a * s / h
    per_layer = s * b * h * (34 + scores) * bytes_ / 2 / (t if lay.sequence_parallel else 1)
    if lay.recompute == "selective":
        per_layer = s * b * h * 34 * bytes_ / 2 / t
    elif lay.recompute == "full":
        per_layer = 2 * s * b * h * bytes_ / 2 / (t if lay.sequence_parallel else 1)
    p, v, mb = lay.pp, lay.virtual_stages, lay.microbatches
    held = {"gpipe": mb, "interleaved": p * (1 + (p - 1) / (p * v))}.get(lay.schedule, min(p, mb))
    parts["activations"] = per_layer * (-(-m.layers // p)) * held
    parts["buffers"] = 4 * s * b * m.vocab / t if m.kind == "gpt" else 0   # fp32 logits of the last stage
    return parts, sum(parts.values())


def link(c, span):
    """GB/s of a group whose ranks sit `span` apart at most in the numbering (inside a node or not)."""
    return c.intra_gbps if span <= c.gpus_per_node else c.inter_gbps


def step_time(m, lay, c):
    """{part: seconds} of one step, and the step time."""
    tokens = lay.global_batch * m.tokens
    model_flops = matmul_flops_per_token(m) * tokens
    extra = {"none": 0, "selective": 12 * m.tokens * m.hidden * m.layers * tokens / 3 / 3,
             "full": model_flops / 3}[lay.recompute]
    hw_flops = model_flops + extra
    peak = c.peak_tflops * 1e12 * (1 if lay.dtype == "bf16" else 0.5)
    compute = hw_flops / lay.world / (peak * EFFICIENCY)
    mb, p, v = lay.microbatches, lay.pp, lay.virtual_stages
    per_mb = compute / mb
    layers = -(-m.layers // p)
    s, b, h, bytes_ = m.tokens // lay.cp, lay.microbatch, m.hidden, 2 if lay.dtype == "bf16" else 4
    act = s * b * h * bytes_
    t, cpn = lay.tp, lay.cp
    calls = 6 if lay.recompute == "full" else 4
    tp_bytes = layers * calls * 2 * (t - 1) / t * act
    tp_s = tp_bytes / (link(c, t) * 1e9)
    kv = 2 * s * b * m.kv * (h // m.heads) * bytes_
    cp_bytes = layers * 3 * (cpn - 1) * kv / t
    attention_s = per_mb * (12 * m.tokens * h / 2) / (matmul_flops_per_token(m) / m.layers) / 3
    cp_s = max(0.0, cp_bytes / (link(c, t * cpn) * 1e9) - attention_s * layers)
    ep_bytes = layers * 4 * s * b * m.top_k * h * bytes_ * (lay.ep - 1) / lay.ep if m.experts else 0
    ep_s = ep_bytes / (link(c, lay.ep) * 1e9)
    pp_bytes = 2 * act / (t if lay.sequence_parallel else 1) * v if p > 1 else 0
    pp_s = pp_bytes / (link(c, t * cpn * p) * 1e9)
    n, _ = params_per_rank(m, lay)
    shards = lay.dp * lay.cp
    halves = 3 if lay.zero == 3 else 2   # ZeRO-3 gathers the weights for the backward again (FSDP's 1.5x)
    dp_bytes = halves * (shards - 1) / shards * n * bytes_
    dp_s = dp_bytes / (link(c, lay.world) * 1e9)
    bubble = {"zb": (p - 1) / 3, "zbv": 0.0}.get(lay.schedule, (p - 1) / v)
    mb_time = per_mb + tp_s + cp_s + ep_s + pp_s
    parts = {"compute": per_mb * mb, "bubble": bubble * mb_time, "tp": tp_s * mb, "cp": cp_s * mb, "ep": ep_s * mb,
             "pp": pp_s * mb, "dp": dp_s}
    bytes_per_step = {"tp": tp_bytes * mb, "cp": cp_bytes * mb, "ep": ep_bytes * mb, "pp": pp_bytes * mb,
                      "dp": dp_bytes}
    return parts, sum(parts.values()), model_flops, hw_flops, bytes_per_step


def plan(m, lay, c):
    """The planner's whole answer for one layout, --json's object."""
    parts, total_mem = memory(m, lay, c)
    times, step, model_flops, hw_flops, sent = step_time(m, lay, c)
    peak = c.peak_tflops * (1 if lay.dtype == "bf16" else 0.5)
    model_tflops = model_flops / step / lay.world / 1e12
    return {"model": m.name or m.kind, "layout": asdict(lay), "gpus": lay.world, "step_s": step,
            "tokens_per_s_per_gpu": lay.global_batch * m.tokens / step / lay.world,
            "model_tflops_per_gpu": model_tflops, "hardware_tflops_per_gpu": hw_flops / step / lay.world / 1e12,
            "mfu": model_tflops / peak, "memory_gb": total_mem / 1e9,
            "memory_parts_gb": {k: v / 1e9 for k, v in parts.items()}, "fits": total_mem <= c.memory_gb * 1e9,
            "time_parts_s": times, "bytes_per_step": {k: v for k, v in sent.items() if v}}
