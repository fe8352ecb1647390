"""The optimizer every program builds over the parameters it holds."""
import torch


def make_optimizer(params, args):
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
