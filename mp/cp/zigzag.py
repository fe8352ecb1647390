"""Which tokens a context-parallel rank holds, at which true positions, and which blocks of causal
attention it computes (context_parallel.py's ring and Ulysses; parallel_5d.py can take the same layout).

A causal model's token i attends to tokens 0..i. Cut the sequence into chunks: a query chunk against a
key chunk is either FULL (every key before every query: plain attention), DIAGONAL (the same chunk:
masked, key j > query i hidden) or SKIP (every key after every query: the mask would empty it, so it is
never computed). Laid out contiguously (rank r holds chunk r of C), rank r computes r + 1 blocks: the
last rank does C of them, 2C/(C+1) of the mean (1.6 at C = 4), and every rank waits for it. The zigzag
(torchtitan's and Megatron's load balancing) cuts 2C chunks and gives rank r chunks r and 2C-1-r, one
from each end, so every rank computes the same 2C + 1 half-size blocks (rank r's own tokens: two
diagonals and one full; every other rank's: two full):

    C = 2, 4 chunks:   chunk   0    1    2    3          q \\ k   0    1    2    3
                       rank    0    1    1    0            0     D    .    .    .      rank 0: q 0, 3
                                                           1     F    D    .    .      rank 1: q 1, 2
                                                           2     F    F    D    .      D diagonal, F full,
                                                           3     F    F    F    D      . skipped

Every rank then holds 2 x S/(2C) tokens whose positions are not one run: the position embedding, the
dropout masks and the targets are taken at each token's TRUE position (positions()), and Ulysses, whose
all-to-all brings every rank's tokens in rank order, builds its mask from the true positions
(order()). The vit (not causal) uses the contiguous layout with every block FULL."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp.models import causal_mask
from mp.sizes import tokens_of

SKIP, DIAGONAL, FULL = "skip", "diagonal", "full"
WHOLE = [[(slice(None), slice(None), None)]]   # one tick, one block: all queries x all keys, no mask
LAYOUTS = ("zigzag", "contiguous")


def block_rule(q_chunk, k_chunk):
    """Causal attention of query chunk q_chunk over key chunk k_chunk (chunk indices along the sequence)."""
    if k_chunk > q_chunk:
        return SKIP          # every key after every query: all masked, never computed
    return DIAGONAL if k_chunk == q_chunk else FULL


@dataclass(frozen=True)
class Layout:
    """The sequence of `tokens` laid out over `degree` ranks: kind zigzag (2C chunks, rank r holds r and 2C-1-r)
    or contiguous (C chunks, rank r holds r); causal: the attention's blocks follow block_rule (else all FULL)."""
    degree: int
    tokens: int
    kind: str = "contiguous"
    causal: bool = False

    @property
    def chunk(self):
        """Tokens a chunk."""
        return self.tokens // (2 * self.degree if self.kind == "zigzag" else self.degree)

    def chunks(self, rank):
        """The chunks rank holds, in the order its tokens are stored."""
        return (rank, 2 * self.degree - 1 - rank) if self.kind == "zigzag" else (rank,)

    def runs(self, rank):
        """[(first, count)]: rank's runs of true positions, in storage order."""
        return [(c * self.chunk, self.chunk) for c in self.chunks(rank)]

    def positions(self, rank, device=None):
        """The true position of each token rank holds, in storage order (int64)."""
        return torch.cat([torch.arange(first, first + n, device=device) for first, n in self.runs(rank)])

    def order(self, device=None):
        """The true positions of every rank's tokens concatenated in rank order (what an all-to-all brings)."""
        return torch.cat([self.positions(r, device) for r in range(self.degree)])

    def take(self, x, rank, dim=1):
        """My tokens of a whole sequence along dim, in storage order (a copy)."""
        return torch.cat([x.narrow(dim, first, n) for first, n in self.runs(rank)], dim)

    def blocks(self, q_rank, kv_rank):
        """[(query rows, key rows, masked)] of the blocks q_rank's queries compute against kv_rank's keys:
        rows are slices of each rank's stored tokens; a SKIP block is left out, a DIAGONAL one is masked."""
        if not self.causal:
            return [(slice(None), slice(None), False)]
        n, found = self.chunk, []
        for i, qc in enumerate(self.chunks(q_rank)):
            for j, kc in enumerate(self.chunks(kv_rank)):
                rule = block_rule(qc, kc)
                if rule != SKIP:
                    found.append((slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n), rule == DIAGONAL))
        return found


def layout_of(args, degree):
    """The gpt's layout (--cp-layout), causal; the vit's: contiguous, every block full."""
    if args.model == "gpt":
        return Layout(degree, tokens_of(args), args.cp_layout, causal=True)
    return Layout(degree, tokens_of(args))


def ring_plan(layout, rank, device):
    """For each rank s, the blocks my queries (rank r's) compute against s's keys and values, which the ring
    brings at tick (r - s) mod C forward and (s - r) mod C backward: [(query rows, key rows, mask or None)],
    the mask True where a key comes after its query (a diagonal block)."""
    diagonal = causal_mask(layout.chunk, layout.chunk, device) if layout.causal else None
    return [[(rows, cols, diagonal if masked else None) for rows, cols, masked in layout.blocks(rank, s)]
            for s in range(layout.degree)]


def ulysses_plan(layout, device):
    """Ulysses' one block: all S tokens (in the all-to-all's rank order) against all, masked by their TRUE
    positions where causal (under zigzag the order is not the sequence's: a mask from it would be wrong)."""
    if not layout.causal:
        return [[(slice(None), slice(None), None)]]
    order = layout.order(device)
    return [[(slice(None), slice(None), order.unsqueeze(0) > order.unsqueeze(1))]]


def gather_sequence(x, layout, group):
    """Every rank's tokens of x ([b, my tokens, ...]) gathered whole, in the true order; no gradient
    (the evaluation's and --check's logits)."""
    parts = [torch.empty_like(x) for _ in range(layout.degree)]
    dist.all_gather(parts, x.contiguous(), group=group)
    whole = torch.cat(parts, 1)
    return whole[:, torch.argsort(layout.order(x.device))]


class RunsDropout(torch.nn.Module):
    """A KeyedDropout on tokens held in several runs (the zigzag's two chunks): each run's masks are the
    full layer's at its true positions (a KeyedDropout of its own, first_token set)."""

    def __init__(self, drop, runs):
        super().__init__()
        self.counts = [n for _, n in runs]
        self.runs = torch.nn.ModuleList(type(drop)(drop.p, drop.layer, drop.keys) for _ in runs)
        for part, (first, _) in zip(self.runs, runs):
            part.first_token = first

    def forward(self, x):
        return torch.cat([drop(part) for drop, part in zip(self.runs, x.split(self.counts, dim=1))], dim=1)


class AttentionWork:
    """The attention's multiply-adds a rank computed in a training step's forward (the summary's
    attention_flops: 2 b h q k d for the scores plus as many for probabilities x values, a block at a time,
    skipped blocks not counted), so the causal layouts' balance shows; mp.loop reads model.attention_work."""

    def __init__(self):
        self.step_flops, self.active, self.last = 0, False, 0

    def add(self, q, k):
        """A block of scores of queries q against keys k ([b, h, rows, d] each), and its values' product."""
        if self.active:
            b, h, rows, d = q.shape
            self.step_flops += 4 * b * h * rows * k.shape[2] * d

    @contextmanager
    def counting(self):
        """Count the forward inside (a training step's; the evaluation's and the backward's are not counted)."""
        self.step_flops, self.active = 0, True
        try:
            yield
        finally:
            self.active, self.last = False, self.step_flops
