"""On one CUDA device with nccl (skipped where there is none, as in CI): every program at world size 1
logs the losses of the baseline run on the same device, its --check passes, and the logs say what
ran where. Where the NCCL loaded is 2.30 or later and NCCL_MULTI_RANK_GPU_ENABLE=1, two nccl ranks also
share the one GPU (experimental in NCCL): every pipeline schedule, tensor, data (ZeRO 1, 2 and 3), 3-D,
context (ring, Ulysses), expert parallelism (capacity, top-2) and the 5-D program (cp, ep) at world size 2
against the same baseline.
No step waits for the device beyond what it declares: none, or a mixture of experts' one read a block a
forward (mp.moe.rows_per_expert, the all-to-all's splits)."""
import json

import pytest
import torch

from helpers import FAST, assert_same_losses, launch
from mp.dist import SHARE_SWITCH, loaded_nccl_version

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU = FAST + ["--backend", "nccl", "--steps", "20"]
PROGRAMS = [("pipeline_microbatch.py", ["--schedule", "gpipe"]), ("pipeline_microbatch.py", ["--schedule", "1f1b"]),
            ("pipeline_microbatch.py", ["--schedule", "zb"]), ("pipeline_microbatch.py", ["--recompute"]),
            ("parallel_3d.py", ["--dp", "1", "--tp", "1", "--batch-size", "64", "--microbatches", "4"]),
            ("pipeline_dp_joint.py", ["--dp", "1", "--batch-size", "64", "--microbatches", "4"]),
            ("tensor_parallel.py", []), ("tensor_parallel.py", ["--hybrid"])]


def test_every_program_on_one_gpu_logs_the_baselines_losses(tmp_path):
    base = launch("single_baseline.py", GPU, tmp_path)
    assert base.events("config")[0]["device"].startswith("cuda"), base.records[:1]
    for i, (program, extra) in enumerate(PROGRAMS):
        run = launch(program, GPU + extra, tmp_path, log_name=f"run{i}.jsonl")
        assert_same_losses(run, base)
        summary = run.events("summary")[0]
        assert run.events("config")[0]["backend"] == "nccl", program
        assert summary["peak_memory_kind"].startswith("cuda"), summary


def test_check_passes_on_one_gpu(tmp_path):
    for program, extra in PROGRAMS:
        run = launch(program, GPU + extra + ["--check"], tmp_path)
        assert run.returncode == 0, (program, extra, run.stdout[-2000:], run.stderr[-2000:])


def test_the_timeline_on_one_gpu_uses_the_device_clock(tmp_path):
    trace = tmp_path / "t.json"
    run = launch("pipeline_microbatch.py", GPU + ["--timeline", str(trace)], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    other = json.loads(trace.read_text())["otherData"]
    assert other["device"].startswith("cuda") and other["bubble_theory"] == 0, other


def test_gpu_losses_stay_near_the_cpu_baseline(tmp_path):
    """Different kernels (cuDNN, cuBLAS) round differently: a looser bound than the contract's, which
    compares runs on one kind of device."""
    gpu = launch("single_baseline.py", GPU, tmp_path, log_name="gpu.jsonl")
    cpu = launch("single_baseline.py", FAST + ["--backend", "gloo", "--steps", "20"], tmp_path, log_name="cpu.jsonl")
    assert_same_losses(gpu, cpu, atol=1e-2)


VIT = GPU + ["--model", "vit", "--layers", "4", "--hidden", "64"]
MOE = ["--experts", "4", "--top-k", "2", "--capacity-factor", "1.25"]   # the most a MoE layer computes
VIT_PROGRAMS = [("context_parallel.py", ["--attention", "ring"]), ("context_parallel.py", ["--attention", "ulysses"]),
                ("tensor_parallel.py", ["--sequence-parallel"])]
MOE_PROGRAMS = [("single_baseline.py", MOE, 4), ("expert_parallel.py", MOE, 4),   # 4 blocks, one forward a step
                ("expert_parallel.py", ["--experts", "4", "--top-k", "1"], 4),
                ("parallel_5d.py", MOE + ["--microbatches", "2"], 8)]             # a read a block a microbatch


def test_no_step_makes_the_cpu_wait_for_the_gpu(tmp_path, monkeypatch):
    """Issue 35's promise on the device itself: every program's steps (the second on) run under
    torch.cuda.set_sync_debug_mode("error") (tests/count_reads.py, SYNC_DEBUG=1), so a read or a
    blocking copy inside a step raises; the log's reads every --log-every steps are outside them. A
    mixture of experts' one declared read a block a forward (mp.moe.rows_per_expert) is let through and
    counted: a read a block a microbatch."""
    monkeypatch.setenv("SYNC_DEBUG", "1")
    monkeypatch.setenv("COUNT_DIR", str(tmp_path))
    cases = [(GPU, p, e, 0) for p, e in [("single_baseline.py", [])] + PROGRAMS]
    cases += [(VIT, p, e, 0) for p, e in VIT_PROGRAMS + [("parallel_5d.py", [])]]
    cases += [(VIT, p, e, reads) for p, e, reads in MOE_PROGRAMS]
    for i, (args, program, extra, declared) in enumerate(cases):
        monkeypatch.setenv("COUNT_PROGRAM", program)
        run = launch("tests/count_reads.py", args + extra + ["--log-every", "10"], tmp_path, log_name=f"s{i}.jsonl")
        assert run.returncode == 0, (program, extra, run.stderr[-3000:])
        counts = json.loads((tmp_path / "rank-0.json").read_text())
        assert counts["steps"] == 20 and counts["step_reads"] == counts["declared_reads"] == declared * 20, (
            program, extra, counts)


SHARED = [("pipeline_microbatch.py", ["--schedule", s]) for s in ("gpipe", "1f1b", "interleaved", "zb", "zbv")] + [
    ("tensor_parallel.py", []),
    ("pipeline_dp_joint.py", ["--dp", "2", "--batch-size", "64", "--microbatches", "2"]),
    ("pipeline_dp_joint.py", ["--dp", "2", "--batch-size", "64", "--microbatches", "2", "--zero", "1",
                              "--optimizer", "adamw"]),
    ("pipeline_dp_joint.py", ["--dp", "2", "--batch-size", "64", "--microbatches", "2", "--zero", "2"]),
    ("pipeline_dp_joint.py", ["--dp", "2", "--batch-size", "64", "--microbatches", "2", "--zero", "3"]),
    ("parallel_3d.py", ["--dp", "1", "--tp", "2", "--batch-size", "64", "--microbatches", "2"])]
SHARED_VIT = VIT_PROGRAMS + [("parallel_5d.py", ["--cp", "2"])]
SHARED_MOE = [("expert_parallel.py", []), ("parallel_5d.py", ["--cp", "2", "--ep", "2", "--microbatches", "1"])]


NCCL = loaded_nccl_version()


@pytest.mark.skipif(not torch.cuda.is_available() or NCCL is None or NCCL < (2, 30, 0),
                    reason=f"two nccl ranks on one GPU need NCCL 2.30 or later, loaded: found {NCCL}")
def test_two_nccl_ranks_on_one_gpu_log_the_baselines_losses(tmp_path, monkeypatch):
    """The multi-rank nccl path itself (messages, collectives, buckets, the ring's batches, the stream
    waits of mp.pp.p2p), both ranks on cuda:0 (mp.dist shares the GPU round-robin): each run against
    the GPU baseline. Gated on the NCCL library loaded (mp.dist.loaded_nccl_version), not on the
    version torch was built with (torch.cuda.nccl.version(), a constant of the build)."""
    monkeypatch.setenv(SHARE_SWITCH, "1")
    for model, args, cases in (("cnn", GPU, SHARED), ("vit", VIT, SHARED_VIT), ("moe", VIT + MOE, SHARED_MOE)):
        base = launch("single_baseline.py", args, tmp_path, log_name=f"base-{model}.jsonl", real=True)
        for i, (program, extra) in enumerate(cases):
            run = launch(program, args + extra, tmp_path, nproc=2, log_name=f"shared-{model}{i}.jsonl",
                         timeout=120, real=True)
            assert run.returncode == 0, (program, extra, run.stderr[-3000:])
            assert run.events("config")[0]["backend"] == "nccl", program
            assert "local ranks share 1 GPU" in run.stdout, run.stdout[-2000:]
            print(program, extra, f"largest |loss difference| {assert_same_losses(run, base):.2g}")
