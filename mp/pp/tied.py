"""Tied input and output embeddings across a pipeline (the gpt's --tie-embeddings; Megatron's embedding group).

In one process the head's weight IS the embedding's (mp.models.LMHead), one Parameter, and autograd sums its
two uses' gradients. A pipeline puts the embedding (block 0) on the first stage and the head on the last, so
two ranks hold the weight: each builds it from --seed as block 0 is built (bit-identical copies), each
backward gives its stage's part of the gradient, and the two parts are summed over a group of those two
ranks (mesh.embed_group) after the backward, before the data-parallel sync, clipping and the update. Both
copies then step on the same gradient and stay bit-identical; the gradient norm counts the weight once (on
the first stage). Where one rank holds both ends (one stage; zbv's V, whose rank 0 holds the first and the
last chunk) the weight is one Parameter there, as in the baseline, and there is nothing to sum.

    stage 0: [embed tok.weight] -> blocks ...            stage p-1: ... blocks -> [head: tok.weight]
                        \\____________ all-reduce(grad) over embed_group ____________/

The last stage names its copy as the baseline does, "0.tok.weight" (TiedCopy: block 0 reduced to its tok),
so a checkpoint, a --check, the buckets' error lines and the replicas' report see the baseline's name."""
import torch.distributed as dist
import torch.nn as nn

from mp.dist import awaiting
from mp.loop import Replicas
from mp.pp.schedules import placement_of, stage_owner

TIED = "0.tok.weight"      # the tied weight's name in the baseline (block 0's embedding, listed first)


def is_tied(args):
    return args.model == "gpt" and getattr(args, "tie_embeddings", False)


def tied_stages(args, pp_size):
    """The pp coordinates of the stages that hold the tied weight, of pp_size stages: the first virtual
    stage's and the last's (one where they coincide, zbv's V); None when nothing is tied (Mesh.build then
    makes no embedding group)."""
    if not is_tied(args):
        return None
    return (0, stage_owner(pp_size * args.virtual_stages - 1, pp_size, placement_of(args.schedule))[0])


class TiedCopy(nn.Module):
    """The last stage's part of block 0: its token embedding only (no position table), the module that owns
    the head's tied weight there, so that it is named "0.tok.weight" as in the baseline."""

    def __init__(self, embed):
        super().__init__()
        self.tok = embed.tok


def tied_part(args, i, block, last_is_mine):
    """What a stage keeps of block i when the block is not in its chunks: block 0's TiedCopy on the stage
    that holds the head (last_is_mine) of a tied gpt, else nothing."""
    return TiedCopy(block) if i == 0 and last_is_mine and is_tied(args) else None


class TiedEmbedding:
    """One rank's share of the tied weight: held or not (a middle stage), summed with whom (group: the mesh's
    embed group, of one rank where the first and last stage are mine). runner: the stage's StageRunner (2bw:
    the weight version its backwards differentiate changes every step)."""

    def __init__(self, args, model, runner, group):
        self.runner, self.group, self.timeout_s = runner, group, args.timeout_s
        self.param = dict(model.named_parameters()).get(TIED) if is_tied(args) else None
        self.shared = self.param is not None and dist.get_world_size(group) > 1   # on two ranks: summed
        pos = runner.pos
        self.first = pos.is_first_stage
        # on two stages of every pipeline (not one stage, nor zbv's V): the same in every rank's view
        self.split = is_tied(args) and stage_owner(pos.pp_size * pos.virtual - 1, pos.pp_size, pos.placement)[0] > 0

    @property
    def late(self):
        """For the data-parallel buckets (mp.buckets' late): the tied weight's gradient is complete only after
        the sum, so its bucket starts then (final_late), never during the backward; and where one rank runs
        both ends in two chunks (zbv), only after both chunks' backwards."""
        return [self.param] if self.param is not None else []

    def weight(self):
        """The tensor whose gradient the backwards made: the parameter, or 2bw's version in training."""
        versions = self.runner.versions
        if versions is None:
            return self.param
        c, j = dict(versions.slots)[TIED]
        return versions.older[c][j]

    def sum_grads(self):
        """After the step's last backward, before the data-parallel sync, clipping and the update: the first
        and the last stage's parts of the gradient summed, once, over the embedding group."""
        if self.shared:
            with awaiting(f"stage {self.runner.pos.pp_rank} waited for the tied embedding's gradient sum with "
                          f"ranks {dist.get_process_group_ranks(self.group)}", self.timeout_s):
                dist.all_reduce(self.weight().grad, group=self.group)

    def replicas(self):
        """The end-of-run report (mp.loop.Replicas): the first and last stage's copies bit-identical (every rank
        joins: a middle stage's embedding group is itself alone); none where no pipeline holds two copies."""
        if not self.split:
            return []
        return [Replicas([self.param] if self.param is not None else [], self.group,
                         "the tied embedding weight bit-identical on the first and last stage", uneven=True)]

    def counted(self, p):
        """The gradient norm's rule (mp.clipping's counted): the tied weight once, on the first stage."""
        return self.first or not self.shared or p is not self.weight()


def tie_embeddings(args, model, runner, mesh):
    """Sets the runner's TiedEmbedding (runner.tied: its sum_grads() a no-op where nothing is tied or shared), over
    the mesh's embedding group, and the gradient norm's rule counting the tied weight once; returns it."""
    runner.tied = TiedEmbedding(args, model, runner, mesh.groups.get("embed"))
    if runner.tied.shared:
        assert runner.counted is None, "the tied weight's rule would replace another counted rule"
        runner.counted = runner.tied.counted
    return runner.tied


def tied_replicas(runner):
    """The tied weight's end-of-run report (TiedEmbedding.replicas) where the program tied it (tie_embeddings);
    none for a runner without (parallel_3d.py shares pipeline_dp_joint.py's Job, and takes no gpt)."""
    tied = getattr(runner, "tied", None)
    return tied.replicas() if tied is not None else []
