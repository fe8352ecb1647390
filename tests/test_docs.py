"""The docs' commands run as shown: the error lines docs/robustness.md shows are what the programs
print for the commands beside them, and every command in a ```bash block of the README and the docs
runs (argument checks only where it would train)."""
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import FAST, PYTHON, ROOT
from mp.tools.check_args import visible_gpus


def examples():
    text = open(os.path.join(ROOT, "docs", "robustness.md")).read()
    pairs = re.findall(r"^\$ (.+)\n(error: .+)$", text, re.M)
    assert len(pairs) >= 6, pairs
    return [(cmd.split("#")[0].strip(), line) for cmd, line in pairs if "..." not in line]


@pytest.mark.parametrize("command,line", examples())
def test_each_example_prints_its_error_line(command, line):
    words = shlex.split(command)
    world = 1
    if words[:3] == ["python", "-m", "mp.tools.torchrun"]:
        words = words[2:]                                  # the repo's torchrun, as the docs launch it
    if words[0] in ("torchrun", "mp.tools.torchrun"):
        world = int(words[words.index("--nproc-per-node") + 1])
        words = words[words.index("--") + 1:]
    else:
        words = words[1:]                                  # python
    program, args = words[0][:-len(".py")], words[1:]
    env = dict(os.environ, WORLD_SIZE=str(world))
    if world == 1:
        env.pop("WORLD_SIZE")
    run = subprocess.run([PYTHON, "-c", f"import sys, {program} as p; p.parse_args(sys.argv[1:])", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.splitlines() == [line], run.stderr


# ----------------------------------------------------------------------------- every command shown
# Issue 47: every command the README and the docs show in a ```bash block runs as shown. Each kind is
# run as far as it can be without training: a launcher with CHECK_ONLY=1 (its knobs and every run's
# arguments), a program's flags through mp.tools.check_args at the world size the command launches,
# the tools for real on small stand-in logs, a benchmark's parser; what needs a cluster or installs
# something is named with the test that covers it, and a command of no known kind fails the test.

DOCS = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                              if name.endswith(".md"))
PROGRAMS = ("single_baseline", "pipeline_microbatch", "pipeline_dp_joint", "tensor_parallel", "parallel_3d",
            "context_parallel", "expert_parallel", "parallel_5d")
NOT_RUN = {   # a command's first word -> why this test leaves it out, and what runs it instead
    "python3": "the install line: .ci/run runs it in a fresh clone", "pip": "an install", "mkdir": "makes a folder",
    "source": "sets up the shell", "cd": "sets up the shell", "export": "sets up the shell",
    "exit": "leaves an allocation", "sleep": "waits", "tail": "reads a Slurm job's output",
    **dict.fromkeys(("apt-get", "munged", "slurmctld", "unshare", "chmod", "scontrol", "sbatch", "salloc", "squeue", "scancel", "sinfo",
                     "head", "D", "HEAD", "NODE", "NODE_RANK"),
                    "the two-node Slurm cluster of docs/slurm.md: tests/test_slurm.py brings one up and runs it"),
}


# what the launchers name their logs and timelines (mp/tools/launch_checks.sh: the program, the model, every
# setting off its default, the layout, the batch size)
LAUNCHER_NAME = re.compile(r"logs/(single_baseline|pipeline|pipeline_dp_joint|tensor_parallel|parallel_3d|timeline)"
                           r"_(cnn|mlp|vit)[A-Za-z0-9._=-]*_b\d+[A-Za-z0-9._=-]*\.jsonl?")


def shown_commands():
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if line.strip().startswith("#"):   # a comment, #!/bin/bash, #SBATCH
                    continue
                line = re.split(r"\s#\s", line.strip())[0]
                for command in [line] if line.startswith("for ") else and_list(line):
                    if command.strip():
                        yield doc, command.strip()


def and_list(line):
    """`a && b` as [a, b], leaving a quoted && alone (sh -c "x && y")."""
    parts, quote, start = [], None, 0
    for i, ch in enumerate(line):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif quote is None and line.startswith(" && ", i):
            parts.append(line[start:i])
            start = i + 4
    return parts + [line[start:]]


def plan(command):
    """(kind, details) for one shown command: what this test runs for it."""
    loop = re.fullmatch(r"for (\w+) in ([^;]+); do (.+?)(?: \|\| break)?; done", command)
    if loop:   # `for run in a b; do X=1 bash $run.sh || break; done`: each body, expanded
        name, values, body = loop.groups()
        return "each", [body.replace("$" + name, value) for value in values.split()]
    assigned = re.match(r"([A-Z_][A-Z0-9_]*)=\$\(", command)
    if assigned:   # VAR=$(...): a step of the Slurm recipes
        return "not run", NOT_RUN.get(assigned.group(1))
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or (env and words[0] in ("&&", "|")):   # a variable set for the Slurm recipe's later lines
        return "not run", NOT_RUN.get(next(iter(env)), None)
    first = words[0].split("=")[0]
    if first == "srun":   # srun [its options] then the torchrun line each node runs, or a shell on a node
        starts = [i for i, w in enumerate(words) if w.startswith("python")]
        if not starts:
            return "not run", NOT_RUN["sbatch"]
        words = words[starts[0]:]
    if words[:2] == ["bash", "benchmarks/run.sh"]:
        return "not run", "every benchmark, for minutes: tests/test_benchmarks.py runs each one small"
    if words[0] == "bash" and words[1].startswith("run_"):
        if words[1] == "run_slurm.sh":
            return "not run", NOT_RUN["sbatch"]
        return "launcher", (env, words[1], words[2:])
    if words[0] not in ("python", "torchrun"):
        return "not run", NOT_RUN.get(first)
    if words[1:3] in (["-m", "mp.tools.torchrun"], ["-m", "torch.distributed.run"]) or words[0] == "torchrun":
        script = next(i for i, w in enumerate(words) if w.endswith(".py"))
        options = words[:script]
        count = lambda flag, default: (int(options[options.index(flag) + 1])   # noqa: E731
                                       if flag in options and options[options.index(flag) + 1].isdigit() else default)
        world = count("--nproc-per-node", 1) * count("--nnodes", 2 if "--nnodes" in options else 1)
        words = ["python", words[script]] + words[script + 1:]
    else:
        world = 1
    if words[1:3] == ["-m", "pytest"]:
        return "pytest", words[3:]
    if words[1] == "-m":
        return "tool", (words[2], words[3:])
    name = words[1][:-len(".py")]
    if name in PROGRAMS:
        return "program", (world, name, words[2:])
    if name.startswith("benchmarks/"):
        return "benchmark", (world, name, words[2:])
    return "not run", None


def stand_in_trace():
    events = [{"name": f"{cat}0", "cat": cat, "ph": "X", "ts": 1000 * (i + rank), "dur": 900, "pid": rank, "tid": 0,
               "args": {"microbatch": 0, "chunk": 0}} for rank in range(2) for i, cat in enumerate(["forward", "backward"])]
    return {"traceEvents": events, "otherData": {"schedule": "gpipe", "stages": 2, "microbatches": 1, "virtual_stages": 1,
                                                 "bubble_measured": 0.5, "bubble_theory": 0.5}}


def run_one(kind, details, tmp_path, log_lines):
    """None when the command ran as shown, else what went wrong."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kind == "launcher":
        knobs, script, args = details
        env.update(knobs, CHECK_ONLY="1", PYTHON=PYTHON, LOGS=str(tmp_path / "launcher-logs"))
        run = subprocess.run(["bash", os.path.join(ROOT, script), *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
        said = [line for line in run.stdout.splitlines() if not line.startswith("note: ")]   # ranks over cores
        ok = run.returncode == 0 and bool(said) and said[0].startswith("CHECK_ONLY=1:")
    elif kind == "program":
        world, program, args = details
        run = subprocess.run([sys.executable, "-m", "mp.tools.check_args", str(world), program, *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        # a GPU command on a machine with none (CI): right as shown when its one refusal is the machine's
        no_gpu = "nccl" in args and visible_gpus() == 0 and run.returncode == 2 and \
            run.stderr.startswith("error: --backend nccl runs on GPUs") and len(run.stderr.splitlines()) == 1
        ok = run.returncode == 0 or no_gpu
    elif kind == "tool":
        module, args = details
        inputs = [arg for arg in args if arg.endswith((".jsonl", ".json")) and not arg.startswith("-")]
        unnamed = [arg for arg in inputs if not LAUNCHER_NAME.fullmatch(arg)]
        if unnamed:   # the files the docs tell a user to plot are ones a launcher writes (docs/running.md)
            return f"{unnamed}: not a name a launcher writes under logs/"
        work = tmp_path / "tool"
        for i, arg in enumerate(args):   # the files the command reads, as a launcher would have written them
            if arg.endswith(".jsonl") or (arg.endswith(".json") and "--timeline" in args):
                path = work / arg
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(log_lines if arg.endswith(".jsonl") else json.dumps(stand_in_trace()))
            if args[i - 1] in ("-o", "--out") and i:
                (work / os.path.dirname(arg)).mkdir(parents=True, exist_ok=True)
        work.mkdir(exist_ok=True)
        run = subprocess.run([sys.executable, "-m", module, *args], cwd=str(work), capture_output=True, text=True, timeout=120,
                             env=dict(env, PYTHONPATH=ROOT, MPLBACKEND="Agg"))
        ok = run.returncode == 0
    elif kind == "benchmark":
        world, name, args = details
        env["WORLD_SIZE"] = str(world)
        parse = {"benchmarks/tp_ladder": "tp_ladder.parse_args(sys.argv[1:])",
                 "benchmarks/profile_step": "bench.parse_args(['pipeline'] + sys.argv[1:])"}.get(name)
        if parse is None:
            return f"no parser known for {name}.py: add it to this test"
        probe = f"import sys; sys.path.insert(0, 'benchmarks'); import {parse.split('.')[0]}; {parse}"
        run = subprocess.run([PYTHON, "-c", probe, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        ok = run.returncode == 0
    elif kind == "pytest":
        paths = [arg.split("::")[0] for arg in details if not arg.startswith("-") and "/" in arg or arg == "tests"]
        missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
        return f"no such test file: {missing}" if missing else None
    else:
        return None if details else "a command of no known kind: teach this test how to run it, or why it cannot"
    return None if ok else f"exit {run.returncode}: {(run.stderr or run.stdout).strip()[-600:]}"


@pytest.mark.slow   # some 60 commands, 10-13 s: the quick subset keeps the docs' other checks
def test_every_command_the_readme_and_the_docs_show_runs(tmp_path, baseline):
    log_lines = "".join(json.dumps(r) + "\n" for r in baseline(FAST + ["--steps", "6"]).records)
    todo = []
    for doc, command in shown_commands():
        kind, details = plan(command)
        todo += [(doc, command, *plan(body)) for body in details] if kind == "each" else [(doc, command, kind, details)]
    # each in a folder of its own, four at a time: most of each is a python starting up
    folders = [tmp_path / f"command-{i}" for i in range(len(todo))]
    for folder in folders:
        folder.mkdir()
    with ThreadPoolExecutor(4) as pool:
        problems = list(pool.map(lambda job, folder: run_one(job[2], job[3], folder, log_lines), todo, folders))
    failed = [f"{doc}: {command}\n    {problem}" for (doc, command, _, _), problem in zip(todo, problems) if problem]
    ran = sum(kind != "not run" for _, _, kind, _ in todo)
    assert not failed, "\n".join(failed)
    assert ran >= 50, ran   # the README and the docs show some 60 commands that run
