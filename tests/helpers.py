"""Builders the test files share: small prompt batches on a tiny model, a free port.

Test files import these from here, not from one another (a test module imported by another
runs its fixtures and collection twice)."""

from __future__ import annotations

import socket

import torch

from extractive_lens import make_batch


def small_batch(model, seed=0, n=4):
    """``n`` prompts of 4 to 6 random tokens (BOS first) with one- or two-token answers; the
    answers' first tokens as candidates where they differ."""
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.d_vocab
    pairs = []
    for i in range(n):
        length = 4 + (i % 3)
        prompt = [1] + torch.randint(5, V, (length - 1,), generator=g).tolist()
        answer = torch.randint(5, V, (1 + (i % 2),), generator=g).tolist()
        pairs.append((prompt, answer))
    return make_batch(
        model,
        pairs,
        candidates=[a[0] for _, a in pairs] if len({a[0] for _, a in pairs}) == n else None,
    )


def facts(model, n=8, seed=0):
    """``n`` three-token facts with distinct one-token answers, which are the candidates."""
    g = torch.Generator().manual_seed(seed)
    answers = list(range(20, 20 + n))
    pairs = [
        ([1, int(torch.randint(5, 19, (1,), generator=g)), 3 + i % 2], [answers[i]])
        for i in range(n)
    ]
    return make_batch(model, pairs, candidates=answers)


def free_port() -> int:
    """A free TCP port on the loopback interface (for a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
