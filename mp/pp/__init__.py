"""Pipeline parallelism beyond the lesson (pipeline_microbatch.py): schedules, zb, 2bw, balance, timeline."""
