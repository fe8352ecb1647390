"""The training loss a program computes on its piece of a step's global batch.

The image models: a piece's mean cross-entropy (F.cross_entropy). Every piece holds as many samples as
the next (a microbatch of the batch, a replica's slice), so the programs' plain averages of the pieces
(1/M over a pipeline's microbatches, the data-parallel average of the gradients) give the global batch's
mean, the baseline's loss.

The gpt: the cross-entropy of each valid token, summed over the global batch, divided by their count N.
With a loss mask (--loss-mask, mp/text.py) pieces hold different counts, and the mean of the pieces'
own means is not that loss: a piece of 10 valid tokens would weigh as much as one of 1,000 (the
gradient-accumulation bug of 2024's trainers; Megatron-LM PR #7513, where one valid token under
context parallelism 2 halved the gradient). So every piece scales by the global count, never by its
own: it returns its tokens' sum times P / N, P being the number of equal pieces the program then
averages, and the same averages give sum / N exactly, with each token weighing 1 / N. N comes from the
data (every rank draws the step's targets, mp/text.py), never from a collective."""
import torch.nn.functional as F

from mp.text import IGNORE


def token_sum(logits, targets):
    """The sum of the valid tokens' cross-entropies: logits [..., V], targets [...] (IGNORE: left out), a
    float64 scalar (sum_in_float64)."""
    each = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return sum_in_float64(each)


def sum_in_float64(each):
    """The sum of each token's cross-entropy (float32, 0 where left out) in float64. A float32 sum of 10^3
    values near 5 rounds at every addition (its ulp at the sum is 10^-4), and every layout adds other pieces
    in another order (a rank's tokens, a microbatch's): the loss then differed by up to 1.9e-6 (4 ulps of
    the loss) between layouts with the very same weights. float64 keeps 29 more bits: at a sum up to 10^4
    every value above 3e-5 is added exactly, so the order no longer shows (2e-8; the weights' own rounding
    is what is left). The gradient is the same: each token's is the float32 scale, as before."""
    return each.double().sum()


def valid_tokens(targets):
    """How many targets count (a host tensor's: the data's, not the device's)."""
    return int((targets != IGNORE).sum())


def loss_function(args, data, step, pieces=1, sum_of=token_sum):
    """The loss of one piece of step's global batch, loss(logits, targets): the image models' mean;
    the gpt's token sum x pieces / the global batch's valid tokens, pieces being how many equal pieces
    the program averages (a pipeline's microbatches x the data-parallel replicas x the context ranks;
    the baseline: 1). sum_of(logits, targets): the token sum (tensor parallelism's from its vocabulary
    columns: mp.tp.vocab)."""
    if args.model != "gpt":
        return F.cross_entropy
    scale = pieces / valid_tokens(data.labels(step, args.batch_size))
    return lambda logits, targets: sum_of(logits, targets) * scale
