"""The gpt on parallel_5d.py's mesh: where context parallelism's tokens meet the vocabulary split of tensor
parallelism. My cp rank holds the tokens of mp/cp/zigzag.py's layout (the zigzag's chunks r and 2C-1-r, or
chunk r of the contiguous layout), and under --sequence-parallel my tp rank holds a run of those; each keeps
its TRUE position, for the position vector, the dropout masks and the target. The ends are mp/tp/vocab.py's:
my V/T rows of the embedding and the head, whose loss reduces over tp; the head is per token, so nothing is
summed over cp in the forward (the vit's pooled mean is), and the loss is my tokens' share of the global
batch's (mp.loss: pieces M x D x C, which the pipeline's 1/M and the dp x cp average of the gradients undo).

    tokens [b, S] (whole) --my positions--> [b, S/C] --my V/T rows, g over tp (sp: reduce-scatter)-->
        [b, S/C, H] (sp: [b, S/(C T), H]) + pos[my true positions]  ...blocks...  head: [b, S/C, V/T]
        --vocab-parallel cross-entropy (tp)--> my tokens' sum x M D C / N"""
import torch
import torch.nn as nn

from mp.cp.zigzag import RunsDropout, gather_sequence
from mp.dropout import KeyedDropout
from mp.tp.collectives import tp_rank, tp_size
from mp.tp.mappings import gather_from_tp_region
from mp.tp.vocab import vocab_parallel_scores


def my_positions(layout, cp_rank, tp_group, sequence_parallel):
    """The true positions of my tokens, in the order I hold them: my cp rank's (the layout's), and under
    sequence parallelism my tp rank's equal run of them (mp.tp.sequence's split of my cp rank's tokens)."""
    positions = layout.positions(cp_rank)
    if not sequence_parallel:
        return positions
    n = len(positions) // tp_size(tp_group)
    return positions.narrow(0, tp_rank(tp_group) * n, n)


def runs_of(positions):
    """[(first, count)]: positions cut into runs of consecutive ones (the zigzag's two chunks: two runs, or one
    where a tp rank's run lies inside one chunk)."""
    runs = []
    for p in positions.tolist():
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [tuple(run) for run in runs]


class MeshTokenEmbed(nn.Module):
    """mp.tp.vocab.VocabParallelEmbed on my cp rank's tokens: the ids at my positions looked up in my V/T rows,
    summed over tp by g (sequence parallel: reduce-scattered to my tp rank's run), plus the position vectors
    of their true positions. The parameters keep TokenEmbed's names (tok, pos), the tied head finds tok."""

    def __init__(self, embed, layout, cp_rank):
        super().__init__()
        self.tok, self.pos, self.group, self.reduce = embed.tok, embed.pos, embed.group, embed.reduce
        self.register_buffer("mine", layout.positions(cp_rank), persistent=False)   # my cp rank's ids
        self.register_buffer("positions", my_positions(layout, cp_rank, embed.group, embed.sequence_parallel),
                             persistent=False)

    def forward(self, tokens):
        return self.reduce(self.tok(tokens[:, self.mine]), self.group) + self.pos[:, self.positions]


def gpt_on_my_tokens(i, block, layout, cp_rank, tp_group, sequence_parallel):
    """Block i of the gpt, already tensor-parallel, on my tokens (the attention is the caller's: it composes
    context_parallel.py's): the embedding of MeshTokenEmbed, the head as it is (per token), and a
    transformer block's dropouts keyed by my tokens' true positions (a run each: RunsDropout)."""
    if i == 0:
        return MeshTokenEmbed(block, layout, cp_rank)
    if not hasattr(block, "attn"):
        return block
    runs = runs_of(my_positions(layout, cp_rank, tp_group, sequence_parallel))
    for name in ("drop1", "drop2"):
        drop = getattr(block, name)
        if isinstance(drop, KeyedDropout) and len(runs) == 1:
            drop.first_token = runs[0][0]
        elif isinstance(drop, KeyedDropout):
            setattr(block, name, RunsDropout(drop, runs))
    return block


def mesh_scores(args, layout, cp_rank, tp_group):
    """The evaluation's scores (mp.loop.evaluate) of my tokens' vocabulary columns against their labels;
    summed over dp x cp by the caller's group (every cp rank scores its own tokens)."""
    scores = vocab_parallel_scores(args, tp_group)
    return lambda logits, labels: scores(logits, layout.take(labels, cp_rank))


def whole_outputs(logits, loss, layout, cp_group, tp_group):
    """--check's (logits, loss) of my microbatches, to compare with the full model's: as they are for the vit
    (layout None) or a rank without them (None); the gpt's my vocabulary columns of my tokens gathered whole
    (over tp, then over cp in the true order), and my tokens' share of the loss summed over cp (no gradient)."""
    if logits is None or layout is None:
        return logits, loss
    logits = gather_from_tp_region(logits.detach(), tp_group, [logits.shape[-1]] * tp_size(tp_group))
    loss = loss.detach().clone()
    torch.distributed.all_reduce(loss, group=cp_group)
    return gather_sequence(logits, layout, cp_group), loss
