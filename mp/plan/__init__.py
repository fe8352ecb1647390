"""The layout planner behind python -m mp.tools.plan: what a 5-D layout costs before anything is launched.

    model     the models' parameters block by block (this project's four, and the field's presets), their
              FLOPs per token (6N + attention), without torch
    project   the exact counts of this project's programs: each rank's parameters, gradients and optimizer
              state, and the bytes each group sends a step, as the summary record counts them
    cluster   the GPUs (peak TFLOP/s, memory, links inside and between nodes), named or given
    predict   the analytic model at any scale: memory per rank at the schedule's peak, bytes per group,
              compute, bubble and communication time, step time, TFLOP/s per GPU and MFU
    search    every legal layout of a model on a cluster that fits, ranked by predicted step time

docs/planning.md teaches how to read it and shows the predictions beside this project's runs and the
published ones. Nothing here imports torch: a plan runs on a laptop.
"""
