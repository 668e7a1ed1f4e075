"""One record of what changes the function a score is of: ``{what: digest}``.

>>> from extractive_lens.record import callable_identity
>>> callable_identity(lambda logits, batch: logits[:, -1, 0]) == callable_identity(
...     lambda logits, batch: logits[:, -1, 1])
False

A score depends on the model's configuration (every field that changes its function: rotary
base, norm eps, soft caps, ...; ``backend.function_config``), its parameters and buffers (a
rotary table is a buffer), Δ, the batch (tokens, answers, candidates, token roles), the reward
(a built-in by name, a function by its code: bytecode, constants, defaults and the values it
closes over) and every option. ``function_record`` digests each of these once; what reads it:

- ``distributed_scores``: every rank's record must equal rank 0's (``differences`` says what
  differs: "rank 1 has eps=1e-06 where rank 0 has eps=1e-05");
- ``causal_scores`` / ``integrated_scores(top_k=..., linear=...)``: the linear scores' recorded
  model, batch, reward and shared options must be this call's;
- every result's metadata (``function_record``), so that two results say whether they are of
  the same function.

Parameters and buffers are hashed once per model and kept until one of them changes (their
version counters and storage). A reward whose code cannot be read (a callable object) has no
identity: ``reward_identity`` says ``None``, and a caller for which identity matters refuses it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from extractive_lens import backend as B

MODEL = ("config", "parameters", "buffers")
BATCH = ("tokens", "answers", "candidates", "roles")


def function_record(
    model: Any, diff: Any, batch: Any, options: Mapping[str, Any], reward: Any, *,
    exact_diff: bool = True,
) -> dict[str, str | None]:  # fmt: skip
    """``{what: digest}`` of everything the scores of ``model``, ``diff``, ``batch`` depend on
    (module docstring); ``options``: the resolved options (``option <name>`` entries),
    ``reward``: the reward (a name or a callable). Δ by its bytes (``exact_diff``), or by its
    content fingerprint (``WeightDiff._fingerprint``, kept on the diff: no second read of Δ)."""
    content = diff_digest(diff) if exact_diff else _hash(json.dumps(diff._fingerprint,
                                                                     sort_keys=True))  # fmt: skip
    out: dict[str, str | None] = {
        "config": json.dumps(B.function_config(model), sort_keys=True, default=str),
        "parameters": _model_digest(model, "parameters"),
        "buffers": _model_digest(model, "buffers"),
        "diff": content,
        **batch_record(batch),
        "reward": reward_identity(reward),
    }
    for name, value in sorted(options.items()):
        out[f"option {name}"] = describe(value)
    return out


def differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], ref: str,
                keys: Iterable[str] | None = None) -> list[str]:  # fmt: skip
    """What ``theirs`` has that ``mine`` (``ref``'s) has not, one phrase each ("another diff";
    for the configuration "eps=1e-06 where rank 0 has eps=1e-05")."""
    out = []
    for what in sorted(set(mine) | set(theirs) if keys is None else keys):
        a, b = mine.get(what), theirs.get(what)
        if what == "reward" and (a is None or b is None):  # no identity: never "the same"
            out.append("a reward whose code cannot be read (pass a function or a named reward)")
            continue
        if a == b:
            continue
        if what == "config" and a is not None and b is not None:
            ca, cb = json.loads(a), json.loads(b)
            out += [f"{k}={cb.get(k)!r} where {ref} has {k}={ca.get(k)!r}"
                    for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)]  # fmt: skip
        else:
            out.append(_PHRASES.get(what, f"another {what.removeprefix('option ')}"))
    return out


_PHRASES = {
    "parameters": "another base model", "buffers": "other buffers of the base model",
    "diff": "another diff", "tokens": "another batch", "answers": "other answers",
    "candidates": "other candidate answers", "roles": "other token roles",
    "reward": "another reward",
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Digests
# ---------------------------------------------------------------------------------------------


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hash of the bytes (names, shapes, dtypes) of named tensors, read in place where the
    tensor is contiguous on the CPU (no copy; about 0.9 GB/s on one core: an 8B model's 16 GB
    of bfloat16 weights in about 17 s, once per model: ``_model_digest`` keeps it)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(named, key=lambda item: item[0]):
        t = t.detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()


_CACHE: weakref.WeakKeyDictionary[Any, dict[str, tuple[tuple[Any, ...], str]]] = (
    weakref.WeakKeyDictionary()
)


def _model_digest(model: Any, what: str) -> str:
    """``tensors_digest`` of the model's parameters or buffers, kept until one changes."""
    named = list(getattr(model, f"named_{what}")())
    state = tuple((n, t._version, t.data_ptr(), t.dtype, t.device) for n, t in named)
    kept = _CACHE.setdefault(model, {}).get(what)
    if kept is not None and kept[0] == state:
        return kept[1]
    digest = tensors_digest(named)
    _CACHE[model][what] = (state, digest)
    return digest


def diff_digest(diff: Any) -> str:
    """Δ's bytes (a low-rank Δ: its factors, layouts and dense parts)."""
    deltas = diff.deltas
    factors = getattr(deltas, "factors", None)
    if factors is None:
        return tensors_digest((n, deltas[n]) for n in deltas)
    parts = [(f"{n}::left", f.left) for n, f in factors.items()]
    parts += [(f"{n}::right", f.right) for n, f in factors.items()]
    parts += [(f"{n}::layout {f.layout} {f.n_heads}", torch.zeros(0)) for n, f in factors.items()]
    parts += [(f"{n}::dense", d) for n, d in deltas.dense.items()]
    return tensors_digest(parts)


def batch_record(batch: Any) -> dict[str, str | None]:
    """The batch's tokens (each row to its length), answers, candidates and token roles."""
    rows = [batch.tokens[i, : int(batch.lengths[i])] for i in range(len(batch))]
    cands = batch.candidates
    return {
        "tokens": tensors_digest((f"{i}", r) for i, r in enumerate(rows)),
        "answers": tensors_digest(
            [
                ("targets", batch.answer_targets.long()),
                ("prompt_lengths", batch.prompt_lengths.long()),
            ]
        ),  # fmt: skip
        "candidates": None if cands is None else tensors_digest([("c", cands.long())]),
        "roles": hashlib.blake2b(repr(batch.roles).encode(), digest_size=16).hexdigest(),
    }


def reward_identity(reward: Any) -> str | None:
    """A built-in reward's name (``None`` given: the method's default, said by its options), or
    a callable's ``callable_identity`` (``None`` where its code cannot be read)."""
    from extractive_lens.rewards import REWARDS

    if reward is None or isinstance(reward, str):
        return f"reward {reward}"
    named = [name for name, fn in REWARDS.items() if fn is reward]
    return f"reward {named[0]}" if named else callable_identity(reward)


def callable_identity(fn: Any, depth: int = 0) -> str | None:
    """A function by its code: bytecode, constants (nested functions' too), names, defaults and
    the values of the variables it closes over; a ``functools.partial`` by its function and
    arguments. ``None`` for a callable whose code cannot be read (an object with ``__call__``,
    a builtin): two such objects cannot be told apart."""
    if depth > 4:
        return None
    if isinstance(fn, functools.partial):
        inner = callable_identity(fn.func, depth + 1)
        if inner is None:
            return None
        return _hash("partial", inner, describe(list(fn.args)), describe(fn.keywords))
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
    closed = [callable_identity(v, depth + 1) if callable(v) and hasattr(v, "__code__")
              else describe(v) for v in cells]  # fmt: skip
    return _hash(
        "function", getattr(fn, "__module__", ""), getattr(fn, "__qualname__", ""), _code(code),
        describe(getattr(fn, "__defaults__", None)), describe(getattr(fn, "__kwdefaults__", None)),
        repr(closed),
    )  # fmt: skip


def _code(code: Any) -> str:
    consts = [_code(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return _hash(code.co_code.hex(), repr(consts), repr(code.co_names), repr(code.co_varnames))


def _hash(*parts: str | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(f"{p}|".encode())
    return h.hexdigest()


def describe(value: Any) -> str:
    """A digest of an option's value: tensors, batches and results by content, functions by
    their code."""
    if hasattr(value, "tokens") and hasattr(value, "roles") and hasattr(value, "lengths"):
        return "batch " + _hash(*(f"{k}={v}" for k, v in batch_record(value).items()))
    if hasattr(value, "kinds") and hasattr(value, "method") and hasattr(value, "totals"):
        named = [("values", value.values), ("totals", value.totals)]
        if value.prompt_totals is not None:
            named.append(("prompt_totals", value.prompt_totals))
        return f"scores {value.method} {value.kinds} " + tensors_digest(named)
    if isinstance(value, torch.Tensor):
        return "tensor " + tensors_digest([("t", value)])
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in sorted(value.items())) + "}"
    if callable(value) and not isinstance(value, type):
        return f"callable {callable_identity(value)}"
    return repr(value)
