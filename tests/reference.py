"""Slow, literal reference implementations, independent of the package's scoring engine.

Everything here uses TransformerLens's own machinery: ``use_attn_result=True`` so each head's
write ``hook_result`` is a real hook point, ``run_with_cache`` / ``run_with_hooks``, one full
forward pass per intervention, and explicit model copies holding mixed weights. Nothing is
batched across interventions and nothing resumes mid-stream.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from extractive_lens.batch import PromptBatch


def hooked_only(*models):
    """These references run TransformerLens 3.9's ``HookedTransformer`` machinery (its hook
    names, ``use_attn_result``, ``setup()``): skip the test for any other model class (the
    TransformerLens 4 run; ``tests/test_backend_bridge.py`` checks bridges against references of
    their own)."""
    for m in models:
        if type(m).__name__ != "HookedTransformer":
            pytest.skip(f"the literal reference needs a HookedTransformer, got {type(m).__name__}")


def attn_result_mode(model):
    hooked_only(model)
    m = copy.deepcopy(model)
    m.cfg.use_attn_result = True
    m.setup()
    return m


def reward_of(model, batch: PromptBatch, reward, fwd_hooks=()):
    hooked_only(model)
    with torch.no_grad():
        logits = model.run_with_hooks(batch.tokens, fwd_hooks=list(fwd_hooks))
    return reward(logits, batch)


def mixed_model(base, ft, take_from_ft):
    """A copy of ``base`` whose parameters named by ``take_from_ft(name)`` come from ``ft``."""
    hooked_only(base, ft)
    m = copy.deepcopy(base)
    ft_params = dict(ft.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            if take_from_ft(n):
                p.copy_(ft_params[n])
    return m


def late_predicate(layer: int, head_component: bool, parallel: bool):
    """Parameters acting only after a component's output (docs/scores.md §4 ``W_late``)."""

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
    hooked_only(model_f)
    hooks = [
        (
            f"blocks.{layer}.hook_resid_pre",
            _replace(source_inputs[f"blocks.{layer}.hook_resid_pre"]),
        )
    ]
    if not model_f.cfg.parallel_attn_mlp and not model_f.cfg.attn_only:
        hooks.append(
            (
                f"blocks.{layer}.hook_resid_mid",
                _replace(source_inputs[f"blocks.{layer}.hook_resid_mid"]),
            )
        )
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
            y = (
                base_cache[f"blocks.{layer}.attn.hook_result"]
                if is_head
                else base_cache[f"blocks.{layer}.hook_mlp_out"]
            )
            patch_values = {
                kind: st["result"] if is_head else st["mlp"] for kind, st in layer_values.items()
            }
            for kind, new in patch_values.items():
                for i, pos in enumerate(positions):
                    hook = (
                        _patch_head(layer, c, pos, new) if is_head else _patch_mlp(layer, pos, new)
                    )
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
                    hook = (
                        _patch_head(layer, c, pos, star)
                        if is_head
                        else _patch_mlp(layer, pos, star)
                    )
                    U = (R_late - reward_of(Lm, batch, reward, [hook])) - (
                        R0 - reward_of(B, batch, reward, [hook])
                    )
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
    mlp = (
        torch.stack([cache[f"blocks.{l}.hook_mlp_out"] for l in range(L)], dim=2)
        if not cfg.attn_only
        else None
    )
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
    hooked_only(base, ft)
    m = copy.deepcopy(base)
    ftp = dict(ft.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(p + eps * (ftp[n] - p))
    return m


def whole_model_jvp(base, ft, batch, reward):
    """``d/dε R(W + εΔ)`` at 0, by forward-mode AD through the whole TransformerLens forward."""
    hooked_only(base, ft)
    params = {n: p.detach() for n, p in base.named_parameters()}
    ftp = dict(ft.named_parameters())
    tangents = {n: (ftp[n].detach() - p) for n, p in params.items()}

    def f(ps):
        logits = torch.func.functional_call(base, ps, (batch.tokens,))
        return reward(logits, batch)

    _, dot = torch.func.jvp(f, (params,), (tangents,))
    return dot


# ---------------------------------------------------------------- per-(component, token) linear references


def hooked_grads(model, batch, reward, names):
    """Activations at the hook points ``names`` and ``dR/d(activation)``, by autograd through
    TransformerLens's own forward (the embedding made a leaf so every hook is in the graph)."""
    hooked_only(model)
    store = {}

    def leaf(act, hook):
        return act.detach().requires_grad_(True)

    def save(act, hook):
        store[hook.name] = act
        return act

    with torch.enable_grad():
        logits = model.run_with_hooks(
            batch.tokens, fwd_hooks=[("hook_embed", leaf)] + [(n, save) for n in names]
        )
        R = reward(logits, batch)
        grads = torch.autograd.grad(R.sum(), [store[n] for n in names], allow_unused=True)
    return (
        {n: store[n].detach() for n in names},
        {n: (torch.zeros_like(store[n]) if g is None else g) for n, g in zip(names, grads)},
    )


def _hook_tangent(model, batch, name, tangents):
    """Tangent of the activation at hook ``name`` along the weight direction ``tangents``
    (``torch.func.jvp`` through the whole TransformerLens forward)."""
    hooked_only(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    full = {n: tangents.get(n, torch.zeros_like(p)) for n, p in params.items()}

    def f(ps):
        out = {}

        def grab(act, hook):
            out["v"] = act
            return act

        with model.hooks(fwd_hooks=[(name, grab)]):
            torch.func.functional_call(model, ps, (batch.tokens,))
        return out["v"]

    return torch.func.jvp(f, (params,), (full,))[1]


def linear_informative_paper(base, diff, batch, reward):
    """``Ī[batch, layer, component, pos]`` one component at a time: the tangent of that head's
    ``hook_result`` (or ``hook_mlp_out``) along the component's own Δ slices, times the gradient."""
    B = attn_result_mode(base)
    cfg = base.cfg
    L, H = cfg.n_layers, cfg.n_heads
    has_mlp = not cfg.attn_only
    names = [f"blocks.{l}.hook_attn_out" for l in range(L)] + (
        [f"blocks.{l}.hook_mlp_out" for l in range(L)] if has_mlp else []
    )
    _, g = hooked_grads(B, batch, reward, names)
    out = torch.zeros(len(batch), L, H + has_mlp, batch.tokens.shape[1], dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            own = diff.restricted([f"L{layer}H{h}"])
            tang = {n: d for n, d in own.deltas.items() if not n.endswith("b_O")}
            t = _hook_tangent(B, batch, f"blocks.{layer}.attn.hook_result", tang)[:, :, h]
            out[:, layer, h] = (g[f"blocks.{layer}.hook_attn_out"] * t).sum(-1)
        if has_mlp:
            t = _hook_tangent(
                B,
                batch,
                f"blocks.{layer}.hook_mlp_out",
                dict(diff.restricted([f"L{layer}MLP"]).deltas),
            )
            out[:, layer, H] = (g[f"blocks.{layer}.hook_mlp_out"] * t).sum(-1)
    return out


def authors_informative(base, diff, batch, reward):
    """The authors' code's head informative score per token, in closed form: Q and O parts at the
    query/output position, K and V parts at the key position (Δ without ln1 changes)."""
    hooked_only(base)
    assert not any(".ln1." in n for n in diff.deltas), "closed form needs an unchanged ln1"
    cfg = base.cfg
    L, H = cfg.n_layers, cfg.n_heads
    group = H // (cfg.n_key_value_heads or H)
    if group > 1:  # grouped-query: hook_k / hook_v per *query* head, each its own copy
        base = copy.deepcopy(base)
        base.cfg.ungroup_grouped_query_attention = True
    names = [
        f"blocks.{l}.{x}"
        for l in range(L)
        for x in (
            "ln1.hook_normalized",
            "attn.hook_q",
            "attn.hook_k",
            "attn.hook_v",
            "attn.hook_z",
            "hook_attn_out",
        )
    ]
    act, g = hooked_grads(base, batch, reward, names)
    out = torch.zeros(len(batch), L, H, batch.tokens.shape[1], dtype=torch.float64)
    for l in range(L):
        ln = base.blocks[l].ln1
        x = act[f"blocks.{l}.ln1.hook_normalized"] * ln.w + getattr(ln, "b", 0)
        for part in ("q", "k", "v"):
            W = diff.deltas.get(f"blocks.{l}.attn.W_{part.upper()}")
            b = diff.deltas.get(f"blocks.{l}.attn.b_{part.upper()}")
            if part != "q" and group > 1:  # the group's shared change, copied to each head
                W = diff.deltas.get(f"blocks.{l}.attn._W_{part.upper()}")
                b = diff.deltas.get(f"blocks.{l}.attn._b_{part.upper()}")
                W = None if W is None else W.repeat_interleave(group, dim=0)
                b = None if b is None else b.repeat_interleave(group, dim=0)
            if W is None and b is None:
                continue
            d = (0 if W is None else torch.einsum("bpd,hde->bphe", x, W)) + (0 if b is None else b)
            out[:, l] += (
                (g[f"blocks.{l}.attn.hook_{part}"] * d).sum(-1).transpose(1, 2)
            )  # at its own position
        if f"blocks.{l}.attn.W_O" not in diff.deltas:
            continue
        o = torch.einsum(
            "bphe,hed->bphd", act[f"blocks.{l}.attn.hook_z"], diff.deltas[f"blocks.{l}.attn.W_O"]
        )
        out[:, l] += (g[f"blocks.{l}.hook_attn_out"][:, :, None] * o).sum(-1).transpose(1, 2)
    return out


def layer_outputs_on(model_f, batch, layer, source_cache):
    """``hook_z`` and ``hook_mlp_out`` of ``model_f`` at ``layer`` on the inputs of another run."""
    hooks = [
        (f"blocks.{layer}.hook_resid_pre", _replace(source_cache[f"blocks.{layer}.hook_resid_pre"]))
    ]
    if not model_f.cfg.parallel_attn_mlp:
        hooks.append(
            (
                f"blocks.{layer}.hook_resid_mid",
                _replace(source_cache[f"blocks.{layer}.hook_resid_mid"]),
            )
        )
    store = {}

    def save(name):
        def hook(act, hook):
            store[name] = act.detach().clone()

        return hook

    hooks += [
        (f"blocks.{layer}.attn.hook_z", save("z")),
        (f"blocks.{layer}.hook_mlp_out", save("mlp")),
    ]
    with torch.no_grad():
        model_f.run_with_hooks(batch.tokens, fwd_hooks=hooks)
    return store


def linear_downstream_upstream_authors(base, ft, batch, reward):
    """The authors' convention at ``hook_z``: ``D̄ = dR/dz · (z' - z)`` and, with y* = 0,
    ``Ū = (dR/dz in the finetuned run - dR/dz in the base run) · z`` (MLPs likewise)."""
    cfg = base.cfg
    L, H = cfg.n_layers, cfg.n_heads
    names = [f"blocks.{l}.{x}" for l in range(L) for x in ("attn.hook_z", "hook_mlp_out")]
    act, g = hooked_grads(base, batch, reward, names)
    _, g_ft = hooked_grads(ft, batch, reward, names)
    with torch.no_grad():
        _, ft_cache = ft.run_with_cache(batch.tokens)
    T = batch.tokens.shape[1]
    down = torch.zeros(len(batch), L, H + 1, T, dtype=torch.float64)
    up = torch.zeros_like(down)
    for l in range(L):
        new = layer_outputs_on(base, batch, l, ft_cache)
        z, m = act[f"blocks.{l}.attn.hook_z"], act[f"blocks.{l}.hook_mlp_out"]
        gz, gm = g[f"blocks.{l}.attn.hook_z"], g[f"blocks.{l}.hook_mlp_out"]
        down[:, l, :H] = (gz * (new["z"] - z)).sum(-1).transpose(1, 2)
        down[:, l, H] = (gm * (new["mlp"] - m)).sum(-1)
        up[:, l, :H] = ((g_ft[f"blocks.{l}.attn.hook_z"] - gz) * z).sum(-1).transpose(1, 2)
        up[:, l, H] = ((g_ft[f"blocks.{l}.hook_mlp_out"] - gm) * m).sum(-1)
    return down, up


def linear_downstream_upstream_paper(base, ft, batch, reward):
    """The paper convention at each head's write ``hook_result``: ``D̄ = ŷ · (f(z', W) - y)`` and
    ``Ū = (ŷ' - ŷ) · (y - y*)`` with ``ŷ'`` from a literal copy holding ``W_late`` finetuned and y*
    the leave-one-out role mean."""
    B = attn_result_mode(base)
    cfg = base.cfg
    L, H = cfg.n_layers, cfg.n_heads
    names = [f"blocks.{l}.{x}" for l in range(L) for x in ("attn.hook_result", "hook_mlp_out")]
    act, g = hooked_grads(B, batch, reward, names)
    F = attn_result_mode(ft)
    with torch.no_grad():
        _, ft_cache = F.run_with_cache(batch.tokens)
    rs, ms = literal_mean_ablation(base, batch)
    T = batch.tokens.shape[1]
    down = torch.zeros(len(batch), L, H + 1, T, dtype=torch.float64)
    up = torch.zeros_like(down)
    for l in range(L):
        new = component_outputs(B, batch, l, ft_cache)
        y, m = act[f"blocks.{l}.attn.hook_result"], act[f"blocks.{l}.hook_mlp_out"]
        gy, gm = g[f"blocks.{l}.attn.hook_result"], g[f"blocks.{l}.hook_mlp_out"]
        down[:, l, :H] = (gy * (new["result"] - y)).sum(-1).transpose(1, 2)
        down[:, l, H] = (gm * (new["mlp"] - m)).sum(-1)
        for is_head in (True, False):
            late = attn_result_mode(
                mixed_model(base, ft, late_predicate(l, is_head, cfg.parallel_attn_mlp))
            )
            name = f"blocks.{l}.attn.hook_result" if is_head else f"blocks.{l}.hook_mlp_out"
            _, gl = hooked_grads(late, batch, reward, [name])
            if is_head:
                up[:, l, :H] = ((gl[name] - gy) * (y - rs[:, :, l])).sum(-1).transpose(1, 2)
            else:
                up[:, l, H] = ((gl[name] - gm) * (m - ms[:, :, l])).sum(-1)
    return down, up


# ---------------------------------------------------------------- path-integrated references


def literal_path_integral(model, batch, reward, layer, head, y, delta, xs, ws):
    """``Σ_i w_i d/dγ_t R(component output = y + γδ)`` at ``γ = x_i``, by position
    ``[batch, pos]``, by autograd through ``model`` with a per-position γ per prompt."""
    hooked_only(model)
    b, T = batch.tokens.shape
    out = torch.zeros(b, T, dtype=torch.float64)
    for x, w in zip(xs, ws):
        gammas = torch.full((b, T), float(x), dtype=y.dtype, requires_grad=True)

        def hook(act, hook, gammas=gammas):
            act = act.clone()
            new = y + gammas[:, :, None] * delta
            if head is None:
                return new
            act[:, :, head] = new
            return act

        name = (
            f"blocks.{layer}.hook_mlp_out" if head is None else f"blocks.{layer}.attn.hook_result"
        )
        logits = model.run_with_hooks(batch.tokens, fwd_hooks=[(name, hook)])
        (g,) = torch.autograd.grad(reward(logits, batch).sum(), [gammas])
        out += w * g.double()
    return out


def literal_integrated(base, ft, batch, reward, kinds, y_star, xs, ws):
    """Path-integrated upstream / downstream scores ``{kind: [batch, layer, component, pos]}``:
    each component's exact patch applied gradually (``y + γδ``) in the base model and, for
    upstream, in the model with the layers after it finetuned; integrated with nodes ``xs`` and
    weights ``ws``; combined as the exact scores combine patch effects."""
    Bm = attn_result_mode(base)
    F = attn_result_mode(ft)
    cfg = base.cfg
    L, H, T = cfg.n_layers, cfg.n_heads, batch.tokens.shape[1]
    has_mlp = not cfg.attn_only
    with torch.no_grad():
        _, base_cache = Bm.run_with_cache(batch.tokens)
        _, ft_cache = F.run_with_cache(batch.tokens)
    out = {k: torch.zeros(len(batch), L, H + has_mlp, T, dtype=torch.float64) for k in kinds}
    for layer in range(L):
        down = component_outputs(Bm, batch, layer, ft_cache) if "downstream" in kinds else None
        late = {}
        for c in range(H + has_mlp):
            is_head = c < H
            head = c if is_head else None
            y = (
                base_cache[f"blocks.{layer}.attn.hook_result"][:, :, c]
                if is_head
                else base_cache[f"blocks.{layer}.hook_mlp_out"]
            )
            if down is not None:
                new = down["result"][:, :, c] if is_head else down["mlp"]
                out["downstream"][:, layer, c] = literal_path_integral(
                    Bm, batch, reward, layer, head, y, new - y, xs, ws
                )
            if "upstream" in kinds:
                key = "head" if is_head else "mlp"
                if key not in late:
                    late[key] = attn_result_mode(
                        mixed_model(base, ft, late_predicate(layer, is_head, cfg.parallel_attn_mlp))
                    )
                rs, ms = y_star
                star = rs[:, :, layer, c] if is_head else ms[:, :, layer]
                d = star.to(y.dtype) - y
                in_base = literal_path_integral(Bm, batch, reward, layer, head, y, d, xs, ws)
                in_late = literal_path_integral(late[key], batch, reward, layer, head, y, d, xs, ws)
                out["upstream"][:, layer, c] = in_base - in_late
    return out


def literal_integrated_informative(base, ft, batch, reward, xs, ws):
    """``Σ_i w_i Ī(W + x_iΔ)``: the reference linear informative scores at each node's model."""
    from extractive_lens import WeightDiff

    total = None
    for x, w in zip(xs, ws):
        m = scaled_model(base, ft, x)
        diff = WeightDiff.from_models(m, scaled_model(base, ft, x + 1.0))  # the same Δ, from m
        part = w * linear_informative_paper(m, diff, batch, reward)
        total = part if total is None else total + part
    return total
