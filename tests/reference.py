"""Slow, literal reference implementations, independent of the package's scoring engine.

Everything here uses TransformerLens's own machinery: ``use_attn_result=True`` so each head's
write ``hook_result`` is a real hook point, ``run_with_cache`` / ``run_with_hooks``, one full
forward pass per intervention, and explicit model copies holding mixed weights. Nothing is
batched across interventions and nothing resumes mid-stream.
"""

from __future__ import annotations

import copy
import re

import torch

from extractive_lens.batch import PromptBatch


def attn_result_mode(model):
    m = copy.deepcopy(model)
    m.cfg.use_attn_result = True
    m.setup()
    return m


def reward_of(model, batch: PromptBatch, reward, fwd_hooks=()):
    with torch.no_grad():
        logits = model.run_with_hooks(batch.tokens, fwd_hooks=list(fwd_hooks))
    return reward(logits, batch)


def mixed_model(base, ft, take_from_ft):
    """A copy of ``base`` whose parameters named by ``take_from_ft(name)`` come from ``ft``."""
    m = copy.deepcopy(base)
    ft_params = dict(ft.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            if take_from_ft(n):
                p.copy_(ft_params[n])
    return m


def late_predicate(layer: int, head_component: bool, parallel: bool):
    """Parameters acting only after a component's output (SPEC §4 ``W_late``)."""

    def take(name: str) -> bool:
        m = re.match(r"blocks\.(\d+)\.(.*)", name)
        if m is None:
            return name.startswith(("ln_final.", "unembed."))
        lay, rest = int(m.group(1)), m.group(2)
        if lay > layer:
            return True
        if lay < layer:
            return False
        if head_component:
            if rest == "attn.b_O":
                return True
            return (not parallel) and rest.startswith(("mlp.", "ln2."))
        return False

    return take


def _replace(value):
    def hook(act, hook):
        return value

    return hook


def _patch_head(layer, head, positions, new):
    def hook(act, hook):
        act = act.clone()
        act[:, positions, head] = new[:, positions, head]
        return act

    return (f"blocks.{layer}.attn.hook_result", hook)


def _patch_mlp(layer, positions, new):
    def hook(act, hook):
        act = act.clone()
        act[:, positions] = new[:, positions]
        return act

    return (f"blocks.{layer}.hook_mlp_out", hook)


def component_outputs(model_f, batch, layer, source_inputs):
    """Heads' ``hook_result`` and the MLP's output of ``model_f`` at ``layer``, with the layer's
    inputs replaced by ``source_inputs`` (a cache from another run): ``f_c(z, W)`` literally."""
    hooks = [(f"blocks.{layer}.hook_resid_pre", _replace(source_inputs[f"blocks.{layer}.hook_resid_pre"]))]
    if not model_f.cfg.parallel_attn_mlp and not model_f.cfg.attn_only:
        hooks.append((f"blocks.{layer}.hook_resid_mid", _replace(source_inputs[f"blocks.{layer}.hook_resid_mid"])))
    store = {}

    def save(name):
        def hook(act, hook):
            store[name] = act.detach().clone()

        return hook

    hooks.append((f"blocks.{layer}.attn.hook_result", save("result")))
    if not model_f.cfg.attn_only:
        hooks.append((f"blocks.{layer}.hook_mlp_out", save("mlp")))
    with torch.no_grad():
        model_f.run_with_hooks(batch.tokens, fwd_hooks=hooks)
    return store


def literal_exact(base, ft, batch, reward, kinds, y_star=None, per="token", layers=None):
    """Exact scores by one forward per intervention: ``{kind: [batch, layer, component, pos]}``.

    ``y_star``: ``(result_star [batch pos layer head d_model], mlp_star [batch pos layer d_model])``.
    ``per="component"`` patches all positions at once and returns ``[batch, layer, component]``.
    """
    B = attn_result_mode(base)
    F = attn_result_mode(ft)
    cfg = base.cfg
    L, H, T = cfg.n_layers, cfg.n_heads, batch.tokens.shape[1]
    has_mlp = not cfg.attn_only
    C = H + has_mlp
    with torch.no_grad():
        _, base_cache = B.run_with_cache(batch.tokens)
        _, ft_cache = F.run_with_cache(batch.tokens)
    R0 = reward_of(B, batch, reward)
    positions = [[t] for t in range(T)] if per == "token" else [list(range(T))]
    out = {k: torch.zeros(len(batch), L, C, len(positions), dtype=R0.dtype) for k in kinds}
    for layer in range(L) if layers is None else layers:
        late_models = {}
        layer_values = {}
        if "informative" in kinds:
            layer_values["informative"] = component_outputs(F, batch, layer, base_cache)
        if "downstream" in kinds:
            layer_values["downstream"] = component_outputs(B, batch, layer, ft_cache)
        for c in range(C):
            is_head = c < H
            y = base_cache[f"blocks.{layer}.attn.hook_result"] if is_head else base_cache[f"blocks.{layer}.hook_mlp_out"]
            patch_values = {kind: st["result"] if is_head else st["mlp"] for kind, st in layer_values.items()}
            for kind, new in patch_values.items():
                for i, pos in enumerate(positions):
                    hook = _patch_head(layer, c, pos, new) if is_head else _patch_mlp(layer, pos, new)
                    out[kind][:, layer, c, i] = reward_of(B, batch, reward, [hook]) - R0
            if "upstream" in kinds:
                key = "head" if is_head else "mlp"
                if key not in late_models:
                    late_models[key] = attn_result_mode(
                        mixed_model(base, ft, late_predicate(layer, is_head, cfg.parallel_attn_mlp))
                    )
                Lm = late_models[key]
                R_late = reward_of(Lm, batch, reward)
                rs, ms = y_star
                star = rs[:, :, layer].to(y.dtype) if is_head else ms[:, :, layer].to(y.dtype)
                for i, pos in enumerate(positions):
                    hook = _patch_head(layer, c, pos, star) if is_head else _patch_mlp(layer, pos, star)
                    U = (R_late - reward_of(Lm, batch, reward, [hook])) - (R0 - reward_of(B, batch, reward, [hook]))
                    out["upstream"][:, layer, c, i] = U
    if per == "component":
        return {k: v[..., 0] for k, v in out.items()}
    return out


def literal_mean_ablation(base, batch):
    """Leave-one-out role-aligned means of every head's ``hook_result`` and MLP output."""
    B = attn_result_mode(base)
    with torch.no_grad():
        _, cache = B.run_with_cache(batch.tokens)
    cfg = base.cfg
    L = cfg.n_layers
    res = torch.stack([cache[f"blocks.{l}.attn.hook_result"] for l in range(L)], dim=2)  # b p l h d
    mlp = torch.stack([cache[f"blocks.{l}.hook_mlp_out"] for l in range(L)], dim=2) if not cfg.attn_only else None
    rs, ms = torch.zeros_like(res), (torch.zeros_like(mlp) if mlp is not None else None)
    for i, roles in enumerate(batch.roles):
        for t, r in enumerate(roles):
            others = [(j, rj.index(r)) for j, rj in enumerate(batch.roles) if j != i and r in rj]
            if not others:
                rs[i, t] = res[i, t]
                if mlp is not None:
                    ms[i, t] = mlp[i, t]
                continue
            rs[i, t] = torch.stack([res[j, tj] for j, tj in others]).mean(0)
            if mlp is not None:
                ms[i, t] = torch.stack([mlp[j, tj] for j, tj in others]).mean(0)
    return rs, ms


def scaled_model(base, ft, eps):
    """``W + eps (W' - W)`` as a new model."""
    m = copy.deepcopy(base)
    ftp = dict(ft.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(p + eps * (ftp[n] - p))
    return m


def whole_model_jvp(base, ft, batch, reward):
    """``d/dε R(W + εΔ)`` at 0, by forward-mode AD through the whole TransformerLens forward."""
    params = {n: p.detach() for n, p in base.named_parameters()}
    ftp = dict(ft.named_parameters())
    tangents = {n: (ftp[n].detach() - p) for n, p in params.items()}

    def f(ps):
        logits = torch.func.functional_call(base, ps, (batch.tokens,))
        return reward(logits, batch)

    _, dot = torch.func.jvp(f, (params,), (tangents,))
    return dot
