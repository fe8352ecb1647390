"""What a trained gpt writes: bytes sampled one at a time from a checkpoint, in any layout it was saved in.

    python single_baseline.py --model gpt --data shakespeare --steps 2000 --checkpoint-dir ckpt/gpt
    python -m mp.tools.sample --checkpoint-dir ckpt/gpt --prompt "ROMEO:" --bytes 300

The model's flags come from the checkpoint (its meta.json): the tool builds the baseline's model, reads
the latest checkpoint into it (mp/checkpoint.py: the baseline's coordinates, whatever layout wrote it),
then repeats: the logits of the last position given at most --seq-len bytes before it, divided by
--temperature, one byte drawn from their softmax (a generator seeded by --seed), appended."""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()

import argparse
import sys

import torch

from mp import checkpoint
from mp.cli import baseline_args
from mp.dist import distributed
from mp.errors import fail
from mp.flags import OneLineParser
from mp.models import build_model
from mp.optim import make_optimizer

# the checkpoint's settings that are flags of the model (the rest say how it was trained)
MODEL_SETTINGS = ("layers", "hidden", "heads", "seq_len", "activation", "experts", "top_k", "capacity_factor",
                  "aux_loss")


def parse(argv):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, help="a gpt run's --checkpoint-dir (its latest step is read)")
    p.add_argument("--prompt", default="\n", help="the text the sample continues")
    p.add_argument("--bytes", type=int, default=300, help="how many bytes to write")
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: likelier bytes; above 1: more surprise")
    p.add_argument("--seed", type=int, default=0, help="seeds the draws")
    args = p.parse_args(argv)
    if args.bytes <= 0 or not args.temperature > 0:
        fail(f"--bytes {args.bytes} and --temperature {args.temperature} must be > 0 (e.g. 300 and 0.8)")
    path = checkpoint.latest(args.checkpoint_dir)
    if path is None:
        fail(f"--checkpoint-dir {args.checkpoint_dir} holds no complete checkpoint; train with --checkpoint-dir "
             f"first (e.g. python single_baseline.py --model gpt --checkpoint-dir {args.checkpoint_dir})")
    saved = checkpoint.read_meta(path)["settings"]
    if saved.get("model") != "gpt":
        fail(f"the checkpoint {path} is of --model {saved.get('model')}, not a gpt: nothing to write with")
    return args, saved


def run_args(saved, checkpoint_dir):
    """The baseline's flags of the saved run, so that the model built and the settings checked are its own."""
    flags = ["--model", "gpt", "--data", "synthetic", "--checkpoint-dir", checkpoint_dir, "--eval-every", "0"]
    for k in MODEL_SETTINGS + ("optimizer", "seed", "batch_size"):
        value = saved.get(k, checkpoint.EARLIER.get(k))
        if value is not None:
            flags += [f"--{k.replace('_', '-')}", str(value)]
    flags += ["--tie-embeddings"] if saved.get("tie_embeddings") else []
    args = baseline_args(flags, "")
    # the rest of what makes the run what it is, as saved: checkpoint.validate then finds them equal
    for k in checkpoint.SETTINGS:
        if k in saved:
            setattr(args, k, saved[k])
    checkpoint.validate(args)
    return args


@torch.no_grad()
def write(model, prompt, n, temperature, seq_len, seed):
    """The prompt's bytes followed by n sampled ones, as bytes."""
    tokens = list(prompt.encode()) or [10]
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        context = torch.tensor(tokens[-seq_len:]).unsqueeze(0)
        logits = model(context)[0, -1] / temperature
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
    return bytes(tokens)


def main(argv=None):
    args, saved = parse(argv)
    run = run_args(saved, args.checkpoint_dir)
    with distributed(run) as env:
        model = build_model(run)
        step, _ = checkpoint.resume(run, model, make_optimizer(model.parameters(), run), env.rank)
        model.eval()
        text = write(model, args.prompt, args.bytes, args.temperature, run.seq_len, args.seed)
    sys.stdout.write(f"after {step} steps ({run.resume_from}):\n{text.decode(errors='replace')}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
