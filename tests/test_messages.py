"""Every fix an error message suggests works when followed: parse the advice of each message
("use A or B"), apply each suggestion alone to the same command line, and the check passes."""
import re

import pytest

import parallel_3d
import pipeline_dp_joint
import pipeline_microbatch
import tensor_parallel
from mp.cli import PARSERS

MLP = ["--data", "synthetic", "--model", "mlp"]
CASES = [  # program, world size, command line that fails
    (pipeline_microbatch, 9, ["--data", "synthetic"]),                                     # cnn: 5 blocks
    (pipeline_microbatch, 6, MLP + ["--layers", "4"]),
    (pipeline_microbatch, 4, ["--data", "synthetic", "--schedule", "interleaved", "--microbatches", "4"]),
    (pipeline_microbatch, 3, MLP + ["--layers", "8", "--schedule", "interleaved", "--virtual-stages", "3",
                                    "--microbatches", "6", "--batch-size", "24"]),
    (pipeline_microbatch, 2, MLP + ["--microbatches", "5", "--batch-size", "24"]),
    (pipeline_microbatch, 2, ["--data", "synthetic", "--balance", "2,2"]),                  # 4 of the cnn's 5
    (pipeline_microbatch, 4, MLP + ["--layers", "8", "--schedule", "interleaved", "--microbatches", "6",
                                    "--batch-size", "24"]),
    (pipeline_microbatch, 2, MLP + ["--layers", "8", "--schedule", "zbv", "--virtual-stages", "3",
                                    "--batch-size", "24"]),
    (pipeline_dp_joint, 6, ["--data", "synthetic", "--schedule", "interleaved"]),        # the launcher's default
    (pipeline_dp_joint, 4, MLP + ["--dp", "3"]),
    (tensor_parallel, 3, ["--data", "synthetic", "--model", "vit", "--hidden", "96"]),   # --heads 4
    (tensor_parallel, 3, ["--data", "synthetic", "--model", "vit"]),                     # --hidden 128
    (tensor_parallel, 8, ["--data", "synthetic"]),                                       # cnn conv1: 6 channels
    (parallel_3d, 6, MLP + ["--dp", "2", "--tp", "2"]),                                  # 6 ranks, groups of 4
    (parallel_3d, 16, ["--data", "synthetic", "--dp", "1", "--tp", "8"]),                # cnn conv1 at --tp 8
    (parallel_3d, 4, ["--data", "synthetic", "--model", "vit", "--hidden", "96", "--heads", "3", "--dp", "1",
                      "--tp", "2"]),
    (parallel_3d, 12, MLP + ["--layers", "2", "--dp", "1", "--tp", "2"]),                # 6 stages, 2 blocks
]


def error_of(program, world, argv, monkeypatch, capsys):
    """The `error:` line of parse_args at this world size, or None if the command line is fine."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    try:
        program.parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return capsys.readouterr().err.strip()
    return None


def follow(fix, world, argv):
    """(world, argv) after one suggestion: `N ranks (...)`, or flags with their values."""
    ranks = re.fullmatch(r"(at most )?(\d+) ranks \(torchrun --nproc-per-node \d+.*\)", fix)
    if ranks:
        return int(ranks.group(2)), argv
    with_ranks = re.fullmatch(r"(at most )?(--.*) with (\d+) ranks \(torchrun --nproc-per-node \d+\)", fix)
    if with_ranks:                        # flags and the world size they need
        world, fix = int(with_ranks.group(3)), with_ranks.group(2)
    argv = list(argv)
    if "(without --virtual-stages)" in fix:
        i = argv.index("--virtual-stages") if "--virtual-stages" in argv else None
        argv = argv if i is None else argv[:i] + argv[i + 2:]
        fix = fix.replace("(without --virtual-stages)", "")
    tokens = fix.split()
    assert tokens and tokens[0].startswith("--") and len(tokens) % 2 == 0, f"not a followable fix: {fix!r}"
    for flag, value in zip(tokens[::2], tokens[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return world, argv


@pytest.mark.parametrize("program,world,argv", CASES)
def test_every_suggested_fix_works(program, world, argv, monkeypatch, capsys):
    error = error_of(program, world, argv, monkeypatch, capsys)
    assert error and error.startswith("error: ") and re.search(r"[;:] use ", error), error
    fixes = re.split(r",? or ", re.split(r"[;:] use ", error)[-1])
    assert fixes, error
    for fix in fixes:
        new_world, new_argv = follow(fix, world, argv)
        assert error_of(program, new_world, new_argv, monkeypatch, capsys) is None, \
            f"{error}\n  followed {fix!r}: {new_argv} at world size {new_world} still fails"


def test_expert_parallel_lists_and_blames_only_what_it_takes(monkeypatch, capsys):
    """Issue 67, item 4: --help listed --zero and --zero3-gather, which the program refuses (with "no
    data-parallel axis", though its experts ride on the data-parallel ranks); --model cnn blamed
    "--experts 4", a default the user never typed."""
    import expert_parallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        expert_parallel.parse_args(["--help"])
    assert "--zero" not in capsys.readouterr().out
    assert error_of(expert_parallel, 2, ["--model", "cnn"], monkeypatch, capsys) == (
        "error: expert_parallel.py trains the vit or the gpt, whose feed-forward blocks become the experts, and "
        "--model cnn has none: drop --model, or use --model vit or gpt")
    for flags in (["--zero", "1"], ["--zero3-gather", "step"]):
        error = error_of(expert_parallel, 2, flags, monkeypatch, capsys)
        assert error.startswith(f"error: {' '.join(flags)}: expert_parallel.py keeps its optimizer state whole") \
            and "data-parallel axis" not in error, error


ONE_RANK = {"pipeline_dp_joint": ["--dp", "1"], "parallel_3d": ["--dp", "1", "--tp", "1"]}   # layouts of one rank


@pytest.mark.parametrize("program", sorted(PARSERS))
def test_a_mistyped_flag_names_the_flag_it_is_close_to_and_that_one_parses(program, monkeypatch, capsys):
    """Issue 85, item 2a: `--hiden 64` says "did you mean --hidden?" in every program, and the flag it
    names is taken (at one rank)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--data", "synthetic", "--model", "vit", "--steps", "3"] + ONE_RANK.get(program, [])
    with pytest.raises(SystemExit) as exit_:
        PARSERS[program](argv + ["--hiden", "64", "--step", "2"], None)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == ("error: unrecognized arguments: --hiden 64 --step 2: did you mean --hidden "
                                             "and --steps? (see --help)\n"), err
    assert PARSERS[program](argv + ["--hidden", "64", "--steps", "2"], None).hidden == 64
