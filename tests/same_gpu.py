"""Runs one program (its path, then its arguments) as one of several nccl ranks that share cuda:0.
torchrun gives each rank its own LOCAL_RANK, which the programs take for their GPU's index; a lent
machine has one GPU, which NCCL 2.30 and later lets several ranks share (NCCL_MULTI_RANK_GPU_ENABLE=1,
experimental). Used by tests/test_on_device.py."""
import os
import runpy
import sys

os.environ["LOCAL_RANK"] = "0"
program = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(program))
runpy.run_path(program, run_name="__main__")
