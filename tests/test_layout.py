"""The repository's layout stays what a student came for (docs/map.md): eight programs and their
launchers on top, one package below them; imports point down and never run in a circle; each
program reads in one sitting and holds its own lesson."""
import ast
import os
import subprocess

import pytest

from helpers import ROOT

PROGRAMS = ["single_baseline.py", "pipeline_microbatch.py", "pipeline_dp_joint.py", "tensor_parallel.py",
            "parallel_3d.py", "context_parallel.py", "expert_parallel.py", "parallel_5d.py"]
LAUNCHERS = ["run_pipeline.sh", "run_joint.sh", "run_tp.sh", "run_3d.sh", "run_cp.sh", "run_ep.sh",
             "run_5d.sh", "run_slurm.sh"]
FOLDERS = ["mp", "docs", "tests", "benchmarks", "plots", ".ci"]
OTHERS_ALLOWED = 2        # e.g. a pyproject.toml or pytest.ini
MAX_LINES = 450   # about 400, and room for a step written out in full (issue 42)


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return out.stdout.split()


def modules():
    """{module name: path} of the programs and every module of the package."""
    found = {p[:-3]: os.path.join(ROOT, p) for p in PROGRAMS}
    for folder, _, files in os.walk(os.path.join(ROOT, "mp")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return found


def project_imports(path, known):
    """[(imported module, line, inside a function?)] of project modules imported by the file at path."""
    tree, found = ast.parse(open(path).read()), []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for a in child.names:
                    target = f"{child.module}.{a.name}"
                    name = target if target in known else child.module
                    if name in known:
                        found.append((name, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def graph():
    known = modules()
    return known, {name: project_imports(path, known) for name, path in known.items()}


def test_the_top_level_holds_the_programs_the_launchers_and_one_package():
    top = {path.split("/")[0] for path in tracked_files()}
    wanted = set(PROGRAMS + LAUNCHERS + FOLDERS + ["README.md", "requirements.txt"])
    assert wanted - {".ci"} <= top, f"missing at the top: {sorted(wanted - top)}"
    others = sorted(name for name in top - wanted if not name.startswith("."))
    assert len(others) <= OTHERS_ALLOWED, f"files at the top beyond the lessons and launchers: {others}"
    assert not [name for name in others if name.endswith(".py")], f"a helper at the top, not in mp/: {others}"


def test_the_package_never_imports_a_program():
    programs = {p[:-3] for p in PROGRAMS}
    _, edges = graph()
    wrong = [(name, target, line) for name, imports in edges.items() if name.startswith("mp")
             for target, line, _ in imports if target in programs]
    assert not wrong, f"mp/ imports a program (module, program, line): {wrong}"


def test_no_project_import_inside_a_function():
    _, edges = graph()
    hidden = [(name, target, line) for name, imports in edges.items() for target, line, inside in imports if inside]
    assert not hidden, f"imports inside a function (module, what, line): {hidden}"


def test_imports_never_run_in_a_circle():
    _, edges = graph()
    successors = {name: sorted({t for t, _, _ in imports if t != name and not name.startswith(t + ".")})
                  for name, imports in edges.items()}
    state, cycles = {}, []

    def walk(node, path):
        state[node] = "open"
        for nxt in successors.get(node, []):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for node in successors:
        if node not in state:
            walk(node, [node])
    assert not cycles, f"import cycles: {cycles}"
    assert not any(name in successors[name] for name in successors), "a module imports itself"


def test_the_graph_sees_real_imports():
    """The checks above cannot pass by seeing nothing: the lesson imports the package and its peer."""
    _, edges = graph()
    assert {"mp.loop", "mp.pp.schedules", "mp.pp.training"} <= {t for t, _, _ in edges["pipeline_microbatch"]}
    assert "mp.check" in {t for t, _, _ in edges["mp.pp.training"]}
    assert "pipeline_microbatch" in {t for t, _, _ in edges["parallel_3d"]}


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_reads_in_one_sitting(program):
    with open(os.path.join(ROOT, program)) as f:
        lines = len(f.readlines())
    assert lines <= MAX_LINES, f"{program} has {lines} lines; move a technique a student may skip into mp/"


def defined(program):
    tree = ast.parse(open(os.path.join(ROOT, program)).read())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def calls(program):
    tree = ast.parse(open(os.path.join(ROOT, program)).read())
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


def test_each_program_holds_its_own_mechanism():
    """What each issue of the course calls the lesson is written out in the program, not imported."""
    assert {"send_forward", "recv_forward", "send_backward", "recv_backward", "StageRunner", "train_step",
            "build_stage_model", "partition"} <= defined("pipeline_microbatch.py")
    assert {"dist.batch_isend_irecv", "dist.P2POp"} <= calls("pipeline_microbatch.py")
    assert {"_CopyToTP", "_ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear", "copy_to_tp_region",
            "reduce_from_tp_region"} <= defined("tensor_parallel.py")
    # the data-parallel gradient sync: buckets all-reduced as their gradients become final (all_reduce_flat
    # is only the 2bw path's, so it is not the mechanism the lesson teaches)
    assert {"pipeline", "train_step", "data_parallel_buckets"} <= defined("pipeline_dp_joint.py")
    assert {"GradBuckets", "grads.wait", "grads.zero_grad"} <= calls("pipeline_dp_joint.py")
    # issue 64: the grids' groups come from the one mesh (mp/mesh.py makes every group, in one order);
    # no program makes a group of its own
    assert "dist.new_group" in calls("mp/mesh.py")
    for program in ("pipeline_dp_joint.py", "parallel_3d.py", "tensor_parallel.py", "context_parallel.py",
                    "expert_parallel.py", "parallel_5d.py"):
        assert "Mesh.build" in calls(program) and "dist.new_group" not in calls(program), program
        assert "dist.group.WORLD" not in open(os.path.join(ROOT, program)).read(), program   # a group by axis
    # the ring written out with batched isend/irecv, its backward, and Ulysses' all-to-all pair
    assert {"RingAttention", "ring_exchange", "_TokensToHeads", "_HeadsToTokens", "_ReduceFromCP",
            "train_step"} <= defined("context_parallel.py")
    assert {"dist.batch_isend_irecv", "dist.P2POp", "dist.all_to_all_single"} <= calls("context_parallel.py")
    # the route, the dispatch and the combine written out with all_to_all_single, and its backward
    assert {"AllToAll", "ExpertParallelMoE", "exchange_counts", "train_step"} <= defined("expert_parallel.py")
    assert {"dist.all_to_all_single", "route", "combine"} <= calls("expert_parallel.py")
    assert {"train_step", "loss_function"} <= defined("single_baseline.py") | calls("single_baseline.py")   # mp/loss.py


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_writes_its_step_out(program):
    """Issue 42: every program defines its own train_step, in its own file, and its body runs the step's
    parts in order: zero the gradients, forward and backward, (synchronise), clip, update."""
    tree = ast.parse(open(os.path.join(ROOT, program)).read())
    step = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train_step"), None)
    assert step is not None, f"{program} defines no train_step of its own"
    order = []
    for node in ast.walk(step):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            for part, marks in (("zero_grad", ("zero_grad",)), ("backward", ("backward", "forward_backward")),
                                ("clip", ("clip", "grad_norm")), ("update", ("optimizer.step", "update"))):
                if any(mark in name for mark in marks):
                    order.append((node.lineno, part))
    parts = [part for _, part in sorted(order)]
    firsts = [parts.index(p) for p in ("zero_grad", "backward", "clip", "update")]
    assert firsts == sorted(firsts), f"{program}'s train_step runs {parts}"


def test_the_loop_takes_a_handful_of_fields():
    """Issue 42: the loop's hand-over (mp.loop.Job) has a handful of fields (at most 10 since issue 59
    moved the step's named waits and the replicas' check there, out of each main), and only two are
    callables: the step and the evaluation. Not a bag of callables."""
    import dataclasses
    from mp.loop import Job
    fields = dataclasses.fields(Job)
    assert len(fields) <= 10, [f.name for f in fields]
    assert [f.name for f in fields if "Callable" in str(f.type)] == ["step", "evaluate"], [(f.name, f.type) for f in fields]
