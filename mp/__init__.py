"""The package under the five programs: plumbing they share once, and the techniques a lesson may skip.

    errors dist flags models data optim log   the run: one error line, the process group and its bounded
                                              waits, the shared flags, the three models, the data, the log
    mesh                                      the ranks on named axes and every process group, made once
    loop check checkpoint                     the one training loop (a program hands it its step), the one
                                              --check, checkpoints in the baseline's coordinates
    dropout clipping                          keyed dropout masks, the global gradient norm
    moe                                       --experts: the vit's feed-forward blocks as a mixture of experts
    pp/                                       pipeline schedules as data, zero-bubble, PipeDream-2BW, balance,
                                              timeline, the pipelines' step and evaluation
    tp/                                       tensor-parallel collectives, the operators beyond f and g,
                                              replicated parameters, sequence parallelism, --hybrid
    ep/                                       expert parallelism's flags (no torch), evaluation and byte count
    tools/                                    python -m mp.tools.plot_curves, python -m mp.tools.schedule; the
                                              launchers' knobs check and torchrun (mp.tools.knobs, .torchrun)

The package never imports a program; docs/map.md says where each step of each program goes.
"""
